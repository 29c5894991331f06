from __future__ import annotations

import io
import json

import pytest

from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.eventlog import (
    EmptyLog, EventLogError, EventLogWriter, MalformedLine, MemoryLog, UnknownEvent, UnsupportedVersion, encode,
    read_log,
)
from kvplane.statemachines.plane import ControlPlane


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


# ------------------------------------------------------------ hostile input (issue 9, item 9)
GOOD = b'{"v":1,"seq":1,"t":0,"event":"LeaseGranted","data":{"request_id":"a","block_ids":[1]}}'


def _line(t=b"1", data=b'{"request_id":"a"}', event=b"LeaseAbort", seq=b"2") -> bytes:
    return b'{"v":1,"seq":' + seq + b',"t":' + t + b',"event":"' + event + b'","data":' + data + b"}"


HOSTILE = [
    # (what, second line, error class, words the message must contain)
    ("non-UTF-8 bytes", _line(data=b'{"request_id":"' + bytes([0xFF, 0xFE]) + b'"}'), MalformedLine, "not UTF-8"),
    ("5000-digit integer time", _line(t=b"9" * 5000), MalformedLine, "integer of 5000 digits"),
    ("5000-digit integer field", _line(data=b'{"request_id":"a","block_ids":[' + b"1" * 5000 + b"]}",
                                       event=b"LeaseGranted"), MalformedLine, "integer of 5000 digits"),
    ("float overflowing to inf", _line(t=b"1e400"), MalformedLine, "overflows to inf"),
    ("JSON nested 100k deep", _line(data=b"[" * 100_000 + b"]" * 100_000), MalformedLine, "nested too deep"),
    ("object nested 100k deep", _line(data=b'{"a":' * 100_000 + b"1" + b"}" * 100_000), MalformedLine,
     "nested too deep"),
    ("request_id: {}", _line(data=b'{"request_id":{}}'), MalformedLine, "'request_id' must be a string"),
    ("duration: []", _line(event=b"LeaseGranted", data=b'{"request_id":"b","block_ids":[2],"duration":[]}'),
     MalformedLine, "'duration' must be a number or null"),
    ("block id not an int", _line(event=b"LeaseGranted", data=b'{"request_id":"b","block_ids":[{}]}'),
     MalformedLine, "'block_ids' element <an object>"),
    ("timer key an object", _line(event=b"TimerFired", data=b'{"kind":"lease","key":{"x":1},"at":1}'),
     MalformedLine, "'key' must be a scalar or a list"),
    ("bool as count", _line(event=b"ConsumerDone",
                            data=b'{"request_id":"a","consumer":"d","expected_consumers":true}'),
     MalformedLine, "'expected_consumers' must be an integer"),
    ("NaN time", _line(t=b"NaN"), MalformedLine, "NaN is not a number"),
    ("infinite time", _line(t=b"Infinity"), MalformedLine, "Infinity is not a number"),
    ("-infinite time", _line(t=b"-Infinity"), MalformedLine, "-Infinity is not a number"),
    ("NaN in data", _line(event=b"LeaseGranted", data=b'{"request_id":"b","block_ids":[2],"duration":NaN}'),
     MalformedLine, "NaN is not a number"),
    ("time going backwards", _line(t=b"-1"), MalformedLine, "time goes backwards"),
    ("duplicated seq", _line(seq=b"1"), MalformedLine, "'seq' 1 does not increase"),
    ("seq going backwards", _line(seq=b"0"), MalformedLine, "'seq' 0 does not increase"),
    ("seq a float", _line(seq=b"2.5"), MalformedLine, "'seq' must be a non-negative integer"),
    ("state_after an object", _line()[:-1] + b',"state_after":{},"actions":[]}', MalformedLine,
     "'state_after' must be a string or null"),
    ("version true", b'{"v":true,"t":1,"event":"LeaseAbort","data":{"request_id":"a"}}', MalformedLine,
     "invalid version"),
]


@pytest.mark.parametrize("what, second, err, words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_lines_raise_a_typed_error_naming_their_line(what, second, err, words, tmp_path):
    # The same through every kind of source: bytes lines, str lines, a file.
    path = tmp_path / "log.jsonl"
    path.write_bytes(GOOD + b"\n" + second + b"\n")
    sources = [[GOOD, second], path]
    try:
        sources.append([GOOD.decode(), second.decode()])
    except UnicodeDecodeError:
        pass
    for source in sources:
        with pytest.raises(err) as info:
            read_log(source)
        assert info.value.line == 2 and str(info.value).startswith("line 2: ") and words in str(info.value), (
            what, str(info.value)[:200])


def test_time_going_backwards_after_a_nan_is_refused_at_the_nan():
    lines = [GOOD, _line(t=b"NaN"), _line(t=b"-5", seq=b"3")]
    with pytest.raises(MalformedLine) as info:
        read_log(lines)
    assert info.value.line == 2


@pytest.mark.parametrize("text, lines", [(b"", 0), (b"\n\n", 2), (b'{"v":1,"config":{}}\n', 1)])
def test_an_empty_log_is_an_error(tmp_path, text, lines):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(text)
    with pytest.raises(EmptyLog) as info:
        read_log(path)
    assert info.value.line == lines and "empty log" in str(info.value)
    assert isinstance(info.value, EventLogError)


def test_omitted_seqs_take_the_line_number_and_explicit_ones_must_increase():
    log = read_log([GOOD, _line(seq=b"7"), b'{"v":1,"t":2,"event":"LeaseAbort","data":{"request_id":"a"}}',
                    _line(seq=b"9", t=b"3")])
    assert [r.seq for r in log.records] == [1, 7, 3, 9]


def test_bounded_numbers_still_load():
    big = 2**64 - 1
    log = read_log([b'{"v":1,"seq":' + str(2**63).encode() + b',"t":1e300,"event":"LeaseGranted",'
                    b'"data":{"request_id":"a","block_ids":[' + str(big).encode() + b'],"duration":-0.0}}'])
    rec = log.records[0]
    assert rec.t == 1e300 and rec.event.block_ids == (big,) and rec.seq == 2**63


def test_a_config_header_of_the_wrong_type_names_line_1():
    for config, words in ((b'{"kv_lease_duration":"30"}', "'kv_lease_duration' must be a number"),
                          (b'{"kv_lease_duration":NaN}', "NaN is not a number"),
                          (b'{"handshake_max_attempts":2.5}', "'handshake_max_attempts' must be an integer"),
                          (b"[]", "config must be an object")):
        with pytest.raises(MalformedLine) as info:
            read_log([b'{"v":1,"config":' + config + b"}", GOOD])
        assert info.value.line == 1 and words in str(info.value)


def test_event_and_action_names_come_from_the_definitions_only():
    import attrs

    from kvplane.statemachines import actions as A
    from kvplane.statemachines.base import Action, ArmTimer, Event, TimerFired
    from kvplane.statemachines.eventlog import ACTION_TYPES

    @attrs.frozen
    class ReadDone(Event):  # a test's own event, even one reusing a name, is not the log's
        request_id: str

    class Shim(Action):
        pass

    assert E.ALL_EVENTS["ReadDone"] is E.ReadDone and E.ALL_EVENTS["TimerFired"] is TimerFired
    assert "Shim" not in ACTION_TYPES and ACTION_TYPES["ArmTimer"] is ArmTimer
    # Common bases and builder-only classes are declared abstract: never logged, never parsed.
    for name in ("RefuseNotification", "CancelXfer", "ReportRecvFailed"):
        assert name not in A.ALL_ACTIONS
    assert {"RefuseForeignSender", "RefuseWrongCount", "ReleaseXfer", "ReportRecv"} <= set(A.ALL_ACTIONS)
    assert all(v.__name__ == k for k, v in {**E.ALL_EVENTS, **A.ALL_ACTIONS}.items())


def test_fields_reads_attrs_events_and_struct_actions_alike():
    """base.fields: what the log's schema and the validators read of a class."""
    import attrs
    import msgspec

    from kvplane.statemachines import actions as A
    from kvplane.statemachines.base import StructEvent, fields

    post = fields(A.PostRead)
    assert [f.name for f in post] == ["request_id", "engine_id", "remote_request_id", "local_block_ids",
                                      "remote_block_ids", "expected_consumers"]
    assert [f.type for f in post][-2:] == ["tuple", "int"] and post[-1].default == 1
    assert post[0].default is attrs.NOTHING and not any(f.kw_only or f.converter or f.validator for f in post)
    assert issubclass(E.EngineReady, StructEvent) and fields(E.EngineReady)[3].name == "clock_offset"
    assert fields(E.NewRequest) == attrs.fields(E.NewRequest)  # an attrs event: attrs' own records
    # A logged action encodes exactly the fields base.fields names, in that order.
    act = A.ReleaseXfer("r1", cancel=True)
    assert list(json.loads(encode(1, E.ReadDone(request_id="r1"), 0.0, "decode_request:r1", "READING",
                                  "RECV_DONE", [act]))["actions"][0][1]) == [f.name for f in fields(A.ReleaseXfer)]

    class WithFactory(msgspec.Struct):
        name: str
        ids: list = msgspec.field(default_factory=list)

    (_, ids) = fields(WithFactory)
    assert isinstance(ids.default, attrs.Factory) and ids.default.factory is list
