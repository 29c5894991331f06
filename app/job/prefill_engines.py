"""Several prefill engines (``--prefill-engines N``) in one report: their
reports merged into one prefill side, so that every check about P (blocks
held, leases reclaimed within their bound, evictions) holds for all of them
together, and each engine's own line (what it held, leases granted and
consumed)."""
from __future__ import annotations

from typing import Any, Iterable

import attrs

from kvplane.statemachines.lifecycle_counts import LifecycleCounts

from .messages import Summary


def _added(dicts: Iterable[dict]) -> dict:
    """Counts of several engines added up (nested counts too; anything not
    a number keeps the first engine's value)."""
    total: dict = {}
    for d in dicts:
        for k, v in d.items():
            if k not in total:
                total[k] = dict(v) if isinstance(v, dict) else v
            elif isinstance(v, dict) and isinstance(total[k], dict):
                total[k] = _added([total[k], v])
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(total[k], (int, float)):
                total[k] = total[k] + v
    return total


def _loop(loops: list[dict]) -> dict:
    """The engines' step loops as one: the longest gap of any, every listed gap and stall."""
    first = loops[0]
    return {**first, "max_gap_s": max(lp["max_gap_s"] for lp in loops),
            "gaps_over_report": sum(lp["gaps_over_report"] for lp in loops),
            "long_gaps": sorted((g for lp in loops for g in lp["long_gaps"]), key=lambda g: g[0]),
            "stalls": [s for lp in loops for s in lp["stalls"]]}


def _slowest(calls: list[dict]) -> dict:
    """The slowest NIXL call of each kind over the engines."""
    out: dict[str, Any] = {}
    for c in calls:
        for kind, s in (c.get("max_s") or {}).items():
            out.setdefault("max_s", {})[kind] = max(s, out.get("max_s", {}).get(kind, s))
    return {**(calls[0] if calls else {}), **out}


def merged(sides: list[Summary]) -> Summary:
    """One Summary for several prefill engines (at least one)."""
    if len(sides) == 1:
        return sides[0]
    first = sides[0]
    offsets: dict[str, float] = {}
    for s in sides:  # the largest offset any engine measured, as each engine keeps per rank
        for engine, off in s.clock_offsets.items():
            offsets[engine] = max(off, offsets.get(engine, off))
    hbs = [s.last_hb_at for s in sides if s.last_hb_at is not None]
    return attrs.evolve(
        first, role="P", engine_id=",".join(s.engine_id for s in sides),
        outcomes=_added(s.outcomes for s in sides), verified_bytes=sum(s.verified_bytes for s in sides),
        bytes_moved=sum(s.bytes_moved for s in sides), busy_s=sum(s.busy_s for s in sides),
        counters=_added(s.counters for s in sides), engines_evicted=sum(s.engines_evicted for s in sides),
        engines_closed_at_shutdown=sum(s.engines_closed_at_shutdown for s in sides),
        heartbeats_sent=sum(s.heartbeats_sent for s in sides),
        heartbeats_received=sum(s.heartbeats_received for s in sides),
        leases=_added(s.leases for s in sides), lease_records=[r for s in sides for r in s.lease_records],
        holds=_added(s.holds for s in sides), last_hb_at=max(hbs) if hbs else None,
        held_blocks=sum(s.held_blocks for s in sides), plane_held=[h for s in sides for h in s.plane_held],
        anomalies=_added(s.anomalies for s in sides), stalls=[x for s in sides for x in s.stalls],
        loop=_loop([s.loop for s in sides]), clock_offsets=offsets,
        nixl_calls=_slowest([s.nixl_calls for s in sides]),
        recompute_reasons=_added(s.recompute_reasons for s in sides),
        abandoned=_added(s.abandoned for s in sides), waited_for_blocks=_added(s.waited_for_blocks for s in sides),
        ranks=[r for s in sides for r in s.ranks],
        lifecycle=LifecycleCounts.total([s.lifecycle for s in sides if s.lifecycle]),
        lost_ranks=[r for s in sides for r in s.lost_ranks],
        rank_crashes={f"{s.engine_id}/{k}": v for s in sides for k, v in s.rank_crashes.items()},
        transfers=[t for s in sides for t in s.transfers], bare_reads=[b for s in sides for b in s.bare_reads],
        plane_cpu_s=sum(s.plane_cpu_s for s in sides), plane_gc_s=sum(s.plane_gc_s for s in sides),
        plane_apart_s=sum(s.plane_apart_s for s in sides))


def prefill_engines(prefills: dict[str, Summary | None], requests_by_role: dict[str, int]) -> list[dict]:
    """Each prefill engine: its id, the requests routed to it, what it still holds, its leases."""
    out = []
    for role, s in prefills.items():
        leases = s.leases if s else {}
        out.append({"role": role, "engine_id": s.engine_id if s else None,
                    "requests": requests_by_role.get(role, 0), "held_blocks": s.held_blocks if s else None,
                    "leases_granted": leases.get("granted"), "leases_consumed": leases.get("consumed"),
                    "leases_expired": leases.get("expired"), "bytes_moved": s.bytes_moved if s else None})
    return out
