"""What ``kvplane run`` reports: the summary (summary.json) built from the
orchestrator's request records and both sides' reports, its checks, P's
reclaim after a fault measured against the lease promise, and the console
table."""
from __future__ import annotations

import math
import os
from typing import Any, Protocol

import attrs

from kvplane.connector.ranks import base_engine_id
from kvplane.statemachines.lifecycle_counts import eviction_words

from .messages import Summary
from .options import ENGINE_IDS, SLACK_S, RunOptions
from .prefill_engines import merged, prefill_engines
from .transfer_stats import TransferStats
from .workload import Req


@attrs.define
class Partition:
    """One cut of the --hosts netns link (monotonic times; ``end`` None while cut)."""

    start: float
    end: float | None


class RunRecord(Protocol):
    """What the report reads of a finished run (the orchestrator is one);
    a protocol, so that the report does not import the orchestrator."""

    o: RunOptions
    reqs: list[Req]
    t0: float
    fault: dict[str, Any]
    fault_at: float | None
    errors: list[str]
    startup_s: float | None
    abandoned: dict | None
    partitions: list[Partition]
    hosts: Any  # netns.HostNet of a --hosts netns run, else None

    def elapsed(self) -> float: ...

    def summary_of(self, role: str) -> Summary | None: ...

    def decode_summaries(self) -> dict[str, Summary | None]: ...

    def prefill_summaries(self) -> dict[str, Summary | None]: ...

    def killed_roles(self) -> list[str]: ...


def build_summary(orch: RunRecord) -> dict:
    """The run's summary (written as summary.json): outcomes, checks, both sides' reports."""
    o = orch.o
    # Every prefill engine (one unless --prefill-engines) as one prefill side: P's checks hold for all.
    prefills = orch.prefill_summaries()
    reported = [s for s in prefills.values() if s is not None]
    P = merged(reported) if reported else None
    D = orch.summary_of("D")
    # Every decode engine (one unless --decode-engines); the killed one sent no report.
    decoders = orch.decode_summaries()
    killed_roles = orch.killed_roles()
    survivors = {role: s for role, s in decoders.items() if role not in killed_roles}
    sides = [s for s in (*reported, *decoders.values()) if s]
    t1 = {k: 0 for k in ("ok", "recomputed", "corrupt", "failed", "skipped", "abandoned", "pending")}
    t2 = dict(t1)
    for r in orch.reqs:
        t1[r.turn1 or "pending"] += 1
        if r.hold:
            t2[r.turn2 or "pending"] += 1
    late = [r for r in orch.reqs if r.late and r.turn2 not in (None, "skipped", "abandoned")]
    on_time = [r for r in orch.reqs if r.hold and not r.late and r.turn2 not in (None, "skipped", "abandoned")]
    moved = sum(s.bytes_moved for s in sides)
    busy = sum(s.busy_s for s in sides)
    verified = sum(s.verified_bytes for s in sides)
    wall = orch.elapsed()
    # Only a run without faults, drops or a timeout must read everything.
    clean = o.drop_notifications == 0 and orch.fault_at is None and orch.abandoned is None and not orch.partitions
    checks: dict[str, Any] = {}
    checks["no_errors"] = not orch.errors
    checks["p_blocks_held_zero"] = len(reported) == len(prefills) and all(s.held_blocks == 0 for s in reported)
    # A killed engine sends no report; a killed rank's engine does.
    killed = orch.fault.get("kind") == "kill" and "rank" not in orch.fault
    if len(decoders) > 1:  # the survivors: each must have reported, holding nothing
        checks["d_blocks_held_zero"] = all(s is not None and s.held_blocks == 0 for s in survivors.values())
    else:
        checks["d_blocks_held_zero"] = None if killed else bool(D) and D.held_blocks == 0
    checks["no_corrupt_bytes"] = t1["corrupt"] == 0 and t2["corrupt"] == 0
    checks["all_requests_resolved"] = t1["pending"] == 0 and t2["pending"] == 0
    checks["late_turn2_declined"] = all(r.turn2 == "recomputed" for r in late)
    checks["on_time_turn2_read"] = all(r.turn2 == "ok" for r in on_time) if clean else None
    if clean:
        checks["all_turn1_ok"] = t1["ok"] == o.requests
    expired_early = None
    for role, side in (("P", P), ("D", D)):
        if side and side.ranks:
            checks[f"{role.lower()}_every_rank_holds_nothing"] = all(
                r["lease_blocks_held"] == 0 and r["plane_held"] == 0 for r in side.ranks)
    if P:
        recs = P.lease_records
        cut = min([orch.fault_at if orch.fault_at is not None else math.inf] + [w.start for w in orch.partitions])
        if o.drop_notifications == 0:
            # Heartbeats flowed until the fault (if any): no lease may expire before it.
            expired_early = [r.id for r in recs if r.reason == "expired" and r.freed < cut]
            checks["no_lease_expired_while_heartbeats_flowed"] = not expired_early
    if orch.fault_at is not None and P:
        orch.fault.update(_reclaim(orch, P))
        checks["p_reclaimed_within_bound"] = orch.fault.get("within_bound", False)
    partitions = [_partition_reclaim(orch, P, w) for w in orch.partitions] if P else []
    if orch.fault.get("kind") == "restart" and P:
        # The new incarnation must not consume what was leased for the old one's reads.
        # (A completion the old one sent before it died may still arrive: only one freed after
        # the new incarnation was up counts.)
        stranded = {f"p-{lid}" for lid in orch.fault.get("old_incarnation_in_flight", [])}
        back = orch.t0 + orch.fault.get("back_at_s", math.inf)
        consumed = [r.id for r in P.lease_records if r.id in stranded and r.reason == "consumed"
                    and r.freed is not None and r.freed >= back]
        orch.fault["old_incarnation_leases"] = {"in_flight": len(stranded), "consumed_after": consumed}
        checks["old_incarnation_leases_not_consumed"] = not consumed
        checks["restarted_engine_came_back"] = "back_at_s" in orch.fault
    if orch.fault.get("kind") == "kill" and len(decoders) > 1 and P:
        orch.fault["p_evicted"] = _eviction_of_killed(orch, P)
        checks["p_evicted_killed_engine"] = orch.fault["p_evicted"]["within_bound"]
    if orch.partitions:
        checks["p_reclaimed_within_lease_after_partition"] = bool(P) and all(p["within_bound"] for p in partitions)
    summary = {
        "options": attrs.asdict(o), "plane_config": attrs.asdict(o.plane_config()), "wall_s": round(wall, 3),
        "requests": {"turn1": t1, "turn2": t2, "total": o.requests,
                     "multiturn": sum(r.hold for r in orch.reqs), "late_turn2": len(late)},
        "bytes_moved": moved, "bytes_verified": verified, "transfer_busy_s": round(busy, 4),
        "gbps_in_flight": round(moved / busy / 1e9, 3) if busy > 0 else None,
        "gbps_wall": round(moved / wall / 1e9, 4) if wall > 0 else None,
        "data_path": data_path(P, D),
        "leases": P.leases if P else None,
        "holds": (D.holds if D else None) if len(decoders) == 1 else _merged(s.holds for s in decoders.values() if s),
        "heartbeats_sent": sum(s.heartbeats_sent for s in sides),
        "heartbeats_received": sum(s.heartbeats_received for s in sides),
        "engines_evicted": sum(s.engines_evicted for s in sides),
        # Each side's evictions by its machines: which engine, when (its plane's clock), why.
        "evictions": {role: (s.lifecycle or {}).get("evictions", []) for role, s in (("P", P), *decoders.items()) if s},
        "blocks_held": {"P": P.held_blocks if P else None,
                        "D": (D.held_blocks if D else None) if len(decoders) == 1 else
                        (sum(s.held_blocks for s in survivors.values()) if all(survivors.values()) else None)},
        "decode_engines": _decode_engines(decoders, killed_roles),
        "prefill_engines": prefill_engines(prefills, {role: sum(r.prefiller == role for r in orch.reqs)
                                                      for role in prefills}),
        # Each side's planes' LifecycleCounts (summed over its ranks): the table's lease rows.
        "lifecycle": {role: side.lifecycle if side else None for role, side in (("P", P), ("D", D))},
        "tp": {"P": o.prefill_tp, "D": o.decode_tp},
        # Per worker rank: lease blocks its plane still held at the end, heartbeats, leases ended.
        "ranks": {role: side.ranks if side else None for role, side in (("P", P), ("D", D))},
        "lost_ranks": {role: side.lost_ranks if side else None for role, side in (("P", P), ("D", D))},
        "clock_skew": o.clock_skew,
        "p_estimated_offset_of_d": P.clock_offsets.get(ENGINE_IDS["D"]) if P else None,
        "fault": orch.fault or None, "errors": orch.errors, "checks": checks,
        "hosts": _hosts_brief(orch), "partitions": partitions,
        "startup_s": None if orch.startup_s is None else round(orch.startup_s, 3),
        # What a timeout (or a crashed side) made the job give up; None when it ran to the end.
        "abandoned": orch.abandoned,
        # Why reads were recomputed: turn 1 is D reading P, turn 2 P reading D.
        "recompute_reasons": {"turn1": (D.recompute_reasons if D else None) if len(decoders) == 1 else
                              _merged(s.recompute_reasons for s in decoders.values() if s),
                              "turn2": P.recompute_reasons if P else None},
        # Each side's step loop: its longest gap between ticks (how late a timer can fire).
        "loop": {role: _loop_brief(side) for role, side in (("P", P), ("D", D))},
        "expired_before_fault": expired_early,
        "sides": {"P": _slim(P), "D": _slim(D)},
        # A side that sent no report (killed): the sums above lack its share.
        "sides_without_report": [role for role, side in (*prefills.items(), *decoders.items()) if side is None],
        # Written by each side as it runs; a killed side's log ends where it died.
        "logs": {role: os.path.join(os.path.abspath(o.out), f"{name}.events.jsonl")
                 for role, name in (("P", "prefill"), *((r, f"prefill{r[1:]}") for r in prefills if r != "P"),
                                    ("D", "decode"), *((r, f"decode{r[1:]}") for r in decoders if r != "D"))},
        "requests_detail": [attrs.asdict(r, filter=lambda a, v: a.name != "hold_params") for r in orch.reqs],
    }
    # The plane's CPU (recorder on) per request sent, each side summed over its ranks (app.job.plane_cpu).
    sent = sum(t1.values()) - t1["skipped"]
    summary["plane_cpu_us_per_request"] = {role: round(side.plane_cpu_s / sent * 1e6, 1) if side and sent else None
                                           for role, side in (("P", P), ("D", D))}
    summary["plane_gc_us_per_request"] = {role: round(side.plane_gc_s / sent * 1e6, 1) if side and sent else None
                                          for role, side in (("P", P), ("D", D))}
    # Not in plane_cpu_us_per_request: the job's own observers inside the plane's calls (its counts).
    summary["plane_job_observers_us_per_request"] = {
        role: round(side.plane_apart_s / sent * 1e6, 1) if side and sent else None for role, side in (("P", P), ("D", D))}
    summary["wall_with_startup_s"] = round(wall + (orch.startup_s or 0.0), 3)
    summary["ok"] = all(v is not False for v in checks.values())
    summary["check_reasons"] = check_reasons(summary)
    return summary


def data_path(P: Summary | None, D: Summary | None) -> dict:
    """Each transfer from post to done (both sides' ranks), and a bare NIXL
    READ of the same sizes made beside them by D's rank 0 (one after each of its
    READs, when it is next idle: the same load, the same run)."""
    sides = [s for s in (P, D) if s]
    reads = TransferStats.of(t for s in sides for t in s.transfers if t.op == "READ")
    writes = TransferStats.of(t for s in sides for t in s.transfers if t.op == "WRITE")
    bare = TransferStats.of(D.bare_reads) if D else None
    return {"reads": reads.to_dict() if reads else None, "writes": writes.to_dict() if writes else None,
            "bare_nixl_read": bare.to_dict() if bare else None,
            "read_gbps_vs_bare": round(reads.gbps / bare.gbps, 4) if reads and bare else None,
            "bare_read_error": D.bare_read_error if D else None}


def check_reasons(summary: dict) -> dict[str, str]:
    """Why each failed check failed, in words, from the summary's own data
    (the console table shows it beside FAIL)."""
    checks = summary["checks"]
    t1, t2 = summary["requests"]["turn1"], summary["requests"]["turn2"]
    detail = summary.get("requests_detail") or []
    bh = summary["blocks_held"]
    fault = summary.get("fault") or {}

    def outcomes(rs: list) -> str:
        counts: dict[str, int] = {}
        for r in rs:
            counts[str(r.get("turn2"))] = counts.get(str(r.get("turn2")), 0) + 1
        return ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))

    def blocks(role: str) -> str:
        return f"{role} sent no report" if bh[role] is None else f"{role} still holds {bh[role]} blocks"

    def first_lines(items: list, n: int = 3) -> str:
        shown = "; ".join((x.strip().splitlines() or [""])[-1] for x in items[:n])
        return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")

    done = ("skipped", "abandoned", None)
    reasons = {
        "no_errors": lambda: f"{len(summary['errors'])} error(s): {first_lines(summary['errors'])}",
        "p_blocks_held_zero": lambda: blocks("P"),
        "d_blocks_held_zero": lambda: blocks("D"),
        "no_corrupt_bytes": lambda: f"{t1['corrupt']} turn-1 and {t2['corrupt']} turn-2 requests read corrupt bytes",
        "all_requests_resolved": lambda: f"{t1['pending']} turn-1 and {t2['pending']} turn-2 requests never resolved",
        "late_turn2_declined": lambda: "late turn 2s not declined: " + outcomes(
            [r for r in detail if r.get("late") and r.get("turn2") not in done and r.get("turn2") != "recomputed"]),
        "on_time_turn2_read": lambda: "on-time turn 2s not read: " + outcomes(
            [r for r in detail if r.get("hold") and not r.get("late") and r.get("turn2") not in done
             and r.get("turn2") != "ok"]),
        "all_turn1_ok": lambda: f"{t1['ok']} of {summary['requests']['total']} ok: " + ", ".join(
            f"{n} {what}" for what, n in t1.items() if what != "ok" and n),
        "no_lease_expired_while_heartbeats_flowed": lambda: "expired while heartbeats flowed: " + ", ".join(
            (summary.get("expired_before_fault") or [])[:5]),
        "p_reclaimed_within_bound": lambda: _reclaim_reason(fault),
    }
    out = {}
    for name, ok in checks.items():
        if ok is False:
            out[name] = reasons[name]() if name in reasons else "see summary.json"
    return out


def _reclaim_reason(fault: dict) -> str:
    parts = []
    if fault.get("leases_still_live"):
        parts.append(f"{fault['leases_still_live']} leases never freed")
    if fault.get("late_leases"):
        parts.append(f"{len(fault['late_leases'])} freed past their due time + {fault.get('slack_s')} s slack")
    if "reclaim_after_last_heartbeat_s" in fault:
        parts.append(f"last freed {fault['reclaim_after_last_heartbeat_s']} s after the last heartbeat "
                     f"(bound {fault.get('bound_s')} s + {fault.get('slack_s')} s slack)")
    return "; ".join(parts) or "no lease freed after the fault"


def _eviction_of_killed(orch: RunRecord, P: Summary) -> dict:
    """When P's machines evicted the killed decode engine (every rank of it
    P knew), and why; it must be before the run's end (not the shutdown's
    disconnect), at most engine_ttl (+ slack) after the kill.  P that never
    connected to it (no turn 2 read it) has nothing to evict: None."""
    engine, ttl = orch.fault.get("engine"), orch.o.plane_config().engine_ttl
    mine = [e for e in P.lifecycle.get("evictions", ()) if base_engine_id(str(e["engine"])) == engine]
    during = [e for e in mine if e["cause"] != "shutdown"]
    bound = ttl + 2 * SLACK_S + 1.0
    after = [round(e["at"] - orch.fault_at, 3) for e in during] if orch.fault_at is not None else []
    return {"engine": engine, "engine_ttl_s": ttl, "bound_s": bound, "after_kill_s": after,
            "causes": sorted({e["cause"] for e in during}), "at_shutdown": len(mine) - len(during),
            "within_bound": None if not mine else (len(mine) == len(during) and max(after, default=0.0) <= bound)}


def _reclaim(orch: RunRecord, P: Summary) -> dict:
    """P's reclaim after the fault, against the lease promise: a lease is
    freed by max(grant + lease, last heartbeat + extension)."""
    o = orch.o
    recs = [r for r in P.lease_records if r.granted is not None]
    last_hb = P.last_hb_at
    after = [r for r in recs if r.freed is not None and r.freed >= orch.fault_at]
    live = [r for r in recs if r.freed is None]
    out: dict[str, Any] = {"lease_extension_s": o.extension, "leases_reclaimed_after_fault": len(after),
                           "leases_expired_after_fault": sum(r.reason == "expired" for r in after),
                           "leases_still_live": len(live)}
    if last_hb is not None:
        out["p_last_heartbeat_s"] = round(last_hb - orch.t0, 3)
    if not after:
        out["within_bound"] = not live
        return out
    last_free = max(r.freed for r in after)
    out["p_all_reclaimed_s"] = round(last_free - orch.t0, 3)
    # P frees a lease at its first loop tick after the expiry: the slack
    # is SLACK_S plus the longest gap of P's loop in the reclaim window
    # (a loaded machine, not the protocol, makes that late).
    # Rounded once, so that the reported slack is exactly SLACK_S + the reported stall.
    stall = round(_loop_stall_between(P.loop, orch.fault_at, last_free), 3)
    slack = SLACK_S + stall
    out["p_loop_stall_s"] = round(stall, 3)
    out["slack_s"] = round(slack, 3)
    late = []
    for r in after:
        due = max(r.granted + o.lease, (r.hb or -math.inf) + o.extension)
        if r.freed > due + slack:
            late.append(r.id)
    out["late_leases"] = late
    if last_hb is not None:
        reclaim = last_free - last_hb
        # Leases granted shortly before the fault may still be inside their initial term.
        bound = max(o.extension, max(r.granted + o.lease for r in after) - last_hb)
        out["reclaim_after_last_heartbeat_s"] = round(reclaim, 3)
        out["bound_s"] = round(bound, 3)
        out["within_one_extension"] = reclaim <= o.extension + slack
        out["within_bound"] = not late and not live and reclaim <= bound + slack
    else:
        out["within_bound"] = not late and not live
    return out


def _merged(counts: Any) -> dict:
    """Counts of several engines, added up."""
    total: dict = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


def _decode_engines(decoders: dict[str, Summary | None], killed: list[str]) -> list[dict]:
    """Each decode engine: its id, whether it was killed, what it did and still holds."""
    out = []
    for role, s in decoders.items():
        out.append({"role": role, "engine_id": s.engine_id if s else None, "killed": role in killed,
                    "held_blocks": s.held_blocks if s else None, "outcomes": s.outcomes if s else None,
                    "bytes_moved": s.bytes_moved if s else None})
    return out


def _partition_reclaim(orch: RunRecord, P: Summary, w: Partition) -> dict:
    """P's reclaim after one partition: every lease granted before the link
    went down and freed as expired (its completion or heartbeats lost on the
    link) must be freed within the lease term of the cut (a lease granted
    just before it runs its whole initial term), plus slack; the same for a
    lease granted while the link was down, from its grant."""
    o = orch.o
    end = w.end if w.end is not None else math.inf
    # A lease a heartbeat reached after the heal was not stranded by the cut.
    stranded = [r for r in P.lease_records if r.reason == "expired" and r.freed is not None and r.granted < end
                and r.freed >= w.start and (r.hb is None or r.hb < end)]
    out: dict[str, Any] = {"at_s": round(w.start - orch.t0, 3),
                           "healed_at_s": None if w.end is None else round(w.end - orch.t0, 3),
                           "lease_s": o.lease, "leases_expired": len(stranded)}
    if not stranded:
        out.update(reclaim_s=None, slack_s=SLACK_S, within_bound=True)
        return out
    reclaim = [r.freed - max(w.start, r.granted) for r in stranded]
    last = max(r.freed for r in stranded)
    slack = SLACK_S + round(_loop_stall_between(P.loop, w.start, last), 3)
    out.update(reclaim_s=round(max(reclaim), 3), reclaim_min_s=round(min(reclaim), 3),
               p_all_reclaimed_s=round(last - orch.t0, 3), slack_s=round(slack, 3),
               within_bound=max(reclaim) <= o.lease + slack)
    return out


def _hosts_brief(orch: RunRecord) -> dict:
    """Where the engines ran: this host's network, or the namespaces of --hosts netns."""
    pair = orch.hosts
    if pair is None:
        where = orch.o.placement()
        return {"kind": "local", "ucx_net_devices": where.ucx_net_devices,
                "side_channel_host": where.side_channel_host, "advertise_host": where.advertise_host}
    return {"kind": "netns", **{role: attrs.asdict(h) for role, h in pair.hosts.items()},
            "rate_limit_bits": pair.rate_bits}


def _loop_stall_between(loop: dict | None, start: float, end: float) -> float:
    """The longest gap of a side's loop that overlaps [start, end] (its
    monotonic clock, the one every process here shares)."""
    if not loop:
        return 0.0
    if loop["gaps_over_report"] > len(loop["long_gaps"]):
        return loop["max_gap_s"]  # the list was capped: assume the worst
    worst = loop["report_over_s"]  # gaps shorter than this are not listed
    for gap_end, gap in loop["long_gaps"]:
        if gap_end >= start and gap_end - gap <= end:
            worst = max(worst, gap)
    return worst


def _loop_brief(side: Summary | None) -> dict | None:
    if side is None:
        return None
    lp = side.loop
    calls = side.nixl_calls.get("max_s") or {}
    slowest = max(calls.items(), key=lambda kv: kv[1], default=None)
    return {"max_gap_s": lp["max_gap_s"], f"gaps_over_{lp['report_over_s']:g}s": lp["gaps_over_report"],
            "stalls": len(lp["stalls"]), "stall_limit_s": lp["stall_limit_s"],
            "slowest_nixl_call": None if slowest is None else {"call": slowest[0], "s": slowest[1]}}


def _slim(s: Summary | None) -> dict | None:
    """A side's report for summary.json, without the per-lease records."""
    if s is None:
        return None
    return attrs.asdict(s, filter=lambda a, _v: a.name not in ("lease_records", "transfers", "bare_reads"))


def summary_table(summary: dict):
    """The summary as a rich Table, for the console."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="kvplane run", show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    r1, r2 = summary["requests"]["turn1"], summary["requests"]["turn2"]
    t.add_row("requests (turn 1): ok / recomputed / failed",
              f"{r1['ok']} / {r1['recomputed']} / {r1['failed'] + r1['corrupt'] + r1['pending']}"
              + (f"  (+{r1['skipped']} not sent)" if r1["skipped"] else "")
              + (f"  (+{r1['abandoned']} abandoned)" if r1["abandoned"] else ""))
    t.add_row("turn 2 (P reads D's held blocks): ok / recomputed / failed",
              f"{r2['ok']} / {r2['recomputed']} / {r2['failed'] + r2['corrupt'] + r2['pending']}"
              + (f"  (+{r2['skipped']} skipped)" if r2["skipped"] else "")
              + (f"  (+{r2['abandoned']} abandoned)" if r2["abandoned"] else ""))
    t.add_row("late turn 2 declined by the expiry gate", f"{summary['requests']['late_turn2']}")
    for turn, reasons in (summary.get("recompute_reasons") or {}).items():
        if reasons:
            t.add_row(f"{turn.replace('turn', 'turn ')} recomputed because",
                      "; ".join(f"{why}: {n}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])))
    mib = summary["bytes_moved"] / 2**20
    lost = _lost_sides(summary)
    t.add_row("bytes moved (verified)", f"{mib:.1f} MiB ({summary['bytes_verified'] / 2**20:.1f} MiB)"
              + (f": {' and '.join(sorted({'P', 'D'} - set(lost)))}'s share; "
                 f"{' and '.join(lost)}'s {_or_na(summary, lost[0], None)}" if lost else ""))
    g = summary["gbps_in_flight"]
    t.add_row("GB/s while transfers in flight / over the run",
              f"{g if g is not None else '-'} / {summary['gbps_wall']}")
    dp = summary.get("data_path") or {}
    for what, stats in (("READ", dp.get("reads")), ("WRITE", dp.get("writes"))):
        if stats:
            t.add_row(f"{what}s: post -> done p50 / p99, GB/s in flight",
                      f"{stats['p50_ms']:.2f} / {stats['p99_ms']:.2f} ms, {stats['gbps']:.2f} GB/s "
                      f"({stats['transfers']} {what}s)")
    bare = dp.get("bare_nixl_read")
    if bare:
        t.add_row("bare NIXL READ, same sizes: p50 / p99, GB/s",
                  f"{bare['p50_ms']:.2f} / {bare['p99_ms']:.2f} ms, {bare['gbps']:.2f} GB/s")
    if dp.get("read_gbps_vs_bare") is not None:
        t.add_row("job READ GB/s / bare NIXL READ GB/s", f"{dp['read_gbps_vs_bare']:.0%}")
    elif dp.get("bare_read_error"):
        t.add_row("bare NIXL READ", f"failed: {dp['bare_read_error']}")
    # Lease counts from the machines' own transitions (LifecycleCounts): the
    # same count, made the same way, as `kvplane replay` of each side's logs.
    life = summary.get("lifecycle") or {}
    ranks_note = {role: " (all ranks)" if (summary.get("tp") or {}).get(role, 1) > 1 else "" for role in ("P", "D")}
    for role, label in (("P", "P leases"), ("D", "D holds")):
        le = (life.get(role) or {}).get("leases")
        t.add_row(f"{label} granted / extended / expired / released{ranks_note[role]}",
                  _or_na(summary, role, "-") if le is None else
                  f"{le['granted']} / {le['extended']} / {le['expired']} / {le['released']}")
    t.add_row("heartbeats sent / received", f"{_total(summary, 'heartbeats_sent')} / "
                                             f"{_total(summary, 'heartbeats_received')}")
    evictions = summary.get("evictions")
    t.add_row("engines evicted", _total(summary, "engines_evicted") if not evictions else
              eviction_words(int(summary.get("engines_evicted") or 0), [e for es in evictions.values() for e in es]))
    engines = summary.get("decode_engines") or []
    if len(engines) > 1:
        t.add_row("decode engines: requests ok / blocks held", ", ".join(
            f"{e['engine_id'] or e['role']} killed" if e["killed"] else
            f"{e['engine_id']} {(e['outcomes'] or {}).get('ok', 0)} / {e['held_blocks']}" for e in engines))
    prefills = summary.get("prefill_engines") or []
    if len(prefills) > 1:
        t.add_row("prefill engines: requests / blocks held / leases granted, consumed", ", ".join(
            f"{e['engine_id'] or e['role']} {e['requests']} / {_or_dash(e['held_blocks'])} / "
            f"{_or_dash(e['leases_granted'])}, {_or_dash(e['leases_consumed'])}" for e in prefills))
    bh = summary["blocks_held"]
    # (P: summed over the prefill engines; each one's is on the prefill engines' row.)
    t.add_row("blocks still held P / D", " / ".join(_or_na(summary, role, bh[role]) for role in ("P", "D")))
    ranks = summary.get("ranks") or {}
    if (summary.get("tp") or {}).get("P", 1) > 1 or (summary.get("tp") or {}).get("D", 1) > 1:
        for role in ("P", "D"):
            rs = ranks.get(role)
            if rs:
                t.add_row(f"{role} ranks: lease blocks held",
                          " / ".join(str(r["lease_blocks_held"]) for r in rs))
        if ranks.get("P"):
            t.add_row("P ranks: lease heartbeats received", " / ".join(str(r["lease_heartbeats"]) for r in ranks["P"]))
        for role in ("P", "D"):
            rs = ranks.get(role)
            if rs:
                t.add_row(f"{role} ranks: leases ended (consumed, expired, aborted)",
                          " / ".join(f"{r['leases_ended'].get('consumed', 0)}, {r['leases_ended'].get('expired', 0)}, "
                                     f"{r['leases_ended'].get('aborted', 0)}" for r in rs))
        lost = {role: v for role, v in (summary.get("lost_ranks") or {}).items() if v}
        if lost:
            t.add_row("ranks lost", "; ".join(f"{role}: {v}" for role, v in lost.items()))
    f = summary["fault"]
    if f and f.get("p_evicted"):
        ev = f["p_evicted"]
        t.add_row(f"P evicted the killed {ev['engine']} after (engine_ttl {ev['engine_ttl_s']:g} s)",
                  "never connected to it" if ev["within_bound"] is None else
                  f"{', '.join(f'{s:g}' for s in ev['after_kill_s']) or '-'} s ({', '.join(ev['causes']) or '-'}"
                  f"{'; still connected at the end' if ev['at_shutdown'] else ''})")
    if f:
        if "reclaim_after_last_heartbeat_s" in f:
            t.add_row(f"decode {f['kind']} at {f['at_s']} s: P reclaimed after last heartbeat",
                      f"{f['reclaim_after_last_heartbeat_s']} s (extension {f['lease_extension_s']:g} s, "
                      f"bound {f['bound_s']} s)")
        t.add_row("leases reclaimed after the fault (expired)",
                  f"{f['leases_reclaimed_after_fault']} ({f['leases_expired_after_fault']})")
    cpu, in_gc = summary.get("plane_cpu_us_per_request") or {}, summary.get("plane_gc_us_per_request") or {}
    t.add_row("plane CPU per request P / D (recording on; of which GC)",
              " / ".join("-" if cpu.get(r) is None else f"{cpu[r]:.0f} µs ({in_gc.get(r) or 0:.0f})"
                         for r in ("P", "D")))
    hosts = summary.get("hosts") or {}
    if hosts.get("kind") == "netns":
        roles = [r for r in hosts if isinstance(hosts[r], dict) and "veth" in hosts[r]]
        t.add_row(f"hosts: network namespaces, {' / '.join(roles)}", " / ".join(
            f"{hosts[r]['address']} ({hosts[r]['veth']})" for r in roles)
            + (f", tbf {hosts['rate_limit_bits'] / 1e6:g} Mbit/s" if hosts.get("rate_limit_bits") else ""))
    for part in summary.get("partitions") or []:
        t.add_row(f"link down at {part['at_s']} s, up at {part['healed_at_s']} s: P reclaimed (leases expired)",
                  ("nothing stranded" if part["reclaim_s"] is None else
                   f"{part['reclaim_s']} s after the cut, bound lease {part['lease_s']:g} s + {part['slack_s']} s "
                   f"slack") + f" ({part['leases_expired']})")
    loop = summary.get("loop") or {}
    t.add_row("longest loop stall P / D (gaps > 0.1 s)",
              " / ".join("-" if loop.get(r) is None else f"{loop[r]['max_gap_s']:.3f} s ({loop[r]['gaps_over_0.1s']})"
                         for r in ("P", "D")))
    t.add_row("slowest NIXL call P / D",
              " / ".join("-" if not (loop.get(r) or {}).get("slowest_nixl_call") else
                         f"{loop[r]['slowest_nixl_call']['call']} {loop[r]['slowest_nixl_call']['s'] * 1e3:.1f} ms"
                         for r in ("P", "D")))
    ab = summary.get("abandoned")
    if ab:
        t.add_row(f"abandoned ({ab['reason']}): not sent / in flight (turn 1, turn 2)",
                  f"{ab['requests_not_sent']} / {ab['in_flight_turn1']}, {ab['in_flight_turn2']}")
        for role in ("P", "D"):
            if ab.get(role):
                t.add_row(f"  {role} gave up", ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in ab[role].items()))
    if summary.get("startup_s") is not None:
        t.add_row("wall time: run / with start-up", f"{summary['wall_s']} s / {summary['wall_with_startup_s']} s "
                                                    f"(start-up {summary['startup_s']} s)")
    else:
        t.add_row("wall time", f"{summary['wall_s']} s")
    reasons = summary.get("check_reasons") or {}
    for name, v in summary["checks"].items():
        if v is not None:
            why = reasons.get(name)
            t.add_row(f"check: {name}", "[green]pass[/green]" if v else
                      "[red]FAIL[/red]" + (f": {escape(why)}" if why else ""))
    return t


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _lost_sides(summary: dict) -> list[str]:
    """The sides whose report never came (a killed process): their counts are unknown, not 0."""
    return [role for role in ("P", "D") if (summary.get("sides") or {}).get(role) is None]


def _or_na(summary: dict, role: str, value: Any) -> str:
    if role in _lost_sides(summary):
        why = "killed" if role == "D" and (summary.get("fault") or {}).get("kind") == "kill" else "no report"
        return f"n/a ({why})"
    return str(value)


def _total(summary: dict, field: str) -> str:
    """A count summed over both sides: n/a when a side's share is unknown (its process died)."""
    lost = _lost_sides(summary)
    if not lost:
        return str(summary[field])
    known = {role: side[field] for role, side in summary["sides"].items() if side is not None}
    shown = ", ".join(f"{role} {n}" for role, n in known.items())
    return f"n/a ({shown}; {' and '.join(lost)} lost)" if shown else "n/a"
