"""Fuzz every decoder of input that crosses a boundary: NIXL notifications
(completion, heartbeat, PUSH_REG), metadata frames, event-log lines (read,
replayed and checked) and kv_transfer_params.  Random bytes and mutations
of valid encodings (truncation, bit flips, splices, huge digit runs, deep
nesting) must either decode to a valid record or raise the project's typed
error for that decoder: nothing else may escape.  (Handshake frames are
fuzzed in their own file.)"""
from __future__ import annotations

import json
import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplane.connector.params import BadTransferParams, RemoteKV
from kvplane.statemachines import events as E
from kvplane.statemachines.eventlog import ALL_EVENTS, EventLogError, MemoryLog, read_log
from kvplane.statemachines.monitors import check_log
from kvplane.statemachines.plane import ControlPlane
from kvplane.statemachines.replay import replay
from kvplane.transport import wire
from kvplane.transport.wire import WireError

FUZZ = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------ mutations of valid encodings
JUNK = [b"9" * 5000, b"-" + b"9" * 400, b"1" * 30, b"[" * 20_000, b'{"a":' * 5000, b"\x91" * 5000,
        b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xcb\x7f\xf8" + bytes(6), b"NaN", b"-Infinity",
        b"1e999", b"\xff\xfe", b"\x00", b",", b":", b"HB:", b"PUSH_REG:", b"\\ud800", b'"', b"{}", b"[]", b"null"]
_SEPARATORS = b':,[]{}"\x91\x92\x81\x82\x87\xa1'


@st.composite
def mutations(draw, seeds: list[bytes]) -> bytes:
    """A valid encoding damaged by one to three operations: cut, bit flip,
    splice with another, insertion of junk (huge digit runs, deep nesting,
    non-finite numbers, bad UTF-8) or of random bytes.  Positions favour the
    ends and the spots right after a separator, where a field starts."""
    s = draw(st.sampled_from(seeds))
    if draw(st.integers(0, 15)) == 0:
        return draw(st.binary(max_size=256))
    for _ in range(draw(st.integers(1, 3))):
        spots = [0, len(s)] + [i + 1 for i, c in enumerate(s) if c in _SEPARATORS]
        at = draw(st.sampled_from(spots) | st.integers(0, len(s)))
        op = draw(st.sampled_from(["cut", "flip", "splice", "junk", "junk", "bytes", "overwrite"]))
        if op == "cut":
            s = s[:at]
        elif op == "flip" and s:
            b = bytearray(s)
            b[min(at, len(b) - 1)] ^= 1 << draw(st.integers(0, 7))
            s = bytes(b)
        elif op == "splice":
            other = draw(st.sampled_from(seeds))
            s = s[:at] + other[draw(st.integers(0, len(other))):]
        elif op == "junk":
            s = s[:at] + draw(st.sampled_from(JUNK)) + s[at:]
        elif op == "bytes":
            s = s[:at] + draw(st.binary(min_size=1, max_size=16)) + s[at:]
        elif op == "overwrite":
            junk = draw(st.sampled_from(JUNK))
            s = s[:at] + junk + s[at + len(junk):]
    return s


# ------------------------------------------------------------ notifications
REG = wire.PushRegistration(request_id="p-r1", engine_id="decode-0", decode_request_id="d-r1",
                            block_ids=(5, 6, 2**32 - 1), host="127.0.0.1", port=5555, deadline=1234.5)
NOTIF_SEEDS = [
    wire.encode_completion("cmpl-0a1b-0", 2),
    wire.encode_completion("é-ü", 1024),
    wire.encode_heartbeat(["p-r1", "p-r2", "x" * 256]),
    wire.encode_push_reg(REG),
    wire.encode_push_reg(wire.PushRegistration(request_id="r", engine_id="D", decode_request_id="d",
                                               block_ids=(), host="::1", port=1)),
]


def _assert_valid(notif) -> None:
    """What decodes is within every bound the encoders keep."""
    if isinstance(notif, wire.CompletionNotif):
        assert 1 <= notif.expected_consumers <= wire.MAX_EXPECTED_CONSUMERS
        assert 0 < len(notif.request_id.encode()) <= wire.MAX_ID_BYTES
    elif isinstance(notif, wire.HeartbeatNotif):
        assert 1 <= len(notif.request_ids) <= wire.MAX_HEARTBEAT_IDS
        assert all(wire.id_problem(r) is None for r in notif.request_ids)
    else:
        reg = notif.registration
        assert isinstance(reg, wire.PushRegistration)
        assert reg.deadline is None or math.isfinite(reg.deadline)
        assert all(0 <= b <= wire.MAX_BLOCK_ID for b in reg.block_ids)
        assert wire.encode_push_reg(reg)  # what we accept, we could have sent


def _decode_notif_or_typed_error(data) -> None:
    try:
        notif = wire.decode_notif(data)
    except wire.MalformedNotification:
        return
    _assert_valid(notif)


@settings(FUZZ, max_examples=600)  # cheap; enough to hit "<id>:<5000 digits>" in every run
@given(mutations(NOTIF_SEEDS))
def test_notifications_mutated(data):
    _decode_notif_or_typed_error(data)


@FUZZ
@given(st.binary(max_size=512) | st.builds(lambda p, b: p + b, st.sampled_from([b"HB:", b"PUSH_REG:", b"r:"]),
                                           st.binary(max_size=512)))
def test_notifications_random(data):
    _decode_notif_or_typed_error(data)


def test_notifications_huge():
    for data in (b"x:" + b"9" * 5000, b"HB:" + b"a," * 600_000, b"PUSH_REG:" + b"\x91" * 1_000_000,
                 b"r:1" * 400_000, b"\xff" * (wire.MAX_NOTIF_BYTES + 1)):
        with pytest.raises(wire.MalformedNotification):
            wire.decode_notif(data)


# Any msgpack-able value, hostile ones included.
msgpack_values = st.sampled_from([None, math.nan, math.inf, -math.inf, True, {}, [], "", "a:b", "x" * 300, -1,
                                  2**64 - 1, b"r1", [True], [-1], [1.5], "::1", "[::1", "a b"]) | st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
REG_FIELDS = ["request_id", "engine_id", "decode_request_id", "block_ids", "host", "port", "deadline"]


@settings(FUZZ, max_examples=200)
@given(st.dictionaries(st.sampled_from(REG_FIELDS), msgpack_values, max_size=3), st.booleans())
def test_push_reg_fields_hostile(changes, start_valid):
    body = {**REG.to_wire(), **changes} if start_valid else changes
    _decode_notif_or_typed_error(wire.PUSH_REG_PREFIX + msgpack.packb(body, use_bin_type=True))


# ------------------------------------------------------------ metadata frames
FRAME_SEEDS = [wire.frame_metadata(b""), wire.frame_metadata(b"agent-metadata" * 20)]


@FUZZ
@given(mutations(FRAME_SEEDS))
def test_metadata_frames_mutated(data):
    try:
        payload = wire.unframe_metadata(data)
    except WireError:
        return
    assert wire.frame_metadata(payload) == data  # only an intact frame passes


@pytest.mark.parametrize("obj", [None, 5, "KVPM", [1, 2], {"a": 1}, 3.5])
def test_metadata_frames_not_bytes(obj):
    with pytest.raises(WireError):
        wire.unframe_metadata(obj)


# ------------------------------------------------------------ event-log lines
def _recorded_lines() -> list[str]:
    p = ControlPlane()
    log = MemoryLog(config=p.config)
    p.recorder = log
    p.handle(E.LeaseGranted(request_id="L1", block_ids=[7]), 0.0)
    p.handle(E.NewRequest(request_id="r1", engine_id="e", remote_request_id="x", remote_block_ids=[1, 2],
                          remote_expiry=40.0), 0.0)
    p.handle(E.HandshakeOk(engine_id="e", samples=[(0.2, 0.01)]), 0.5)
    p.handle(E.BlocksAllocated(request_id="r1", block_ids=[3], num_remote_tokens=4), 1.0)
    p.handle(E.StartLoad(request_id="r1"), 1.0)
    p.fire_due(5.0)
    p.handle(E.ReadDone(request_id="r1"), 6.0)
    p.handle(E.RequestFinished(request_id="r1", block_ids=[3], hold_for_next_turn=True), 7.0)
    p.fire_due(40.0)
    return log.lines()


LOG_LINES = _recorded_lines()
LOG_SEEDS = [line.encode() for line in LOG_LINES]


def _read_replay_check(lines) -> None:
    """Reading may refuse with EventLogError; a log that reads must replay
    and be checked without any exception."""
    try:
        log = read_log(lines)
    except EventLogError as exc:
        assert str(exc)
        return
    replay(log)
    check_log(log)
    replay(log, until=1e6)


@FUZZ
@given(st.lists(mutations(LOG_SEEDS), min_size=1, max_size=4), st.integers(0, len(LOG_SEEDS) - 1))
def test_event_log_lines_mutated(bad_lines, where):
    # A few damaged lines dropped among the genuine ones.
    lines = list(LOG_SEEDS)
    lines[where:where] = bad_lines
    _read_replay_check(lines)


# The values that broke decoders before, then any JSON value.
HOSTILE = st.sampled_from([None, math.nan, math.inf, -math.inf, True, False, {}, [], [None], "", "a:b", "x" * 300,
                           2**70, -(2**70), -1, 0, 1e308, 10**400, [1, -1], [math.nan], {"a": []}])
json_values = HOSTILE | st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_IDS = st.sampled_from(["r1", "x", "L1", "e", "", "decode_request", "lease", "push_write", "remote_engine"])


def _field_value(name: str, annotation: str) -> st.SearchStrategy:
    """Mostly well-typed values (they reach the machines), sometimes anything."""
    typed = {
        "str": _IDS, "int": st.integers(-3, 5) | st.integers(-(2**63), 2**64 - 1), "bool": st.booleans(),
        "float": st.floats(-1e3, 1e3) | st.sampled_from([0.0, 1e300, -1e300]),
        "tuple": st.lists(st.integers(0, 8) | _IDS | st.lists(_IDS | st.floats(-5, 5), max_size=3), max_size=4),
        "Any": _IDS | st.integers(0, 3) | st.lists(_IDS, max_size=2),
    }
    options = [o.strip() for o in annotation.split("|")]
    strategies = [typed.get(o, json_values) for o in options if o != "None"]
    if "None" in options:
        strategies.append(st.none())
    return st.one_of(*strategies) if strategies else json_values


@st.composite
def event_lines(draw, t):
    name = draw(st.sampled_from(sorted(ALL_EVENTS)))
    cls = ALL_EVENTS[name]
    from kvplane.statemachines.base import fields

    data = {}
    for a in fields(cls):
        if draw(st.integers(0, 9)) == 0:
            continue  # a field left out
        ann = a.type if isinstance(a.type, str) else getattr(a.type, "__name__", "Any")
        data[a.name] = draw(json_values) if draw(st.integers(0, 19)) == 0 else draw(_field_value(a.name, ann))
    return json.dumps({"v": 1, "t": t, "event": name, "data": data})


@FUZZ
@given(st.lists(st.floats(0, 200), min_size=1, max_size=25).flatmap(
    lambda ts: st.tuples(*[event_lines(t) for t in sorted(ts)])))
def test_event_log_random_stimuli_replay_without_exception(lines):
    """Stimuli-only logs of random (mostly well-typed) events: whatever reads
    is fed to the machines, which must count or refuse, never raise."""
    _read_replay_check(list(lines))


@FUZZ
@given(st.lists(json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64), min_size=1,
                max_size=4))
def test_event_log_random_lines(lines):
    _read_replay_check(lines)


# ------------------------------------------------------------ kv_transfer_params
PARAMS = dict(remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5555, remote_request_id="p-r1",
              remote_block_ids=[3, 4], remote_ranks=[0], expected_consumers=1, remote_expiry=12.0,
              remote_renewable=True)


@settings(FUZZ, max_examples=300)
@given(st.dictionaries(st.sampled_from(sorted(PARAMS) + ["do_remote_prefill", "other"]), json_values, max_size=3),
       st.booleans())
def test_kv_transfer_params_hostile(changes, start_valid):
    d = {**PARAMS, **changes} if start_valid else changes
    try:
        rk = RemoteKV.from_dict(d)
    except BadTransferParams:
        return
    # What is accepted can go on the wire and be gated on.
    assert rk.remote_expiry is None or math.isfinite(rk.remote_expiry)
    assert wire.decode_notif(wire.encode_completion(rk.remote_request_id, rk.expected_consumers))
    assert wire.encode_heartbeats([rk.remote_request_id])


@FUZZ
@given(json_values)
def test_kv_transfer_params_not_even_a_dict(value):
    try:
        RemoteKV.from_dict(value)
    except BadTransferParams:
        pass
