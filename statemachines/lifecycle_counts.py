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
    eviction in the machine), each eviction also listed with its time and
    cause (``evictions``: "silence" for engine_ttl without activity,
    "handshake failed" for a failed engine forgotten, else the disconnect's
    reason)."""

    KINDS = ("lease", "remote_engine")  # the only kinds it counts: wrap these

    leases: Counter = attrs.Factory(Counter)
    engines_evicted: int = 0
    evictions: list = attrs.Factory(list)

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
            self.evictions.append({"engine": step.key, "at": step.now, "cause": _cause(step)})

    def to_dict(self) -> dict:
        """``{"leases": {granted, extended, expired, released}, "engines_evicted": n,
        "evictions": [{engine, at, cause}, ...]}``."""
        return {"leases": {what: self.leases[what] for what in LEASE_COUNTS}, "engines_evicted": self.engines_evicted,
                "evictions": [dict(e) for e in self.evictions]}

    @staticmethod
    def total(parts: list[dict]) -> dict:
        """The sum of several ``to_dict()`` (one per worker rank's plane)."""
        leases: Counter = Counter()
        for p in parts:
            leases.update(p["leases"])
        return {"leases": {what: leases[what] for what in LEASE_COUNTS},
                "engines_evicted": sum(p["engines_evicted"] for p in parts),
                "evictions": sorted((e for p in parts for e in p.get("evictions", ())), key=lambda e: e["at"])}


def _cause(step: Step) -> str:
    """Why a remote engine was evicted (see ``LifecycleCounts``)."""
    if type(step.event).__name__ == "TimerFired":
        return "silence" if step.state_before == "STALE" else "handshake failed"
    return str(getattr(step.event, "reason", "") or type(step.event).__name__)


def eviction_words(count: int, evictions: list) -> str:
    """``"3 (silence 1, shutdown 2)"``: how many, and why (what the run's
    table and ``kvplane replay`` print)."""
    causes = Counter(e["cause"] for e in evictions)
    if not causes:
        return str(count)
    return f"{count} ({', '.join(f'{cause} {n}' for cause, n in sorted(causes.items()))})"
