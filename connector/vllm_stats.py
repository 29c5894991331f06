"""The counts kvplane's vLLM connector reports, without vLLM.

``PlaneTally`` watches one rank's plane (one of its observers) and
counts what the driver's own counters do not: transfers failed, leases
expired, reads declined by the expiry gate, lease extensions.  ``Snapshot``
reads the rank's counts and gauges; vLLM's ``KVConnectorStats`` carries the
difference of two snapshots (counts) plus the latest gauges per rank, and
``merge``/``reduce`` are its aggregate/reduce.

Names: vLLM's NixlConnector names where the count means the same
(``num_failed_transfers``, ``num_failed_notifications``,
``num_failed_handshakes``, ``num_kv_expired_reqs``,
``bytes_transferred``, ``num_successful_transfers``), ``kvplane_*`` for the
rest.  The scheduler half adds its own counts (``scheduler_stats_data``):
params refused (``kvplane_refused_params``: unauthenticated, tampered,
another prompt's, replayed, malformed) and dump tags refused.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from kvplane.statemachines import events as E
from kvplane.statemachines.actions import FreeBlocks, ReportRecv
from kvplane.statemachines.recv_failure import RecvFailure
from kvplane.statemachines.stats import PROTOCOL_VIOLATION, Anomaly, FailClosed

COUNT_KEYS = (
    "num_successful_transfers", "bytes_transferred", "num_failed_transfers", "num_failed_notifications",
    "num_failed_handshakes", "num_kv_expired_reqs",
    "kvplane_declined_reads", "kvplane_failed_recvs", "kvplane_protocol_errors", "kvplane_fail_closed",
    "kvplane_lease_extensions", "kvplane_heartbeats_sent", "kvplane_heartbeats_received",
    "kvplane_refused_notifications", "kvplane_leases_consumed", "kvplane_leases_aborted",
    "kvplane_engines_evicted", "kvplane_refused_params", "kvplane_refused_dump_tags", "kvplane_unpaired_groups",
)
GAUGE_KEYS = ("kvplane_blocks_held", "kvplane_leases", "kvplane_recvs_in_flight", "kvplane_remote_engines")


class PlaneTally:
    """A plane observer counting outcomes (``plane.observe(tally)``)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def __call__(self, step: Any) -> None:
        event = step.event
        if step.kind == "lease" and isinstance(event, E.LeaseHeartbeat):
            self.counts["kvplane_lease_extensions"] += 1
        elif step.kind == "decode_request" and isinstance(event, E.ReadFailed):
            self.counts["num_failed_transfers"] += 1
        for action in step.actions:
            if isinstance(action, FreeBlocks):
                self.counts[f"leases_{action.reason}"] += 1
            elif isinstance(action, ReportRecv) and not action.ok:
                self.counts["kvplane_failed_recvs"] += 1
                if action.reason == RecvFailure.DECLINED:
                    self.counts["kvplane_declined_reads"] += 1


def snapshot(driver: Any, tally: PlaneTally) -> tuple[dict[str, int], dict[str, int]]:
    """(cumulative counts, gauges) of one rank."""
    c = driver.counters
    plane = driver.plane
    protocol = fail_closed = 0
    for key, n in plane.stats.items():
        if isinstance(key, Anomaly) and key.what == PROTOCOL_VIOLATION:
            protocol += n
        elif isinstance(key, FailClosed):
            fail_closed += n
    refused = sum(n for k, n in c.items() if k.startswith("refused_")) + c["notifs_unknown_sender"] + \
        c["notifs_malformed"] + c["notifs_unknown_lease"]
    t = tally.counts
    counts = {
        "num_successful_transfers": c["reads_done"] + c["writes_done"],
        "bytes_transferred": c["bytes_moved"],
        "num_failed_transfers": t["num_failed_transfers"],
        "num_failed_notifications": c["notifs_failed"] + c["notifs_unsent_not_connected"] + c["heartbeats_failed"],
        "num_failed_handshakes": c["handshakes_failed"],
        "num_kv_expired_reqs": t["leases_expired"],
        "kvplane_declined_reads": t["kvplane_declined_reads"],
        "kvplane_failed_recvs": t["kvplane_failed_recvs"],
        "kvplane_protocol_errors": protocol,
        "kvplane_fail_closed": fail_closed,
        "kvplane_lease_extensions": t["kvplane_lease_extensions"],
        "kvplane_heartbeats_sent": plane.stats.get("heartbeats_sent", 0),
        "kvplane_heartbeats_received": c["heartbeats_received"],
        "kvplane_refused_notifications": refused,
        "kvplane_leases_consumed": t["leases_consumed"],
        "kvplane_leases_aborted": t["leases_aborted"],
        "kvplane_engines_evicted": c["engines_evicted"],
    }
    leases = plane.instances["lease"]
    recvs = plane.instances["decode_request"]
    gauges = {
        "kvplane_blocks_held": sum(len(lease.block_ids) for lease in leases.values()),
        "kvplane_leases": len(leases),
        "kvplane_recvs_in_flight": len(recvs),
        "kvplane_remote_engines": len(plane.instances["remote_engine"]),
    }
    return counts, gauges


def stats_data(rank: int, counts: dict[str, int], gauges: dict[str, int]) -> dict[str, Any]:
    """The payload of one rank's KVConnectorStats (msgspec/pickle-friendly)."""
    return {"counts": dict(counts), "gauges": {str(rank): dict(gauges)}}


def scheduler_stats_data(counts: dict[str, int]) -> dict[str, Any]:
    """The scheduler half's KVConnectorStats payload: counts, no gauges."""
    return {"counts": dict(counts)}


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Counts add up; gauges keep each rank's latest."""
    counts = Counter(a.get("counts", {}))
    counts.update(b.get("counts", {}))
    return {"counts": dict(counts), "gauges": {**a.get("gauges", {}), **b.get("gauges", {})}}


def reduce(data: dict[str, Any]) -> dict[str, int]:
    out = {k: int(data.get("counts", {}).get(k, 0)) for k in COUNT_KEYS}
    for key in GAUGE_KEYS:
        out[key] = sum(int(g.get(key, 0)) for g in data.get("gauges", {}).values())
    return out


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get("counts", {}).values()) and not data.get("gauges")
