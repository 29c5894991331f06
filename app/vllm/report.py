"""Checks and tables of the vLLM job (``kvplane run --engine vllm``)."""
from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

RECLAIM_SLACK_S = 10.0


def checks(s: dict) -> dict[str, bool | None]:
    """Each check: True / False, or None where it does not apply."""
    o = s["options"]
    killed = o.get("kill_decode_at") is not None
    kvp = s["connector"] == "kvplane"
    usage = s.get("usage_end", {})
    c: dict[str, bool | None] = {}
    c["every_request_completed"] = None if killed else s["completed"] == s["requests"]
    kv = s["kv_check"]
    # After a kill D cannot recompute the prompts: nothing to compare with.
    c["kv_is_the_right_kv"] = None if killed else kv["checked"] > 0 and kv["ok"] == kv["checked"] == s["completed"]
    c["bytes_moved"] = (s.get("bytes_moved") or 0) > 0
    held = s.get("connector_blocks_held", {})
    # Every prefill engine (P, P1, ...): its cache empty; the connectors' blocks held added up.
    p_usage = [u for name, u in usage.items() if name.startswith("P")]
    c["p_holds_no_block"] = bool(p_usage) and all(u == 0.0 for u in p_usage) and (not kvp or held.get("prefill") == 0)
    inflight = s.get("connector_recvs_in_flight", {})
    c["d_holds_no_block"] = None if killed else (
        usage.get("D") == 0.0 and (not kvp or (held.get("decode") == 0 and inflight.get("decode") == 0)))
    t2 = s.get("turn2")
    if t2 is not None:
        reads = t2["p_reads"]
        # P's read of D's hold: right byte for byte (a declined one read nothing).
        c["turn2_p_read_right"] = reads["checked"] == t2["completed"] > 0 and (
            reads["ok"] == reads["checked"] if kvp else None)
        if o.get("late_turn2") and kvp:
            # Every late turn 2 read nothing of D's expired hold: declined by P's gate
            # (at least one here), or nothing to read (P had the whole prefix cached).
            c["late_turn2_not_read"] = t2["late"] > 0 and reads["late_read"] == 0 and \
                0 < reads["late_declined"] <= s.get("p_declined_reads", 0)
    push = s.get("push")
    if push is not None:
        # Push mode: P WRITEs every block that moves, D READs none.
        c["push_moved_the_kv"] = push["p_writes"] > 0 and push["d_reads"] == 0
    if o.get("late_forward") and kvp:
        c["late_reads_declined"] = s.get("declined_reads", 0) >= s.get("late", 0) > 0
    if kvp:
        c["no_protocol_error"] = s.get("protocol_errors", 0) == 0
        c["every_rank_reported"] = not s.get("status_missing")
        rp = s.get("replay", {})
        c["event_logs_replay"] = all(r.get("ok") for r in rp.values()) if not killed else rp.get("prefill", {}).get("ok")
    if o.get("partition_at") is not None and kvp:
        # The cut came and healed, and every lease it stranded was freed within its term from the cut (+ slack).
        part = s.get("partition") or {}
        c["p_reclaimed_within_lease_after_partition"] = bool(part.get("within_bound")) and \
            part.get("healed_at_s") is not None
    if killed:
        c["p_reclaims_within_lease"] = s.get("reclaim_after_kill_s") is not None and \
            s["reclaim_after_kill_s"] <= o["lease"] + RECLAIM_SLACK_S
    return c


def held_line(s: dict) -> str:
    kvp = s["connector"] == "kvplane"
    usage = s.get("usage_end", {})
    if kvp:
        held = s.get("connector_blocks_held", {})
        p, d = held.get("prefill"), held.get("decode")
    else:
        p = _blocks(max((u for name, u in usage.items() if name.startswith("P")), default=None))
        d = _blocks(usage.get("D"))
    return f"blocks still held P / D {_n(p)} / {_n(d)}"


def _blocks(usage: float | None) -> Any:
    if usage is None or (isinstance(usage, float) and math.isnan(usage)):
        return None
    return 0 if usage == 0 else f"{usage:.1%} of the cache"


def _n(v: Any) -> str:
    return "?" if v is None else str(v)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f} ms"


def print_report(s: dict, console: Console | None = None) -> bool:
    console = console or Console()
    t = Table(title=f"kvplane run --engine vllm --connector {s['connector']}", show_header=True)
    t.add_column("item")
    t.add_column("value", justify="right")
    rows = [
        ("engine start-up", f"{s.get('startup_s', 0):.0f} s"),
        ("requests completed / sent", f"{s['completed']} / {s['requests']}"),
        ("of them late-forwarded", str(s.get("late", 0))),
        ("exact repeats of an earlier prompt", str(s.get("repeats", 0))),
        (f"TTFT p50 / p99 (client -> D's first token; {s.get('ttft_requests', 0)} steady requests)",
         f"{_ms(s.get('ttft_p50_s'))} / {_ms(s.get('ttft_p99_s'))}"),
        ("opening burst: longest wait for D's first token (D's queue)", _ms(s.get("burst_d_wait_max_s"))),
        ("D leg to first token p50 / p99", f"{_ms(s.get('d_ttft_p50_s'))} / {_ms(s.get('d_ttft_p99_s'))}"),
        ("requests/s", f"{s.get('requests_per_s', 0):.2f}"),
        ("bytes moved", f"{s.get('bytes_moved') or 0:,}"),
        ("KV check: requests whose read blocks are P's and D's recompute, byte for byte" if
         (s.get("options") or {}).get("model") not in ("mla", "mtp") else
         "KV check: requests whose read blocks, and what D kept of them, are P's byte for byte",
         f"{s['kv_check']['ok']} / {s['kv_check']['checked']} ({s['kv_check']['tokens_compared']:,} tokens)"),
        ("  of them declined (nothing read) / no whole block read",
         f"{s['kv_check']['declined']} / {s['kv_check']['no_whole_block_read']}"),
        ("KV wrong among late-forwarded", str(s["kv_check"].get("late_bad", 0))),
    ]
    by_engine = s["kv_check"].get("by_engine")
    if by_engine:
        rows.append(("KV check per engine core (DP): right / checked", ", ".join(
            f"{e} {r['ok']} / {r['checked']}" for e, r in by_engine.items())))
    if s["connector"] == "kvplane":
        rows += [
            ("reads declined by the expiry gate (recomputed)", str(s.get("declined_reads", 0))),
            ("recvs failed", str(s.get("failed_recvs", 0))),
            ("P leases consumed / expired / extended",
             f"{s.get('leases_consumed', 0)} / {s.get('leases_expired', 0)} / {s.get('lease_extensions', 0)}"),
            ("protocol errors", str(s.get("protocol_errors", 0))),
            ("longest a rank's plane went unstepped P / D (ms)",
             " / ".join(str(s.get("longest_rank_stall_ms", {}).get(r, "-")) for r in ("prefill", "decode"))),
        ]
        if s.get("push") is not None:
            rows.append(("push: P's WRITEs / D's READs", f"{s['push']['p_writes']} / {s['push']['d_reads']}"))
        for role, cores in (s.get("dp_ranks") or {}).items():
            # Each DP engine core (engine id ..._dp{k}) is a connector of its own.
            rows.append((f"{role} DP engine cores: leases consumed, expired / reads, declined, failed", ", ".join(
                f"dp{c['dp_rank']} {c['kvplane_leases_consumed']}, {c['num_kv_expired_reqs']} / "
                f"{c['num_successful_transfers']}, {c['kvplane_declined_reads']}, {c['kvplane_failed_recvs']}"
                for c in cores)))
    engines = s.get("prefill_engines") or []
    if len(engines) > 1:
        rows.append(("prefill engines: requests / leases consumed, expired / blocks held", ", ".join(
            f"{e['engine_id']} {e['requests']} / {_n(e.get('leases_consumed'))}, {_n(e.get('leases_expired'))} / "
            f"{_n(e.get('blocks_held'))}" for e in engines)))
    part = s.get("partition")
    if part is not None and "lease_s" in part:
        rows.append((f"link down at {part.get('at_s')} s, up at {part.get('healed_at_s')} s: P reclaimed "
                     "(leases expired)", ("nothing stranded" if part["reclaim_s"] is None else
                                          f"{part['reclaim_s']} s after the cut, bound lease {part['lease_s']:g} s + "
                                          f"{part['slack_s']} s slack") + f" ({part['leases_expired']})"))
        if "requests_sent_while_cut" in part:
            rows.append(("requests sent to P while cut / answered after the heal",
                         f"{part['requests_sent_while_cut']} / {part['answered_after_heal']}"))
    if s.get("reclaim_after_kill_s") is not None:
        rows.append(("P reclaimed its blocks after D's kill", f"{s['reclaim_after_kill_s']:.1f} s"))
    rows.append(("end", held_line(s)))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    ok = True
    for name, passed in checks(s).items():
        if passed is None:
            continue
        ok &= bool(passed)
        console.print(f"  {'ok  ' if passed else 'FAIL'} {name}", highlight=False)
    for idx, err in s.get("failed", [])[:5]:
        console.print(f"  request {idx}: {err}", markup=False, highlight=False)
    t2 = s.get("turn2")
    if t2 is not None:
        r = t2["p_reads"]
        console.print(f"turn 2: {t2['completed']} / {t2['sent']} completed ({t2['late']} late); P's reads of D's "
                      f"hold: {r['ok']} / {r['checked']} right ({r['tokens_compared']:,} tokens), {r['declined']} "
                      f"declined, late ones read wrong {r['late_read_wrong']}", highlight=False)
        for tag, why in r["bad"][:5]:
            console.print(f"  {tag}: {why}", highlight=False)
    for tag, why in s["kv_check"]["bad"][:5]:
        console.print(f"  KV of {tag}: {why}", markup=False, highlight=False)
    console.print(held_line(s), highlight=False)
    return ok


def side_by_side(runs: dict[str, dict], console: Console | None = None) -> Table:
    """One table, both connectors, measured in one invocation."""
    console = console or Console()
    t = Table(title="kvplane vs vLLM NixlConnector (same workload, same machine, one run)")
    t.add_column("")
    for name in runs:
        t.add_column(name, justify="right")
    keys = [("TTFT p50", lambda s: _ms(s.get("ttft_p50_s"))), ("TTFT p99", lambda s: _ms(s.get("ttft_p99_s"))),
            ("requests/s", lambda s: f"{s.get('requests_per_s', 0):.2f}"),
            ("bytes moved", lambda s: f"{s.get('bytes_moved') or 0:,}"),
            ("requests completed", lambda s: f"{s['completed']} / {s['requests']}"),
            ("KV right", lambda s: f"{s['kv_check']['ok']} / {s['kv_check']['checked']}"),
            ("late-forwarded: KV wrong, served silently", lambda s: str(s["kv_check"].get("late_bad", 0))),
            ("late-forwarded: declined and recomputed", lambda s: str(s.get("declined_reads", 0))),
            ("end", held_line)]
    for label, fn in keys:
        t.add_row(label, *[fn(s) for s in runs.values()])
    if "kvplane" in runs and "nixl" in runs:
        a, b = runs["kvplane"].get("ttft_p50_s"), runs["nixl"].get("ttft_p50_s")
        if a and b:
            t.add_row("kvplane TTFT p50 / NixlConnector's", f"{a / b:.3f}x", "")
    console.print(t)
    return t
