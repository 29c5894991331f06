from __future__ import annotations

import json

import pytest

from kvplane.statemachines import events as E
from kvplane.statemachines.eventlog import MemoryLog, UnknownEvent
from kvplane.statemachines.lifecycle_counts import eviction_words
from kvplane.statemachines.plane import ControlPlane
from kvplane.statemachines.replay import replay
from kvplane.statemachines.stats import Anomaly


def recorded_session():
    p = ControlPlane()
    log = MemoryLog(config=p.config)
    p.recorder = log
    p.handle(E.LeaseGranted(request_id="L1", block_ids=[7]), 0.0)
    p.handle(E.NewRequest(request_id="r1", engine_id="e", remote_request_id="x"), 0.0)
    p.handle(E.HandshakeOk(engine_id="e", samples=[(0.2, 0.01), (0.3, 0.001)]), 0.5)
    p.handle(E.BlocksAllocated(request_id="r1", block_ids=[3], num_remote_tokens=4), 1.0)
    p.handle(E.StartLoad(request_id="r1"), 1.0)
    for t in (5.0, 10.0, 12.0):
        p.fire_due(t)
    p.handle(E.LeaseHeartbeat(request_id="L1"), 12.0)
    p.handle(E.ReadDone(request_id="r1"), 13.0)
    p.handle(E.RequestRunning(request_id="r1"), 13.0)
    p.handle(E.RequestFinished(request_id="r1"), 14.0)
    for t in (32.0, 100.0, 300.0):
        p.fire_due(t)
    return p, log.lines()


def test_recorded_log_replays_exactly_with_summary():
    p, lines = recorded_session()
    r = replay(lines)
    assert r.divergence is None and r.ok
    assert r.requests == {"RELEASED": 1}
    assert r.leases["granted"] == 1 and r.leases["extended"] == 1 and r.leases["expired"] == 1
    assert r.engines_evicted == 1
    # Evicted for silence (engine_ttl after its last activity), at the tick that found it due.
    assert r.evictions == [{"engine": "e", "at": 100.0, "cause": "silence"}]
    assert eviction_words(r.engines_evicted, r.evictions) == "1 (silence 1)"
    assert r.held == [] and r.recorded_lines == len(lines) - 1


@pytest.mark.parametrize("field,mutate", [
    ("state_after", lambda rec: rec.update(state_after="BOGUS")),
    ("state_before", lambda rec: rec.update(state_before="BOGUS")),
    ("actions", lambda rec: rec["actions"].append(["FreeBlocks", {"request_id": "z", "block_ids": []}])),
    ("machine", lambda rec: rec.update(machine="lease:zz")),
])
def test_divergence_names_the_first_differing_line(field, mutate):
    _, lines = recorded_session()
    idx = 5
    rec = json.loads(lines[idx])
    mutate(rec)
    lines[idx] = json.dumps(rec)
    r = replay(lines)
    assert not r.ok and r.divergence.what == field
    assert r.divergence.seq == rec["seq"] and r.divergence.line == idx + 1


def test_a_timer_the_replay_would_not_fire_is_a_divergence():
    _, lines = recorded_session()
    # Drop every line but those before the first timer firing, then claim a lease
    # expiry long before it is due.
    head = [l for l in lines if '"TimerFired"' not in l][:3]
    head.append(json.dumps({"v": 1, "seq": 99, "t": 1.0, "machine": "lease:L1", "event": "TimerFired",
                            "data": {"kind": "lease", "key": "L1", "at": 1.0}, "state_before": "LEASED",
                            "state_after": "EXPIRED", "actions": []}))
    r = replay(head)
    assert r.divergence is not None and r.divergence.what == "missing" and r.divergence.seq == 99


def test_dropping_a_recorded_timer_line_is_a_divergence():
    _, lines = recorded_session()
    timer_lines = [i for i, l in enumerate(lines) if '"lease:L1","event":"TimerFired"' in l]
    del lines[timer_lines[0]]
    assert not replay(lines).ok


def test_stimuli_only_summary_and_leak_report():
    lines = [
        '{"v":1,"config":{"kv_lease_duration":30}}',
        '{"v":1,"t":0,"event":"LeaseGranted","data":{"request_id":"a","block_ids":[1]}}',
        '{"v":1,"t":0,"event":"LeaseGranted","data":{"request_id":"b","block_ids":[2]}}',
        '{"v":1,"t":1,"event":"ConsumerDone","data":{"request_id":"a","consumer":"d","expected_consumers":1}}',
        '{"v":1,"t":20,"event":"LeaseHeartbeat","data":{"request_id":"b"}}',
        '{"v":1,"t":21,"event":"ReadDone","data":{"request_id":"ghost"}}',
    ]
    r = replay(lines)
    assert r.leases["granted"] == 2 and r.leases["released"] == 1 and r.leases["extended"] == 1
    assert r.held == [("lease", "b", "LEASED", ("blocks",))] and not r.ok
    assert r.anomalies == {Anomaly("unknown_id", "decode_request", "ReadDone"): 1}
    # Advancing time lets the lease expire: nothing leaks.
    r = replay(lines, until=100.0)
    assert r.ok and r.leases["expired"] == 1


def test_stimuli_only_timer_line_means_advance_time():
    lines = [
        '{"v":1,"t":0,"event":"LeaseGranted","data":{"request_id":"a","block_ids":[1]}}',
        '{"v":1,"t":31,"event":"TimerFired","data":{"kind":"lease","key":"a","at":30}}',
    ]
    r = replay(lines)
    assert r.ok and r.leases["expired"] == 1


def test_bad_input_raises():
    with pytest.raises(UnknownEvent):
        replay(['{"v":1,"t":0,"event":"Frobnicate","data":{}}'])


def test_cli_exit_codes(tmp_path, capsys):
    from kvplane.app.offline.checks import cmd_check_log, cmd_explore, cmd_replay

    _, lines = recorded_session()
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(lines) + "\n")
    leak = tmp_path / "leak.jsonl"
    leak.write_text('{"v":1,"t":0,"event":"LeaseGranted","data":{"request_id":"a","block_ids":[1]}}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"v":7,"t":0,"event":"Abort","data":{"request_id":"a"}}\n')
    assert cmd_replay(str(good)) == 0
    assert cmd_replay(str(leak)) == 1
    assert cmd_replay(str(bad)) == 2
    assert cmd_check_log(str(good)) == 0
    assert cmd_check_log(str(leak)) == 1
    assert cmd_check_log(str(bad)) == 2
    assert cmd_explore(["--requests", "read", "--depth", "5"]) == 0
    assert cmd_explore(["--requests", "nope"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # bad input: one line on stderr each
    assert "line 1: log version 7" in err and "unknown profile(s) nope" in err


def test_a_change_inside_an_internal_cascade_diverges():
    """StartLoad's line carries the PostRead that the engine's wake-up set off,
    so a machine that stops posting the READ is caught on that line."""
    import attrs

    from kvplane.statemachines.machines import MACHINES, SPECS, decode_request
    from kvplane.statemachines.machine import compile_machine
    from kvplane.statemachines.spec import Transition

    _, lines = recorded_session()
    start = next(json.loads(l) for l in lines if '"event":"StartLoad"' in l)
    assert ["PostRead"] == [name for name, _ in start["actions"] if name == "PostRead"]

    table = tuple(
        attrs.evolve(t, actions=()) if isinstance(t, Transition) and t.src == "HANDSHAKING"
        and t.event is E.EngineReady and t.dest == "READING" else t
        for t in SPECS["decode_request"].table
    )
    broken = dict(MACHINES)
    # The validator alone rejects this table (READING would release an xfer
    # it never acquired); compile it unchecked to show replay catches it too.
    broken["decode_request"] = compile_machine(attrs.evolve(decode_request.SPEC, table=table), check=False)
    r = replay(lines, machines=broken)
    assert r.divergence is not None
    assert r.divergence.seq == start["seq"] and r.divergence.what == "actions"



# ------------------------------------------------------------ bad logs through the CLI (issue 9, item 9)
_GOOD = b'{"v":1,"seq":1,"t":0,"event":"LeaseGranted","data":{"request_id":"a","block_ids":[1]}}\n'
_BAD_LOGS = {
    # name: (file contents, what the message must say)
    "non-utf8": (_GOOD + b'{"v":1,"t":1,"event":"Abort","data":{"request_id":"\xff"}}\n', "line 2: not UTF-8"),
    "5000-digit int": (_GOOD + b'{"v":1,"t":' + b"9" * 5000 + b',"event":"Abort","data":{"request_id":"a"}}\n',
                       "line 2: bad number: integer of 5000 digits"),
    "100k deep": (_GOOD + b'{"v":1,"t":1,"event":"Abort","data":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
                  "line 2: JSON nested too deep"),
    "request_id {}": (_GOOD + b'{"v":1,"t":1,"event":"Abort","data":{"request_id":{}}}\n',
                      "line 2: event Abort: field 'request_id' must be a string"),
    "duration []": (b'{"v":1,"t":1,"event":"LeaseGranted","data":{"request_id":"a","block_ids":[1],"duration":[]}}\n',
                    "line 1: event LeaseGranted: field 'duration' must be a number or null"),
    "NaN time": (_GOOD + b'{"v":1,"t":NaN,"event":"Abort","data":{"request_id":"a"}}\n' + _GOOD.replace(b"0", b"-9"),
                 "line 2: bad number: NaN"),
    "inf time": (_GOOD + b'{"v":1,"t":-Infinity,"event":"Abort","data":{"request_id":"a"}}\n',
                 "line 2: bad number: -Infinity"),
    "backwards": (_GOOD.replace(b'"t":0', b'"t":5') + _GOOD.replace(b'"seq":1', b'"seq":2'),
                  "line 2: time goes backwards"),
    "dup seq": (_GOOD + _GOOD, "line 2: 'seq' 1 does not increase"),
    "empty": (b"", "empty log"),
    "markup in a name": (b'{"v":1,"t":0,"event":"[/x]","data":{}}\n', 'line 1: unknown event "[/x]"'),
}


@pytest.mark.parametrize("name", list(_BAD_LOGS))
@pytest.mark.parametrize("command", ["replay", "check-log"])
def test_cli_refuses_bad_logs_with_exit_2_naming_the_line(name, command, tmp_path, capsys):
    from kvplane.app.cli import main

    text, words = _BAD_LOGS[name]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(text)
    assert main([command, str(path)]) == 2
    got = capsys.readouterr()
    assert got.out == "" and len(got.err.splitlines()) == 1  # one line on stderr
    err = " ".join(got.err.split())
    assert words in err and "Traceback" not in err


def test_cli_prints_log_contents_verbatim_never_as_markup(tmp_path, capsys):
    """rich parsed "[/x]" in a lease id as a closing tag and raised MarkupError."""
    from kvplane.app.cli import main

    path = tmp_path / "leak.jsonl"
    path.write_text('{"v":1,"t":0,"event":"LeaseGranted","data":{"request_id":"[/x][bold]","block_ids":[1]}}\n')
    assert main(["replay", str(path)]) == 1
    assert main(["check-log", str(path)]) == 1
    assert "[/x][bold]" in capsys.readouterr().out


@pytest.mark.parametrize("grace", ["nan", "inf", "-1"])
def test_check_log_refuses_a_grace_that_is_not_a_finite_duration(grace, tmp_path, capsys):
    from kvplane.app.cli import main

    _, lines = recorded_session()
    path = tmp_path / "good.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["check-log", "--grace", grace, str(path)]) == 2
    assert "bad --grace" in capsys.readouterr().err


def test_one_observer_sees_the_same_steps_from_the_compiled_machines_and_the_reference_interpreter():
    from kvplane.statemachines.machines import SPECS
    from kvplane.statemachines.reference import ReferenceMachine

    _, lines = recorded_session()

    def steps_with(machines):
        seen = []

        def observer(step):
            seen.append((step.machine, type(step.event).__name__, step.state_before, step.state_after, step.actions,
                         step.deadline_before, step.instance.deadline))

        r = replay(lines, machines=machines, observer=observer)
        assert r.ok, r.divergence
        return seen

    compiled = steps_with(None)
    assert len(compiled) > len(lines) // 2  # cascaded transitions are observed too
    assert steps_with({kind: ReferenceMachine(spec) for kind, spec in SPECS.items()}) == compiled
