"""End to end: `kvplane run` with a real prefill and decode process over NIXL.

Each test reads the summary of one short run (see e2e_support.SCENARIOS)
and asserts the outcomes the scenario must produce, and that neither side
holds a block at the end.
"""
from __future__ import annotations

import pytest

from connector.mainjob import RunError, RunOptions
from e2e_support import SCENARIOS, run_scenario

LEASE = 6.0
EXTENSION = LEASE * 2 // 3


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


def _common(s: dict, *, d_alive: bool = True) -> None:
    assert s["errors"] == []
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
    late = [r for r in s["requests_detail"] if r["late"] and r["turn2"] not in (None, "skipped")]
    assert all(r["turn2"] == "recomputed" for r in late)
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


def test_decode_killed_p_reclaims_within_one_extension(e2e_dir):
    s = run_scenario("kill", e2e_dir)
    _common(s, d_alive=False)
    f = s["fault"]
    assert f["kind"] == "kill"
    # Everything was queued on D when it died: every lease expired, after the fault.
    assert f["leases_expired_after_fault"] == SCENARIOS["kill"]["requests"]
    assert s["leases"]["expired"] == f["leases_expired_after_fault"] and s["leases"]["consumed"] == 0
    assert f["leases_still_live"] == 0 and f["late_leases"] == []
    # Reclaimed one extension after the last heartbeat: not earlier, barely later.
    assert EXTENSION - 0.05 <= f["reclaim_after_last_heartbeat_s"] <= EXTENSION + 0.5
    assert f["within_one_extension"] and s["checks"]["p_reclaimed_within_bound"]
    assert s["checks"]["no_lease_expired_while_heartbeats_flowed"]
    assert s["requests"]["turn1"]["failed"] == SCENARIOS["kill"]["requests"]


def test_decode_hung_p_reclaims_then_decode_recomputes(e2e_dir):
    s = run_scenario("hang", e2e_dir)
    _common(s)
    f = s["fault"]
    assert f["kind"] == "hang" and f["p_reclaimed_before_resume"]
    assert EXTENSION - 0.05 <= f["reclaim_after_last_heartbeat_s"] <= EXTENSION + 0.5
    assert f["within_one_extension"] and f["late_leases"] == []
    # After SIGCONT D's READ gate saw the heartbeat chain broken by the stall
    # and recomputed instead of reading reclaimed blocks (no corrupt bytes).
    d = s["sides"]["D"]
    assert d["stalls"] and max(d["stalls"]) >= EXTENSION - 1
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


@pytest.mark.parametrize("kw, message", [
    (dict(lease=5.0), "--lease must be >= 6"),
    (dict(drop_notifications=1.0), "--drop-notifications"),
    (dict(kill_decode_at=1.0, hang_decode_at=1.0), "exclusive"),
    (dict(hold_ttl=0.5), "--hold-ttl"),
])
def test_invalid_options_are_rejected_clearly(kw, message):
    with pytest.raises(RunError, match=message):
        RunOptions(**kw).validate()


def test_cli_rejects_short_lease(capsys):
    from connector.cli import main

    assert main(["run", "--lease", "4", "--quiet"]) == 2
    assert "--lease must be >= 6" in capsys.readouterr().out


def test_a_crashed_child_does_not_hang_the_parent(tmp_path):
    """SIGKILL the prefill process mid-run: the parent notices at once,
    reports it, and stops the decode process."""
    import os
    import signal
    import threading
    import time

    from connector.mainjob import Orchestrator

    orch = Orchestrator(RunOptions(out=str(tmp_path), quiet=True, requests=8, overload=8.0, timeout=60.0))

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
    assert elapsed < 5.0  # not the 8 s overload, nor the 60 s timeout
    assert not orch.children["D"].proc.is_alive()
