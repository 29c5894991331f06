"""Replay reads a log as it replays it (``eventlog.LogStream``): the same
records, results and errors as reading the whole log first."""
from __future__ import annotations

import json

import pytest

from kvplane.statemachines import events as E
from kvplane.statemachines.eventlog import (
    ACTION_TYPES, EmptyLog, EventLogError, LogStream, MalformedLine, MemoryLog, _schema, build, check, read_log,
)
from kvplane.statemachines.plane import ControlPlane
from kvplane.statemachines.replay import replay


def recorded_lines() -> list[str]:
    p = ControlPlane()
    log = MemoryLog(config=p.config)
    p.recorder = log
    p.handle(E.LeaseGranted(request_id="L1", block_ids=[7]), 0.0)
    p.handle(E.NewRequest(request_id="r1", engine_id="e", remote_request_id="x"), 0.0)
    p.handle(E.HandshakeOk(engine_id="e"), 0.5)
    p.handle(E.BlocksAllocated(request_id="r1", block_ids=[3], num_remote_tokens=4), 1.0)
    p.handle(E.StartLoad(request_id="r1"), 1.0)
    p.handle(E.ReadDone(request_id="r1"), 2.0)
    p.handle(E.RequestRunning(request_id="r1"), 2.0)
    p.handle(E.RequestFinished(request_id="r1"), 3.0)
    for t in (10.0, 100.0, 300.0):
        p.fire_due(t)
    return log.lines()


def test_stream_yields_the_records_read_log_builds():
    lines = recorded_lines() + [""]  # a blank line is skipped by both
    stream = LogStream(lines)
    log = read_log(lines)
    assert stream.config == log.config is not None
    assert tuple(stream) == log.records


def test_streamed_replay_gives_the_result_of_a_read_log():
    lines = recorded_lines()
    streamed, whole = replay(lines), replay(read_log(lines))
    assert streamed.ok and whole.ok
    for field in ("lines", "recorded_lines", "requests", "leases", "engines_evicted", "held", "end_time"):
        assert getattr(streamed, field) == getattr(whole, field), field


def _diverge(lines: list[str], index: int) -> None:
    rec = json.loads(lines[index])
    rec["state_after"] = "BOGUS"
    lines[index] = json.dumps(rec)


def test_a_bad_line_after_a_divergence_is_still_the_error():
    lines = recorded_lines()
    _diverge(lines, 2)
    assert replay(lines).divergence is not None  # the divergence alone: a result
    lines.append('{"v":1,"t":400,"event":"NoSuchEvent","data":{}}')
    with pytest.raises(Exception) as streamed:
        replay(lines)
    with pytest.raises(Exception) as whole:
        read_log(lines)
    assert type(streamed.value) is type(whole.value) and str(streamed.value) == str(whole.value)
    assert str(streamed.value).startswith(f"line {len(lines)}:")


def test_the_first_bad_line_is_reported_not_a_later_one():
    lines = recorded_lines()
    lines.insert(4, "not json")
    lines.append("[1, 2]")
    with pytest.raises(MalformedLine) as exc:
        replay(lines)
    assert exc.value.line == 5


def test_a_header_alone_is_an_empty_log():
    header = recorded_lines()[0]
    with pytest.raises(EmptyLog):
        LogStream([header, ""])
    with pytest.raises(EmptyLog):
        replay([header])


def test_stream_refuses_a_header_after_the_first_line():
    lines = recorded_lines()
    lines.insert(3, lines[0])
    with pytest.raises(MalformedLine, match="header must be the first line"):
        replay(lines)


def _sample(options: tuple[str, ...]):
    for opt, value in (("str", "x"), ("int", 1), ("float", 1.5), ("bool", True), ("tuple", [1, 2])):
        if opt in options:
            return value
    return None if "None" in options else "key"


def _variants(cls):
    schema = _schema(cls)
    whole = {name: _sample(options) for name, options, _ in schema}
    yield whole
    yield {**whole, "no_such_field": 1}
    for name, _, _ in schema:
        yield {k: v for k, v in whole.items() if k != name}  # a field missing
        yield {**whole, name: {"an": "object"}}  # of a type no field has
        yield {**whole, name: 1.5 if whole[name] != 1.5 else "x"}


def _outcome(fn, *args) -> str | None:
    try:
        fn(*args)
    except EventLogError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("name", sorted(ACTION_TYPES))
def test_check_accepts_and_refuses_what_build_does(name):
    # Recorded actions are checked without being built where building could
    # refuse nothing more: the verdicts and messages must be build's.
    cls = ACTION_TYPES[name]
    for data in _variants(cls):
        assert _outcome(check, ACTION_TYPES, name, data, 3, "action") == \
            _outcome(build, ACTION_TYPES, name, data, 3, "action"), data
