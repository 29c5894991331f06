from __future__ import annotations

import attrs

from kvplane.statemachines import events as E
from kvplane.statemachines.eventlog import MemoryLog
from kvplane.statemachines.machines import MACHINES, lease
from kvplane.statemachines.monitors import COLD, check_log, obligations
from kvplane.statemachines.plane import ControlPlane


def test_obligations_come_from_declared_holds():
    ob = obligations()
    assert ob["decode_request"]["READING"] == {"report", "xfer", "engine_ref", "heartbeat"}
    assert ob["lease"] == {"LEASED": {"blocks"}, "PARTIALLY_READ": {"blocks"}}
    assert "CONNECTED" not in ob["remote_engine"] and "remote_agent" in COLD
    # A new resource declared on a state is monitored without touching monitors.py.
    states = tuple(attrs.evolve(s, holds=s.holds | {"gpu"}) if s.name == "LEASED" else s for s in lease.STATES)
    from kvplane.statemachines.machine import Machine
    m = MACHINES["lease"]
    mutated = {**MACHINES, "lease": Machine(attrs.evolve(m.spec, states=states), m._table)}
    assert obligations(mutated)["lease"]["LEASED"] == {"blocks", "gpu"}


def test_discharged_log_is_clean():
    p = ControlPlane()
    log = MemoryLog(config=p.config)
    p.recorder = log
    p.handle(E.LeaseGranted(request_id="a", block_ids=[1]), 0.0)
    p.handle(E.ConsumerDone(request_id="a", consumer="d", expected_consumers=1), 1.0)
    rep = check_log(log.lines())
    assert rep.ok and rep.discharged == 1


def test_hot_at_end_of_hand_written_log():
    lines = [
        '{"v":1,"t":0,"event":"NewRequest","data":{"request_id":"r","engine_id":"e","remote_request_id":"x"}}',
        '{"v":1,"t":0.1,"event":"HandshakeOk","data":{"engine_id":"e"}}',
        '{"v":1,"t":1,"event":"BlocksAllocated","data":{"request_id":"r","block_ids":[1],"num_remote_tokens":0}}',
        '{"v":1,"t":2,"event":"LeaseGranted","data":{"request_id":"L","block_ids":[1]}}',
    ]
    rep = check_log(lines)
    got = {(h.kind, h.key, h.resource, h.reason) for h in rep.hot}
    assert got == {("decode_request", "r", "report", "end_of_log"), ("decode_request", "r", "heartbeat", "end_of_log"),
                   ("lease", "L", "blocks", "end_of_log")}
    report = [h for h in rep.hot if h.resource == "report"][0]
    assert report.state == "FULL_PREFIX_HIT" and report.since == 1 and report.deadline == 121
    # With time advancing past every deadline, only the forever-held heartbeat of... nothing remains.
    assert check_log(lines, until=1000.0).ok


def test_past_deadline_in_a_recorded_log_whose_timers_were_not_fired():
    p = ControlPlane()
    log = MemoryLog(config=p.config)
    p.recorder = log
    p.handle(E.LeaseGranted(request_id="a", block_ids=[1]), 0.0)
    # The embedder forgot fire_due: the lease outlives its 30 s deadline.
    p.handle(E.ConsumerDone(request_id="a", consumer="d", expected_consumers=1), 50.0)
    rep = check_log(log.lines())
    assert [(h.key, h.reason, h.deadline, h.at) for h in rep.hot] == [("a", "past_deadline", 30.0, 50.0)]
    assert not rep.ok


def test_a_recorded_log_the_machines_do_not_reproduce_fails_the_check(tmp_path, capsys):
    """Issue 9, item 11: a recorded recv marked done whose report never appears
    (ReportRecv cut from its line).  The monitors watch the replay, which does
    report; the log must still fail, naming the divergence, as replay does."""
    import json

    from kvplane.app.offline.checks import cmd_check_log, cmd_replay

    p = ControlPlane()
    log = MemoryLog(config=p.config)
    p.recorder = log
    p.handle(E.NewRequest(request_id="r1", engine_id="e", remote_request_id="x", remote_block_ids=[1]), 0.0)
    p.handle(E.HandshakeOk(engine_id="e", samples=[(0.0, 0.01)]), 0.1)
    p.handle(E.BlocksAllocated(request_id="r1", block_ids=[3], num_remote_tokens=4), 1.0)
    p.handle(E.StartLoad(request_id="r1"), 1.0)
    p.handle(E.ReadDone(request_id="r1"), 2.0)
    p.handle(E.RequestRunning(request_id="r1"), 2.0)
    p.handle(E.RequestFinished(request_id="r1"), 3.0)
    lines = log.lines()
    assert check_log(lines).ok  # as recorded: clean
    idx = next(i for i, l in enumerate(lines) if '"event":"ReadDone"' in l)
    rec = json.loads(lines[idx])
    assert rec["state_after"] == "RECV_DONE"
    rec["actions"] = [a for a in rec["actions"] if a[0] != "ReportRecv"]
    lines[idx] = json.dumps(rec)

    rep = check_log(lines)
    assert rep.hot == []  # the replayed plane reported, so nothing is hot...
    assert rep.divergence is not None and rep.divergence.what == "actions" and rep.divergence.line == idx + 1
    assert not rep.ok  # ...but the log is not the run the monitors saw
    path = tmp_path / "diverged.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert cmd_check_log(str(path)) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"DIVERGENCE at seq {rec['seq']} (line {idx + 1}): actions differs" in out and "FAILED" in out
    assert cmd_replay(str(path)) == 1
