"""P's reclaim after a partition of the vLLM job (``--partition-at`` with
``--hosts netns``), read from the prefill engines' event logs: every lease
granted before the heal that expired after the cut without a heartbeat
after the heal (its completion or heartbeats lost on the link) must be freed
within the lease term from the cut (from its grant, for one granted while the
link was down), plus slack.  The logs' times are each rank's monotonic clock,
the clock this job's process reads too (one machine; network namespaces do
not change clocks)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

# Timer slack: a rank's plane steps every few ms; allow for scheduling on a busy 2-core box.
SLACK_S = 0.5


@attrs.define
class LeaseSpan:
    """One lease of a prefill rank's log: when granted, last heartbeated, ended, and how."""

    granted: float
    last_heartbeat: float | None = None
    ended: float | None = None
    end_state: str | None = None  # EXPIRED | RELEASED


def lease_spans(log: Path) -> dict[str, LeaseSpan]:
    """Each lease machine of one event log, by its id (unparsable lines are skipped:
    replay, not this, judges a log)."""
    spans: dict[str, LeaseSpan] = {}
    with open(log, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            machine = rec.get("machine") if isinstance(rec, dict) else None
            if not isinstance(machine, str) or not machine.startswith("lease:"):
                continue
            t, event, after = rec.get("t"), rec.get("event"), rec.get("state_after")
            if not isinstance(t, (int, float)):
                continue
            if event == "LeaseGranted":
                spans[machine] = LeaseSpan(granted=float(t))
            elif machine in spans:
                span = spans[machine]
                if event == "LeaseHeartbeat":
                    span.last_heartbeat = float(t)
                if after in ("EXPIRED", "RELEASED") and span.ended is None:
                    span.ended, span.end_state = float(t), after
    return spans


def partition_reclaim(logs: list[Path], *, cut: float, healed: float | None, lease: float,
                      stall_s: float) -> dict[str, Any]:
    """The stranded leases of every log and how long after the cut (or their
    grant) P freed them, against the lease term + slack (SLACK_S plus the
    longest any prefill rank's plane went unstepped: a starved process frees late)."""
    end = healed if healed is not None else float("inf")
    stranded = [s for log in logs if log.exists() for s in lease_spans(log).values()
                if s.end_state == "EXPIRED" and s.ended is not None and s.granted < end and s.ended >= cut
                and (s.last_heartbeat is None or s.last_heartbeat < end)]
    still_live = sum(1 for log in logs if log.exists() for s in lease_spans(log).values() if s.ended is None)
    slack = round(SLACK_S + stall_s, 3)
    out: dict[str, Any] = {"lease_s": lease, "slack_s": slack, "leases_expired": len(stranded),
                           "leases_never_ended": still_live}
    if not stranded:
        out.update(reclaim_s=None, within_bound=still_live == 0)
        return out
    reclaim = [s.ended - max(cut, s.granted) for s in stranded if s.ended is not None]
    out.update(reclaim_s=round(max(reclaim), 3), reclaim_min_s=round(min(reclaim), 3),
               within_bound=max(reclaim) <= lease + slack and still_live == 0)
    return out
