"""The writer's batched encoding writes, line for line, what encoding each
recorded Step on its own writes (``encode``), whatever a batch holds: timers,
cascades, refusals, values msgspec cannot write as recorded (non-finite
floats, which json writes), sets, integers past 64 bits, and values whose JSON
looks like the start of the next record."""
from __future__ import annotations

import io
import json

import pytest

from kvplane.statemachines import events as E
from kvplane.statemachines.base import ArmTimer, TimerFired
from kvplane.statemachines.eventlog import EventLogWriter, encode, read_log
from kvplane.statemachines.observe import Step
from kvplane.statemachines.plane import ControlPlane

BOUNDARY_ID = 'x},{"v":1,"seq":2,"t":0}'  # the bytes between two records, inside a string (escaped there)


def session(plane: ControlPlane) -> None:
    plane.handle(E.LeaseGranted(request_id="L1", block_ids=[7]), 0.0)
    plane.handle(E.NewRequest(request_id="r1", engine_id="e", remote_request_id="x", remote_block_ids=[1, 2]), 0.0)
    plane.handle(E.HandshakeOk(engine_id="e", samples=[(0.2, 0.01)]), 0.5)
    plane.handle(E.BlocksAllocated(request_id="r1", block_ids=[3], num_remote_tokens=4), 1.0)
    plane.handle(E.StartLoad(request_id="r1"), 1.0)  # a cascade: the engine reference
    plane.handle(E.NewRequest(request_id="r2", engine_id="e2", remote_request_id="z"), 1.0)
    plane.handle(E.BlocksAllocated(request_id="r2", block_ids=[4], num_remote_tokens=4), 1.0)
    plane.handle(E.StartLoad(request_id="r2"), 1.0)  # waits for its engine's handshake
    plane.handle(E.HandshakeOk(engine_id="e2"), 1.5)  # a timer, then the cascade's effects: r2's read
    plane.fire_due(5.0)  # heartbeats
    plane.handle(E.LeaseHeartbeat(request_id="L1"), 6.0)  # a timer moved
    plane.handle(E.ReadDone(request_id="r1"), 6.0)
    plane.handle(E.ReadDone(request_id="nobody"), 6.0)  # refused: no instance
    plane.handle(TimerFired("no_such_kind", "k", 1.0), 6.0)  # refused: no kind
    plane.handle(E.NewRequest(request_id=BOUNDARY_ID, engine_id="e", remote_request_id="y"), 6.5)
    plane.handle(E.LeaseGranted(request_id="nan", block_ids=[8], duration=float("nan")), 7.0)  # json writes it
    plane.handle(E.LeaseGranted(request_id="big", block_ids=[2**70]), 7.0)  # past 64 bits
    plane.handle(TimerFired("lease", frozenset({"b", "a"}), 1.0), 7.0)  # a set: sorted
    plane.handle(E.RequestRunning(request_id="r1"), 8.0)
    plane.handle(E.RequestFinished(request_id="r1"), 9.0)
    plane.fire_due(400.0)  # expiries and evictions


def one_by_one(stimuli_only: bool) -> list[str]:
    """Each Step the plane gives a plain observer, encoded on its own."""
    plane = ControlPlane()
    steps: list[Step] = []
    plane.recorder = steps.append
    session(plane)
    return [encode(seq, s.event, s.now, s.machine, s.state_before, s.state_after,
                   None if stimuli_only else s.actions) for seq, s in enumerate(steps, start=1)]


def written(stimuli_only: bool, chained: bool, flush_every: int = 4096) -> list[str]:
    plane = ControlPlane()
    stream = io.StringIO()
    writer = EventLogWriter(stream, flush_every=flush_every, stimuli_only=stimuli_only)
    # Chained: an observer in front of the writer hands it Steps (the connector's way).
    plane.recorder = (lambda step: writer(step)) if chained else writer
    session(plane)
    writer.flush()
    return stream.getvalue().splitlines()


@pytest.mark.parametrize("stimuli_only", [False, True])
@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("batch", [1, 3, 32])
def test_batches_write_what_each_step_encoded_alone_writes(stimuli_only, chained, batch, monkeypatch):
    monkeypatch.setattr(EventLogWriter, "ENCODE_BATCH", batch)
    expected = one_by_one(stimuli_only)
    assert written(stimuli_only, chained) == expected
    assert written(stimuli_only, chained, flush_every=5) == expected


def test_the_awkward_values_are_there_as_before():
    lines = one_by_one(False)
    first = {}  # the first line of each machine
    for line in lines:
        first.setdefault(json.loads(line)["machine"], line)
    assert '"duration":NaN' in first["lease:nan"]  # json's, which the reader refuses: the log says what was recorded
    assert str(2**70) in first["lease:big"]
    assert '"key":["a","b"]' in first["lease:" + str(frozenset({"b", "a"}))]
    assert json.loads(first["decode_request:" + BOUNDARY_ID])["data"]["request_id"] == BOUNDARY_ID
    assert json.loads(first["lease:L1"])["actions"][-1][0] == "ArmTimer"
    assert [a[0] for a in json.loads(first["remote_engine:e2"])["actions"]] == ["WakeRequesters", "ArmTimer", "PostRead"]
    assert [json.loads(line)["seq"] for line in lines] == list(range(1, len(lines) + 1))


def test_a_value_holding_what_starts_a_record_stays_inside_its_line(monkeypatch):
    # Not a value the machines make (no field holds mappings): a batch's
    # lines are cut by the encoder, not by searching its text.
    monkeypatch.setattr(EventLogWriter, "ENCODE_BATCH", 2)
    tricky = ArmTimer("lease", ({"v": 1, "seq": 5}, '}\n{"v":1,"seq":6}'), 1.0)
    plain = E.LeaseHeartbeat(request_id="L")
    writer = EventLogWriter(io.StringIO())
    writer.capture((plain, 1.0, "lease", "L", "LEASED", "LEASED", [tricky], None, None), None)
    writer.capture((plain, 2.0, "lease", "L", "LEASED", "LEASED", [], None, None), None)
    writer.flush()
    lines = writer.stream.getvalue().splitlines()
    assert lines == [encode(1, plain, 1.0, "lease:L", "LEASED", "LEASED", [tricky]),
                     encode(2, plain, 2.0, "lease:L", "LEASED", "LEASED", [])]
    assert json.loads(lines[0])["actions"][0][1]["key"] == [{"seq": 5, "v": 1}, '}\n{"v":1,"seq":6}']


def test_a_value_json_cannot_hold_loses_its_own_line_only(monkeypatch):
    # Not a value the machines make (an embedder's object in an Any field):
    # the batch it is in is written line by line, and the error names it.
    monkeypatch.setattr(EventLogWriter, "ENCODE_BATCH", 4)
    writer = EventLogWriter(io.StringIO())
    plain = E.LeaseHeartbeat(request_id="L")
    stimuli = [plain, TimerFired("lease", object(), 1.0), plain, plain, plain]
    captured = []
    for i, ev in enumerate(stimuli):
        try:
            writer.capture((ev, float(i), "lease", "L", "LEASED", "LEASED", [], None, None), None)
        except TypeError as exc:
            captured.append((i, str(exc)))
    assert len(captured) == 1 and captured[0][0] == 3  # raised when its batch (4) was encoded
    assert "seq 2 (TimerFired" in captured[0][1] and "unsupported" in captured[0][1]
    writer.flush()
    assert [json.loads(line)["seq"] for line in writer.stream.getvalue().splitlines()] == [1, 3, 4, 5]


def test_the_stream_sees_records_every_flush_every_and_on_flush(monkeypatch):
    monkeypatch.setattr(EventLogWriter, "ENCODE_BATCH", 4)
    plane = ControlPlane()
    stream = io.StringIO()
    writer = EventLogWriter.attach(plane, stream, flush_every=10)
    header = 1
    for i in range(25):
        plane.handle(E.LeaseGranted(request_id=f"L{i}", block_ids=[i]), float(i))
        lines = stream.getvalue().count("\n") - header
        assert lines == (i + 1) // 10 * 10, i  # whole flushes only, at exactly every 10th record
    writer.flush()
    log = read_log(stream.getvalue().splitlines())
    assert [r.seq for r in log.records] == list(range(1, 26))
    writer.flush()  # nothing new: nothing written
    assert stream.getvalue().count("\n") == 26


def test_a_stimulus_whose_record_fails_loses_its_own_line_only(monkeypatch):
    # Records are made when their batch is encoded: one that cannot be made
    # (not something the plane hands over: a deadline that is not a number)
    # raises there, after every other line of its batch is kept, in order.
    monkeypatch.setattr(EventLogWriter, "ENCODE_BATCH", 4)
    writer = EventLogWriter(io.StringIO())
    plain = E.LeaseHeartbeat(request_id="L")
    raised = []
    for i in range(5):
        deadline = "soon" if i == 1 else None
        try:
            writer.capture((plain, float(i), "lease", "L", "LEASED", "LEASED", [], None, deadline), None)
        except TypeError:
            raised.append(i)
    assert raised == [3]  # when its batch (4) was encoded
    writer.flush()
    assert [json.loads(line)["seq"] for line in writer.stream.getvalue().splitlines()] == [1, 3, 4, 5]
