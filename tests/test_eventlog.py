from __future__ import annotations

import io
import json

import pytest

from statemachines import events as E
from statemachines.config import PlaneConfig
from statemachines.eventlog import (
    EventLogWriter, MalformedLine, MemoryLog, UnknownEvent, UnsupportedVersion, read_log,
)
from statemachines.plane import ControlPlane


def run_small(plane):
    plane.handle(E.NewRequest(request_id="r1", engine_id="e", remote_request_id="x", remote_block_ids=[1, 2]), 0.0)
    plane.handle(E.HandshakeOk(engine_id="e", samples=[(0.5, 0.01)]), 0.1)
    plane.handle(E.BlocksAllocated(request_id="r1", block_ids=[3], num_remote_tokens=4), 1.0)
    plane.handle(E.StartLoad(request_id="r1"), 1.0)
    plane.fire_due(5.0)
    plane.handle(E.ReadDone(request_id="r1"), 6.0)
    plane.handle(E.ReadDone(request_id="nobody"), 6.0)


def test_recorded_lines_have_the_documented_shape_and_round_trip():
    p = ControlPlane(PlaneConfig(kv_lease_duration=12.0))
    log = MemoryLog(config=p.config)
    p.recorder = log
    run_small(p)
    lines = log.lines()
    head = json.loads(lines[0])
    assert head == {"v": 1, "config": head["config"]} and head["config"]["kv_lease_duration"] == 12.0
    first = json.loads(lines[1])
    assert set(first) == {"v", "seq", "t", "machine", "event", "data", "state_before", "state_after", "actions"}
    assert first["machine"] == "decode_request:r1" and first["state_after"] == "HEARTBEATING"
    assert first["actions"][0][0] == "StartHeartbeat"
    parsed = read_log(lines)
    assert parsed.config == PlaneConfig(kv_lease_duration=12.0)
    seqs = [r.seq for r in parsed.records]
    assert seqs == list(range(1, len(seqs) + 1))
    # Tuples come back as tuples through the converters, nested ones too.
    hs = parsed.records[1].event
    assert hs == E.HandshakeOk(engine_id="e", samples=((0.5, 0.01),))
    assert parsed.records[0].event.remote_block_ids == (1, 2)
    # Heartbeat firing and an unknown-id stimulus are in the log.
    names = [(r.machine, type(r.event).__name__) for r in parsed.records]
    assert ("heartbeat:e", "TimerFired") in names
    unknown = [r for r in parsed.records if r.machine == "decode_request:nobody"]
    assert unknown and unknown[0].state_before is None and unknown[0].actions == []


def test_stimuli_only_lines_load():
    text = '{"v":1,"t":0,"event":"LeaseGranted","data":{"request_id":"a","block_ids":[1]}}\n\n' \
           '{"v":1,"t":2.5,"event":"LeaseAbort","data":{"request_id":"a"}}\n'
    log = read_log(io.StringIO(text))
    assert log.config is None and [r.recorded for r in log.records] == [False, False]
    assert log.records[1].seq == 3 and log.records[1].line == 3


def test_stimuli_only_writer():
    p = ControlPlane()
    out = io.StringIO()
    w = EventLogWriter(out, stimuli_only=True)
    p.recorder = w
    run_small(p)
    w.flush()
    for line in out.getvalue().splitlines():
        assert "state_after" not in json.loads(line)
    assert all(not r.recorded for r in read_log(out.getvalue().splitlines()).records)


@pytest.mark.parametrize("text,err,where", [
    ('{"v":1,"t":0,"event":"Nope","data":{}}', UnknownEvent, 1),
    ('{"v":2,"t":0,"event":"Abort","data":{"request_id":"a"}}', UnsupportedVersion, 1),
    ('not json', MalformedLine, 1),
    ('{"v":1,"t":"x","event":"Abort","data":{"request_id":"a"}}', MalformedLine, 1),
    ('{"v":1,"t":0,"event":"Abort","data":{"request_id":"a","bogus":1}}', UnknownEvent, 1),
    ('{"v":1,"t":0,"event":"Abort","data":{}}', MalformedLine, 1),
    ('{"v":1,"t":5,"event":"Abort","data":{"request_id":"a"}}\n{"v":1,"t":1,"event":"Abort","data":{"request_id":"a"}}',
     MalformedLine, 2),
    ('{"v":1,"t":0,"event":"Abort","data":{"request_id":"a"},"state_after":"X","actions":[["Bogus",{}]]}',
     UnknownEvent, 1),
    ('{"v":1,"t":0,"event":"Abort","data":{"request_id":"a"}}\n{"v":1,"config":{}}', MalformedLine, 2),
    ('{"v":1,"config":{"kv_lease_duration":-1}}', MalformedLine, 1),
])
def test_bad_input_raises_a_typed_error_naming_the_line(text, err, where):
    with pytest.raises(err) as info:
        read_log(text.splitlines())
    assert info.value.line == where and f"line {where}" in str(info.value)


def test_file_paths(tmp_path):
    path = tmp_path / "log.jsonl"
    p = ControlPlane()
    with open(path, "w") as f:
        w = EventLogWriter.attach(p, f)
        run_small(p)
        w.flush()
    assert len(read_log(path).records) == w.seq > 5
