"""End to end: `kvplane run` with a real prefill and decode process over NIXL.

Each test reads the summary of one short run (see e2e_support.SCENARIOS)
and asserts the outcomes the scenario must produce, and that neither side
holds a block at the end.
"""
from __future__ import annotations

import pytest

from kvplane.app.job.options import RunError, RunOptions
from e2e_support import SCENARIOS, run_scenario

LEASE = 6.0
EXTENSION = LEASE * 2 // 3


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


def _common(s: dict, *, d_alive: bool = True, errors: int = 0) -> None:
    assert len(s["errors"]) == errors, s["errors"]
    assert s["blocks_held"]["P"] == 0
    if d_alive:
        assert s["blocks_held"]["D"] == 0
        assert s["sides"]["D"]["plane_held"] == []
    assert s["sides"]["P"]["plane_held"] == []
    t1, t2 = s["requests"]["turn1"], s["requests"]["turn2"]
    assert t1["corrupt"] == 0 and t2["corrupt"] == 0
    assert t1["pending"] == 0 and t2["pending"] == 0
    # Every request resolved into exactly one outcome.
    assert sum(t1.values()) == s["requests"]["total"]
    # The late turn 2s (inside the safety margin) were declined, never read.
    late = [r for r in s["requests_detail"] if r["late"] and r["turn2"] not in (None, "skipped", "abandoned")]
    assert all(r["turn2"] == "recomputed" for r in late)
    # Every recomputed read says why (the breakdown adds up).
    for turn, side in (("turn1", "D"), ("turn2", "P")):
        reasons = s["recompute_reasons"][turn]
        if s["sides"][side] is not None:
            assert sum((reasons or {}).values()) == s["requests"][turn]["recomputed"], (turn, reasons)
    # Both loops' stalls are in the summary (a timer fires that late at most).
    for side in ("P", "D"):
        if s["sides"][side] is not None:
            assert s["loop"][side]["max_gap_s"] > 0
    for proto in ("unknown_kind", "protocol_violation"):
        for side in ("P", "D"):
            if s["sides"][side]:
                assert not [k for k in s["sides"][side]["anomalies"] if k.startswith(proto)]


def test_normal_path_through_the_cli(e2e_dir):
    s = run_scenario("normal", e2e_dir)
    assert s["_returncode"] == 0, s["_stdout"]
    assert "kvplane replay" in s["_stdout"] and "blocks still held" in s["_stdout"]
    _common(s)
    assert s["ok"] and all(v is not False for v in s["checks"].values())
    t1, t2 = s["requests"]["turn1"], s["requests"]["turn2"]
    assert t1["ok"] == SCENARIOS["normal"]["requests"]
    assert s["requests"]["late_turn2"] >= 1
    assert t2["ok"] == s["requests"]["multiturn"] - s["requests"]["late_turn2"]
    assert s["bytes_verified"] > 0 and s["bytes_moved"] >= s["bytes_verified"]
    # D queued every request 1.5 s: heartbeats flowed and no lease expired.
    assert s["heartbeats_sent"] >= 1 and s["heartbeats_received"] >= 1
    assert s["leases"]["granted"] == 16 and s["leases"]["expired"] == 0 and s["leases"]["consumed"] == 16
    assert s["holds"]["granted"] == s["requests"]["multiturn"]
    assert s["holds"].get("consumed", 0) == t2["ok"]
    assert s["recompute_reasons"]["turn2"] == {"declined by the expiry gate": s["requests"]["late_turn2"]}
    assert s["abandoned"] is None
    # Every READ was timed from post to done, and D rank 0 measured a bare NIXL READ of the same sizes.
    dp = s["data_path"]
    reads_done = sum(side["counters"].get("reads_done", 0) for side in s["sides"].values())
    assert dp["reads"]["transfers"] == reads_done > 0 and dp["reads"]["bytes"] == s["bytes_moved"]
    assert 0 < dp["reads"]["p50_ms"] <= dp["reads"]["p99_ms"] and dp["writes"] is None
    assert dp["bare_nixl_read"]["transfers"] > 0 and dp["bare_read_error"] is None
    assert dp["read_gbps_vs_bare"] == pytest.approx(dp["reads"]["gbps"] / dp["bare_nixl_read"]["gbps"], rel=0.01)
    assert "bare NIXL READ, same sizes" in s["_stdout"]
    assert all(r["cpu_s"] > 0 for side in s["ranks"].values() for r in side)


def test_decode_killed_p_reclaims_within_one_extension(e2e_dir):
    s = run_scenario("kill", e2e_dir)
    _common(s, d_alive=False)
    f = s["fault"]
    assert f["kind"] == "kill"
    # Everything was queued on D when it died: every lease expired, after the fault.
    assert f["leases_expired_after_fault"] == SCENARIOS["kill"]["requests"]
    assert s["leases"]["expired"] == f["leases_expired_after_fault"] and s["leases"]["consumed"] == 0
    assert f["leases_still_live"] == 0 and f["late_leases"] == []
    # Reclaimed one extension after the last heartbeat: not earlier, and later
    # only by the slack: 0.5 s plus the longest gap of P's loop meanwhile (a
    # timer fires at the first tick after it is due; a loaded machine makes
    # that late, not the protocol).
    assert f["slack_s"] == pytest.approx(0.5 + f["p_loop_stall_s"], abs=1e-3)
    assert EXTENSION - 0.05 <= f["reclaim_after_last_heartbeat_s"] <= EXTENSION + f["slack_s"]
    assert f["within_one_extension"] and s["checks"]["p_reclaimed_within_bound"]
    assert s["checks"]["no_lease_expired_while_heartbeats_flowed"]
    assert s["requests"]["turn1"]["failed"] == SCENARIOS["kill"]["requests"]


def test_decode_hung_p_reclaims_then_decode_recomputes(e2e_dir):
    s = run_scenario("hang", e2e_dir)
    _common(s)
    f = s["fault"]
    assert f["kind"] == "hang" and f["p_reclaimed_before_resume"]
    assert EXTENSION - 0.05 <= f["reclaim_after_last_heartbeat_s"] <= EXTENSION + f["slack_s"]
    assert f["within_one_extension"] and f["late_leases"] == []
    # After SIGCONT D's READ gate saw the heartbeat chain broken by the stall
    # and recomputed instead of reading reclaimed blocks (no corrupt bytes).
    d = s["sides"]["D"]
    assert d["stalls"] and max(d["stalls"]) >= EXTENSION - 1
    assert s["loop"]["D"]["max_gap_s"] >= max(d["stalls"]) - 1e-3 and s["loop"]["D"]["stalls"] >= 1
    assert d["counters"].get("reads_posted", 0) == 0
    # Full prefix hits read nothing remote: they finish; every other request recomputes.
    outcomes = {r["lid"]: (r["kind"], r["turn1"]) for r in s["requests_detail"]}
    assert all((o == "ok") == k.startswith("full") for k, o in outcomes.values()), outcomes
    assert all(o in ("ok", "recomputed") for _, o in outcomes.values())
    assert s["ok"]


def test_notification_loss_completes_or_fails_cleanly(e2e_dir):
    s = run_scenario("drop", e2e_dir)
    _common(s)
    dropped = sum(s["sides"][r]["counters"].get("notifs_dropped_injected", 0) for r in ("P", "D"))
    assert dropped >= 1
    t1 = s["requests"]["turn1"]
    assert t1["failed"] == 0 and t1["ok"] + t1["recomputed"] == SCENARIOS["drop"]["requests"]
    # A lost completion leaves P's lease to expire instead of leaking it.
    le = s["leases"]
    assert le["granted"] == le["consumed"] + le["expired"] and le["live"] == 0
    assert s["ok"]


def test_push_mode_writes_end_to_end(e2e_dir):
    s = run_scenario("push", e2e_dir)
    _common(s)
    p, d = s["sides"]["P"]["counters"], s["sides"]["D"]["counters"]
    pushed = sum(1 for r in s["requests_detail"] if r["push"])
    assert pushed >= 1
    assert d.get("push_regs_sent", 0) == pushed
    assert p.get("writes_done", 0) == pushed and p.get("writes_posted", 0) == pushed
    assert s["data_path"]["writes"]["transfers"] == pushed
    # D read nothing on turn 1: P wrote every block (turn 2 reads are P's).
    assert d.get("reads_posted", 0) == 0
    assert s["requests"]["turn1"]["ok"] == SCENARIOS["push"]["requests"]
    assert s["leases"]["consumed"] == SCENARIOS["push"]["requests"] and s["leases"]["expired"] == 0
    assert s["ok"]


def test_turn2_gate_declines_expired_hold_under_clock_skew(e2e_dir):
    s = run_scenario("turn2_expired", e2e_dir)
    _common(s)
    skew = SCENARIOS["turn2_expired"]["clock_skew"]
    # The handshake's offset estimate absorbed D's skew.
    assert abs(s["p_estimated_offset_of_d"] - skew) < 0.05
    late = s["requests"]["late_turn2"]
    t2 = s["requests"]["turn2"]
    assert late >= 1
    assert t2["recomputed"] == late
    assert t2["ok"] == s["requests"]["multiturn"] - late
    # The declined turn 2s never read: D's holds for them expired on their TTL.
    assert s["holds"].get("expired", 0) == late and s["holds"].get("consumed", 0) == t2["ok"]
    assert s["ok"]


def test_turn2_is_served_under_sustained_load(e2e_dir):
    """P's pool is exhausted by leases waiting for D: turn-2 reads go first
    (their source expires on a fixed TTL), so nearly all on-time ones are
    read (before: 24 of 66); one that gets no blocks before its hold's
    validity is declined early, and the summary says why each recomputed."""
    s = run_scenario("sustained", e2e_dir)
    _common(s)
    on_time = [r for r in s["requests_detail"] if r["hold"] and not r["late"]]
    read = sum(r["turn2"] == "ok" for r in on_time)
    assert read >= 0.9 * len(on_time), (read, len(on_time), s["recompute_reasons"])
    reasons = s["recompute_reasons"]["turn2"]
    assert set(reasons) <= {"declined by the expiry gate", "declined: no free blocks before the hold's expiry"}
    # P really was short of blocks: prefills waited for a full pool.
    assert s["sides"]["P"]["waited_for_blocks"].get("prefill", 0) > 50
    assert all(v is not False for k, v in s["checks"].items() if k != "on_time_turn2_read"), s["checks"]


@pytest.mark.parametrize("name, p_tp, d_tp", [("tp4_2", 4, 2), ("tp1_2", 1, 2)])
def test_tensor_parallel_ranks_each_read_their_heads(e2e_dir, name, p_tp, d_tp):
    s = run_scenario(name, e2e_dir)
    _common(s)
    assert s["ok"] and all(v is not False for v in s["checks"].values()), s["checks"]
    n = SCENARIOS[name]["requests"]
    assert s["requests"]["turn1"]["ok"] == n
    assert s["tp"] == {"P": p_tp, "D": d_tp}
    p_ranks, d_ranks = s["ranks"]["P"], s["ranks"]["D"]
    assert [r["rank"] for r in p_ranks] == list(range(p_tp)) and [r["rank"] for r in d_ranks] == list(range(d_tp))
    for r in p_ranks + d_ranks:
        assert r["lease_blocks_held"] == 0 and r["plane_held"] == 0, r
    for r in p_ranks:
        # Every P rank's lease of every request was consumed by its readers and heartbeated while D queued.
        assert r["leases_ended"].get("consumed") == n, r
        assert r["lease_heartbeats"] > 0, r
    # Every notification came from a planned consumer rank: a lease (or hold) planned for fewer
    # reader ranks than read it would bind the first and refuse the others (and free too early).
    for side in ("P", "D"):
        assert not [k for k, v in s["sides"][side]["counters"].items() if k.startswith("refused_") and v], side
    # Every byte moved once: the whole blocks, split over the ranks.
    assert s["bytes_verified"] > 0
    assert sum(r["bytes_moved"] for r in p_ranks + d_ranks) == s["bytes_moved"]


def test_a_killed_decode_rank_fails_its_requests_and_every_p_rank_frees(e2e_dir):
    s = run_scenario("kill_rank", e2e_dir)
    _common(s)  # D, alive, holds nothing either
    assert s["ok"], s["checks"]
    assert s["fault"]["rank"] == 1 and s["lost_ranks"]["D"] == [1]
    t1 = s["requests"]["turn1"]
    # Every request was scheduled after the kill: each read failed, except full prefix hits (nothing to read).
    assert t1["recomputed"] + t1["ok"] == SCENARIOS["kill_rank"]["requests"] and t1["recomputed"] > 0
    assert all(r["detail"].startswith("full prefix hit") for r in s["requests_detail"] if r["turn1"] == "ok")
    assert s["recompute_reasons"]["turn1"] == {"rank 1 lost": t1["recomputed"]}
    p0, p1 = s["ranks"]["P"]
    assert p0["leases_ended"] == {"consumed": 12}  # D rank 0 read rank 0's shard
    assert p1["leases_ended"] == {"expired": 12}  # its reader died: each lease ran out
    assert s["fault"]["within_bound"]
    assert all(r["lease_blocks_held"] == 0 for r in s["ranks"]["P"])


@pytest.mark.parametrize("kw, message", [
    (dict(lease=5.0), "--lease must be >= 6"),
    (dict(prefill_tp=3, decode_tp=2, block_elems=6144), "must divide each other"),
    (dict(decode_tp=2, rank=2, kill_decode_at=1.0), "--rank must be a decode rank in 0..1"),
    (dict(decode_tp=2, rank=1), "--rank names the decode rank"),
    (dict(prefill_tp=2, push=True), "--push needs"),
    (dict(decode_tp=3, block_elems=1000), "must divide --block-elems"),
    (dict(drop_notifications=1.0), "--drop-notifications"),
    (dict(kill_decode_at=1.0, hang_decode_at=1.0), "exclusive"),
    (dict(hold_ttl=0.5), "--hold-ttl"),
])
def test_invalid_options_are_rejected_clearly(kw, message):
    with pytest.raises(RunError, match=message):
        RunOptions(**kw).validate()


def test_cli_rejects_short_lease(capsys):
    from kvplane.app.cli import main

    assert main(["run", "--lease", "4", "--quiet"]) == 2
    assert "--lease must be >= 6" in capsys.readouterr().err  # errors go to stderr


@pytest.mark.parametrize("flag, value", [
    ("--lease", "nan"), ("--hold-ttl", "nan"), ("--overload", "nan"), ("--clock-skew", "inf"),
    ("--clock-skew", "-inf"), ("--clock-skew", "1e300"), ("--kill-decode-at", "nan"), ("--hang-decode-at", "inf"),
    ("--timeout", "nan"), ("--timeout", "0"), ("--drop-notifications", "nan"), ("--startup-timeout", "nan"),
])
def test_cli_rejects_non_finite_options_before_starting_anything(flag, value, tmp_path, capsys):
    """NaN passes no comparison and inf never comes: each of these hung the
    job, grew D's memory or crashed a child.  One line, exit 2, no process."""
    import multiprocessing

    from kvplane.app.cli import main

    out = tmp_path / "run"
    assert main(["run", f"{flag}={value}", "--quiet", "--out", str(out)]) == 2
    printed = capsys.readouterr()
    lines = printed.err.strip().splitlines()
    assert printed.out == "" and len(lines) == 1 and lines[0].startswith(f"kvplane run: {flag} must be"), printed.err
    assert "Traceback" not in printed.out + printed.err
    assert multiprocessing.active_children() == [] and not out.exists()


def test_run_without_nixl_is_one_clear_line(tmp_path, capsys, monkeypatch):
    """NIXL is an extra: without it, `kvplane run` says how to install it and starts nothing."""
    import multiprocessing

    from kvplane.app.job import orchestrator
    from kvplane.app.cli import main

    monkeypatch.setattr(orchestrator, "nixl_installed", lambda: False)
    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # The command works from the checkout (kvplane is on no package index).
    assert len(lines) == 1 and lines[0].startswith("kvplane run: NIXL is not installed") and "pip install -e '.[run]'" in lines[0]
    assert multiprocessing.active_children() == [] and not out.exists()


def test_engine_startup_over_its_limit_is_a_clear_error(tmp_path, capsys):
    """A start-up that overruns --startup-timeout: one clear line, exit 1,
    no traceback, and every process it started is gone."""
    import multiprocessing

    from kvplane.app.cli import main

    assert main(["run", "--startup-timeout", "0.2", "--quiet", "--out", str(tmp_path)]) == 1
    printed = capsys.readouterr()
    assert "did not start within 0.2 s (--startup-timeout)" in printed.err
    assert "Traceback" not in printed.out + printed.err
    assert multiprocessing.active_children() == []


def test_timeout_abandons_in_flight_work_and_holds_nothing(e2e_dir):
    """--timeout mid-stream (requests still arriving, D queueing each for
    1 s): the job aborts what is in flight through the machines, frees its
    leases and holds once the other side stopped, reports what it gave up,
    and ends holding nothing on either side."""
    s = run_scenario("timeout", e2e_dir)
    _common(s, errors=1)
    assert s["errors"][0].startswith("timed out after 4 s")
    assert not s["ok"] and s["checks"]["no_errors"] is False
    assert all(v is not False for k, v in s["checks"].items() if k != "no_errors"), s["checks"]
    ab = s["abandoned"]
    assert ab["reason"] == "timed out"
    # Requests were still to be sent and others in flight at the timeout.
    assert ab["requests_not_sent"] > 0 and ab["in_flight_turn1"] > 0
    t1 = s["requests"]["turn1"]
    assert t1["abandoned"] == ab["requests_not_sent"] + ab["in_flight_turn1"]
    # Every lease nobody would read ended; none is left live. Two paths race, both right: D aborts
    # its queued decodes before allocation and tells P to free at once (the lease is consumed), or
    # P's abandonment releases the lease first (aborted, counted by P as released).
    le = s["leases"]
    assert le["live"] == 0 and le["granted"] == le["consumed"] + le["expired"] + le["aborted"]
    assert ab["P"].get("leases_released", 0) == le["aborted"]
    assert le["aborted"] > 0 or ab["D"]["queued_decodes"] > 0
    assert s["holds"].get("aborted", 0) == ab["D"].get("holds_released", 0)


def test_a_crashed_child_does_not_hang_the_parent(tmp_path):
    """SIGKILL the prefill process mid-run: the parent notices at once,
    reports it, and stops the decode process."""
    import os
    import signal
    import threading
    import time

    from kvplane.app.job.orchestrator import Orchestrator

    overload = 30.0
    orch = Orchestrator(RunOptions(out=str(tmp_path), quiet=True, requests=8, overload=overload, timeout=300.0,
                                   startup_timeout=600.0))

    def kill_p_when_running():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            c = orch.children.get("P")
            if c is not None and c.ready is not None and orch.t0:
                time.sleep(0.5)
                os.kill(c.proc.pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_p_when_running, daemon=True)
    killer.start()
    try:
        summary = orch.run()
        elapsed = orch.elapsed()
    finally:
        orch.stop_all()
    killer.join(timeout=5)
    assert any("P exited unexpectedly" in e and "-9" in e for e in summary["errors"])
    assert not summary["ok"] and summary["checks"]["no_errors"] is False
    # Well before D's queue would have let a request through, let alone the
    # timeout: the parent did not wait on the dead P.
    assert elapsed < overload / 2
    assert not orch.children["D"].proc.is_alive()
    # The survivor gave up its queued requests and holds nothing.
    assert summary["abandoned"]["reason"] == "a side failed"
    assert summary["blocks_held"]["D"] == 0 and summary["sides"]["D"]["plane_held"] == []
