"""The plane takes a list of observers: each sees one step per top-level
stimulus (refused ones included), the event log's writer beside the others
(``recorder`` is the one of them that the event log is), in the order added."""
from __future__ import annotations

import io

from kvplane.statemachines import events as E
from kvplane.statemachines.eventlog import EventLogWriter, read_log
from kvplane.statemachines.plane import ControlPlane


def _grant_and_free(plane: ControlPlane) -> None:
    plane.handle(E.LeaseGranted(request_id="r1", block_ids=(1,), expected_consumers=1), 0.0)
    plane.handle(E.LeaseHeartbeat(request_id="nobody"), 1.0)  # refused: no such lease
    plane.handle(E.LeaseAbort(request_id="r1"), 2.0)


def test_every_observer_sees_every_stimulus_in_the_order_added():
    plane = ControlPlane()
    seen: list[tuple[str, str]] = []
    plane.observe(lambda step: seen.append(("first", type(step.event).__name__)))
    plane.observe(lambda step: seen.append(("second", type(step.event).__name__)))
    _grant_and_free(plane)
    names = ["LeaseGranted", "LeaseHeartbeat", "LeaseAbort"]
    assert seen == [(who, n) for n in names for who in ("first", "second")]


def test_the_event_log_writer_records_beside_the_other_observers():
    plane = ControlPlane()
    stream = io.StringIO()
    steps: list = []
    plane.observe(steps.append)
    writer = EventLogWriter.attach(plane, stream)
    assert plane.recorder is writer and plane.observers == (steps.append, writer)
    _grant_and_free(plane)
    writer.flush()
    records = read_log(io.StringIO(stream.getvalue())).records
    assert [type(r.event).__name__ for r in records] == [type(s.event).__name__ for s in steps] == [
        "LeaseGranted", "LeaseHeartbeat", "LeaseAbort"]
    assert steps[0].state_after == "LEASED" and records[0].state_after == "LEASED"


def test_replacing_the_recorder_keeps_the_others_and_unobserve_removes_one():
    plane = ControlPlane()
    a: list = []
    b: list = []
    other = plane.observe(a.append)
    plane.recorder = b.append
    plane.recorder = None  # the event log goes; the other observer stays
    assert plane.observers == (other,) and plane.recorder is None
    plane.unobserve(other)
    plane.unobserve(other)  # not there any more: no error
    _grant_and_free(plane)
    assert a == [] and b == [] and plane.observers == ()


def test_a_clone_has_no_observers():
    plane = ControlPlane()
    plane.observe(lambda step: None)
    assert plane.clone().observers == ()
