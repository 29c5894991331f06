"""Fuzz the side channel's parsers: random and mutated bytes for the
server's request parser and the client's reply parser, random values for
the clock math.  Only the project's typed HandshakeError subclasses may
escape, and whatever is accepted is well formed (ranks in range, clock and
offsets finite)."""
from __future__ import annotations

import math

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplane.transport.handshake import (
    GET_META_MSG,
    MAX_RANK,
    ClockSample,
    HandshakeError,
    best_offset,
    build_payload,
    clock_sample,
    parse_reply,
    parse_request,
)
from kvplane.transport.layout import CacheLayout

URL = "tcp://fuzz:1"
CACHE = CacheLayout("DRAM", 0, 4096, 16, (1 << 20, 2 << 20)).to_dict()
GOOD_REQUEST = msgpack.packb((GET_META_MSG, 0, 0), use_bin_type=True)
GOOD_PAYLOAD = msgpack.packb(build_payload(engine_id="P0", compat_hash="abc", tp_rank=0,
                                           metadata=b"\x01meta" * 20, cache=CACHE), use_bin_type=True)
GOOD_CLOCK = msgpack.packb(123.456)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any msgpack-able value, floats NaN and inf included, nested a few levels.
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


@st.composite
def mutated(draw, seed: bytes) -> bytes:
    """``seed`` with a few bytes flipped, cut, inserted or deleted."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[i]
    return bytes(data)


def _request(body: bytes) -> None:
    try:
        pp, tp = parse_request(body)
    except HandshakeError:
        return
    assert all(type(r) is int and 0 <= r < MAX_RANK for r in (pp, tp))


def _reply(frames) -> None:
    try:
        payload, metadata, clock = parse_reply(URL, frames, "P0", "abc", 0)
    except HandshakeError:
        return
    assert isinstance(payload, dict) and isinstance(metadata, bytes) and math.isfinite(clock)


@FUZZ
@given(st.binary(max_size=200))
def test_request_parser_random_bytes(body):
    _request(body)


@FUZZ
@given(mutated(GOOD_REQUEST))
def test_request_parser_mutated(body):
    _request(body)


@FUZZ
@given(values)
def test_request_parser_any_msgpack_value(value):
    _request(msgpack.packb(value, use_bin_type=True))


@FUZZ
@given(st.lists(st.binary(max_size=120), max_size=4))
def test_reply_parser_random_frames(frames):
    _reply(frames)


@FUZZ
@given(mutated(GOOD_PAYLOAD), mutated(GOOD_CLOCK))
def test_reply_parser_mutated(payload, clock):
    _reply([payload, clock])


@FUZZ
@given(st.sampled_from(["version", "compat_hash", "engine_id", "tp_rank", "metadata", "cache", "error", "extra"]),
       values, values)
def test_reply_parser_any_field_value(field, value, clock):
    payload = msgpack.unpackb(GOOD_PAYLOAD, raw=False)
    payload[field] = value
    _reply([msgpack.packb(payload, use_bin_type=True), msgpack.packb(clock, use_bin_type=True)])


@FUZZ
@given(st.floats(), st.floats(), st.floats())
def test_a_clock_sample_is_finite_or_refused(t_send, t_recv, remote):
    try:
        s = clock_sample(t_send, t_recv, remote)
    except HandshakeError:
        return
    assert math.isfinite(s.offset) and math.isfinite(s.rtt) and s.rtt >= 0


@FUZZ
@given(st.lists(st.builds(ClockSample, st.floats(), st.floats()), max_size=6))
def test_best_offset_is_finite_or_refused(samples):
    try:
        best = best_offset(samples)
    except HandshakeError:
        return
    assert math.isfinite(best.offset) and math.isfinite(best.rtt)
