"""Lease and engine lifecycles counted from the machines' own transitions.

One observer, used by ``replay`` (what ``kvplane replay`` prints) and by the
main job's worker ranks on their live planes (what ``kvplane run``'s summary
prints), so the run's table and a replay of the run's logs count the same
transitions the same way.  It needs transition steps (``observe.observed``
wraps the kinds in ``KINDS``): a lease extended by a heartbeat, an engine
evicted through a cascade, are transitions no top-level step shows.
"""
from __future__ import annotations

from collections import Counter

import attrs

from .observe import Step

# The lease ends it counts (a lease machine's terminal states).
LEASE_ENDS = ("EXPIRED", "RELEASED")
LEASE_COUNTS = ("granted", "extended", "expired", "released")


@attrs.define
class LifecycleCounts:
    """Leases granted / extended (the deadline moved) / expired / released,
    and remote engines evicted (a shutdown's disconnect included: it is an
    eviction in the machine)."""

    KINDS = ("lease", "remote_engine")  # the only kinds it counts: wrap these

    leases: Counter = attrs.Factory(Counter)
    engines_evicted: int = 0

    def __call__(self, step: Step) -> None:
        kind, before, after = step.kind, step.state_before, step.state_after
        if kind == "lease":
            if before == "PREFILLING" and after == "LEASED":
                self.leases["granted"] += 1
            elif (before == after and type(step.event).__name__ == "LeaseHeartbeat"
                  and step.instance is not None and step.instance.deadline != step.deadline_before):
                self.leases["extended"] += 1
            elif after in LEASE_ENDS and before != after:
                self.leases[after.lower()] += 1
        elif kind == "remote_engine" and after == "EVICTED" and before != after:
            self.engines_evicted += 1

    def to_dict(self) -> dict:
        """``{"leases": {granted, extended, expired, released}, "engines_evicted": n}``."""
        return {"leases": {what: self.leases[what] for what in LEASE_COUNTS}, "engines_evicted": self.engines_evicted}

    @staticmethod
    def total(parts: list[dict]) -> dict:
        """The sum of several ``to_dict()`` (one per worker rank's plane)."""
        leases: Counter = Counter()
        for p in parts:
            leases.update(p["leases"])
        return {"leases": {what: leases[what] for what in LEASE_COUNTS},
                "engines_evicted": sum(p["engines_evicted"] for p in parts)}
