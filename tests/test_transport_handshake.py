"""Handshake side channel over real ZMQ sockets on 127.0.0.1."""

import time

import msgpack
import pytest
import zmq

from transport.handshake import (
    HANDSHAKE_VERSION,
    ClockSample,
    CompatHashMismatch,
    EngineIdMismatch,
    HandshakeProtocolError,
    HandshakeRefused,
    HandshakeServer,
    HandshakeTimeout,
    HandshakeVersionMismatch,
    best_offset,
    build_payload,
    clock_sample,
    handshake,
)
from transport.wire import frame_metadata

META = b"\x01nixl-metadata\x00" * 10


def payload(**over):
    p = build_payload(engine_id="P0", compat_hash="abc", tp_rank=0, metadata=META, cache={"v": 1})
    p.update(over)
    return p


@pytest.fixture
def server_factory():
    servers = []

    def make(payload_fn=lambda pp, tp: payload(tp_rank=tp) if tp < 2 else None, **kw):
        s = HandshakeServer("tcp://127.0.0.1:0", payload_fn, **kw)
        s.serve_in_thread(poll_ms=10)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def test_successful_handshake_returns_verified_metadata(server_factory):
    s = server_factory()
    assert s.url.startswith("tcp://127.0.0.1:") and not s.url.endswith(":0")
    r = handshake(s.url, "P0", "abc", timeout_s=2.0, tp_rank=1)
    assert r.metadata == META  # unframed, crc checked
    assert r.payload["tp_rank"] == 1 and r.engine_id == "P0" and r.cache == {"v": 1}
    assert r.t_send <= r.t_recv
    # Same host, same perf_counter clock: the offset is within the RTT.
    assert abs(r.sample.offset) <= r.sample.rtt
    assert s.requests_served == 1


def test_multiple_samples_pick_min_rtt(server_factory):
    s = server_factory()
    r = handshake(s.url, "P0", "abc", timeout_s=2.0, samples=5)
    assert len(r.samples) == 5 and s.requests_served == 5
    assert r.clock.rtt == min(x.rtt for x in r.samples)


def test_clock_math():
    s = clock_sample(t_send=10.0, t_recv=10.2, remote_clock=110.1)
    assert s.offset == pytest.approx(100.0) and s.rtt == pytest.approx(0.2)
    samples = [ClockSample(5.0, 0.3), ClockSample(4.0, 0.01), ClockSample(3.0, 0.02)]
    assert best_offset(samples) == ClockSample(4.0, 0.01)
    with pytest.raises(ValueError):
        best_offset([])


@pytest.mark.parametrize(
    "over, exc, names",
    [
        ({"version": HANDSHAKE_VERSION + 1}, HandshakeVersionMismatch, [str(HANDSHAKE_VERSION), str(HANDSHAKE_VERSION + 1)]),
        ({"compat_hash": "zzz"}, CompatHashMismatch, ["'abc'", "'zzz'"]),
        ({"engine_id": "P9"}, EngineIdMismatch, ["'P0'", "'P9'"]),
    ],
)
def test_mismatches_name_both_values(server_factory, over, exc, names):
    s = server_factory(lambda pp, tp: payload(**over))
    with pytest.raises(exc) as ei:
        handshake(s.url, "P0", "abc", timeout_s=2.0)
    for n in names:
        assert n in str(ei.value)


def test_corrupt_metadata_in_payload_is_rejected(server_factory):
    framed = bytearray(frame_metadata(META))
    framed[-1] ^= 1
    s = server_factory(lambda pp, tp: payload(metadata=bytes(framed)))
    with pytest.raises(HandshakeProtocolError, match="checksum"):
        handshake(s.url, "P0", "abc", timeout_s=2.0)


def test_unknown_rank_is_refused(server_factory):
    s = server_factory()
    with pytest.raises(HandshakeRefused, match="tp_rank=5"):
        handshake(s.url, "P0", "abc", timeout_s=2.0, tp_rank=5)


def test_garbage_request_gets_error_reply_and_server_survives(server_factory):
    s = server_factory()
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, 2000)
    try:
        req.connect(s.url)
        req.send(b"\xc1not msgpack")
        body, stamp = req.recv_multipart()
        assert "bad request" in msgpack.unpackb(body)["error"]
        assert isinstance(msgpack.unpackb(stamp), float)
    finally:
        req.close()
    assert s.bad_requests == 1
    assert handshake(s.url, "P0", "abc", timeout_s=2.0).metadata == META


def test_silent_peer_times_out_without_blocking_others(server_factory):
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts the connection, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    silent_url = silent.getsockopt(zmq.LAST_ENDPOINT).decode()
    good = server_factory()
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout, match=silent_url):
            handshake(silent_url, "P0", "abc", timeout_s=0.3)
        assert 0.25 <= time.monotonic() - t0 < 1.5
        # The abandoned request must not delay a handshake with another peer.
        t0 = time.monotonic()
        r = handshake(good.url, "P0", "abc", timeout_s=2.0)
        assert r.metadata == META and time.monotonic() - t0 < 0.5
    finally:
        silent.close()


def test_nobody_listening_times_out():
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.ROUTER)
    s.bind("tcp://127.0.0.1:0")
    url = s.getsockopt(zmq.LAST_ENDPOINT).decode()
    s.close(linger=0)  # the port is now closed
    with pytest.raises(HandshakeTimeout):
        handshake(url, "P0", "abc", timeout_s=0.2)


def test_poll_once_without_thread():
    s = HandshakeServer("tcp://127.0.0.1:0", lambda pp, tp: payload())
    try:
        assert s.poll_once(0) == 0
        ctx = zmq.Context.instance()
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(s.url)
        req.send(msgpack.packb((b"get_meta_msg", 0, 0)))
        assert s.poll_once(2000) == 1
        assert req.poll(2000)
        body, _ = req.recv_multipart()
        assert msgpack.unpackb(body)["engine_id"] == "P0"
        req.close()
    finally:
        s.close()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_curve_auth(server_factory):
    server_keys = zmq.curve_keypair()
    s = server_factory(curve_keypair=server_keys)
    r = handshake(s.url, "P0", "abc", timeout_s=2.0, server_public_key=server_keys[0])
    assert r.metadata == META
    # Wrong server key: the CURVE handshake fails, no metadata ever flows.
    wrong_pub, _ = zmq.curve_keypair()
    with pytest.raises(HandshakeTimeout):
        handshake(s.url, "P0", "abc", timeout_s=0.3, server_public_key=wrong_pub)
    # No CURVE at all: a plaintext client cannot talk to a CURVE server.
    with pytest.raises(HandshakeTimeout):
        handshake(s.url, "P0", "abc", timeout_s=0.3)
    assert s.requests_served == 1
