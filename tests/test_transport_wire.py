import zlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.transport.wire import (
    HEADER_SIZE,
    CompletionNotif,
    CorruptMetadata,
    HeartbeatNotif,
    MAX_BLOCK_ID,
    MAX_BLOCK_IDS,
    MAX_EXPECTED_CONSUMERS,
    MAX_HEARTBEAT_IDS,
    MAX_ID_BYTES,
    MAX_NOTIF_BYTES,
    PUSH_REG_PREFIX,
    MalformedNotification,
    PushRegistration,
    PushRegNotif,
    TruncatedMetadata,
    WireError,
    decode_notif,
    encode_completion,
    encode_heartbeat,
    encode_heartbeats,
    encode_notif,
    encode_push_reg,
    frame_metadata,
    unframe_metadata,
)

# Any printable text (incl. non-ASCII) without the reserved separators.
ids = st.text(
    alphabet=st.characters(blacklist_characters=":,", blacklist_categories=("Cs",)),
    min_size=1, max_size=40,
).filter(lambda s: s not in ("HB", "PUSH_REG"))


def test_completion_format_is_exact():
    assert encode_completion("cmpl-1", 2) == b"cmpl-1:2"
    assert decode_notif(b"cmpl-1:2") == CompletionNotif("cmpl-1", 2)


def test_heartbeat_format_is_exact():
    assert encode_heartbeat(["a", "b-2"]) == b"HB:a,b-2"
    assert decode_notif(b"HB:a,b-2") == HeartbeatNotif(("a", "b-2"))


REG = dict(request_id="r1", engine_id="decode-0", decode_request_id="d1", block_ids=[1, 2],
           host="127.0.0.1", port=5555)


def test_push_reg_format_is_exact():
    reg = PushRegistration(**REG, deadline=12.5)
    data = encode_push_reg(reg)
    assert data.startswith(b"PUSH_REG:")
    # The map of its fields, as the driver used to send it by hand.
    assert msgpack.unpackb(data[len(b"PUSH_REG:"):]) == {**REG, "deadline": 12.5}
    assert decode_notif(data) == PushRegNotif(reg)
    # An older decoder sends no deadline; its registration is still valid.
    old = PUSH_REG_PREFIX + msgpack.packb(REG)
    assert decode_notif(old).registration == PushRegistration(**REG) and PushRegistration(**REG).deadline is None
    assert "deadline" not in msgpack.unpackb(encode_push_reg(PushRegistration(**REG))[9:])


@given(ids, st.integers(min_value=1, max_value=MAX_EXPECTED_CONSUMERS))
def test_completion_roundtrip(rid, n):
    assert decode_notif(encode_completion(rid, n)) == CompletionNotif(rid, n)


@given(st.lists(ids, min_size=1, max_size=20))
def test_heartbeat_roundtrip(rids):
    assert decode_notif(encode_heartbeat(rids)) == HeartbeatNotif(tuple(rids))


registrations = st.builds(
    PushRegistration, request_id=ids, engine_id=ids.filter(str.isprintable), decode_request_id=ids,
    block_ids=st.lists(st.integers(min_value=0, max_value=MAX_BLOCK_ID), max_size=20),
    host=st.sampled_from(["127.0.0.1", "::1", "[::1]", "decode-0.cluster.local", "localhost"]),
    port=st.integers(min_value=1, max_value=65535),
    deadline=st.none() | st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**40), 2**40),
)


@given(registrations)
def test_push_reg_roundtrip(reg):
    assert decode_notif(encode_push_reg(reg)) == PushRegNotif(reg)


@given(ids, st.integers(min_value=1, max_value=99))
def test_encode_notif_dispatch(rid, n):
    for notif in (CompletionNotif(rid, n), HeartbeatNotif((rid,)), PushRegNotif(PushRegistration(**{**REG, "request_id": rid}))):
        assert decode_notif(encode_notif(notif)) == notif


def test_decoder_splits_on_last_colon():
    # A peer that does not validate ids can still send "a:b:3"; the count is the last field.
    assert decode_notif(b"a:b:3") == CompletionNotif("a:b", 3)


@pytest.mark.parametrize("bad", ["a:b", "a,b", ":", ",", "", "HB", "PUSH_REG"])
def test_encode_rejects_reserved_ids(bad):
    with pytest.raises(ValueError) as ei:
        encode_completion(bad, 1)
    assert repr(bad) in str(ei.value) or "empty" in str(ei.value)
    with pytest.raises(ValueError):
        encode_heartbeat(["ok", bad])


def test_encode_rejects_bad_args():
    with pytest.raises(ValueError):
        encode_completion("r", 0)
    with pytest.raises(TypeError):
        encode_completion("r", True)
    with pytest.raises(ValueError):
        encode_heartbeat([])
    with pytest.raises(TypeError):
        encode_heartbeat("abc")  # a lone string is a classic bug
    with pytest.raises(TypeError):
        encode_push_reg([1, 2])
    with pytest.raises(TypeError):
        encode_push_reg(dict(REG))  # only a validated registration goes out
    with pytest.raises(ValueError, match="block id"):
        PushRegistration(**{**REG, "block_ids": [2**70]})
    with pytest.raises(ValueError, match="1..1024"):
        encode_completion("r", MAX_EXPECTED_CONSUMERS + 1)
    with pytest.raises(ValueError, match="longer than 256 bytes"):
        encode_completion("é" * 129, 1)  # 258 bytes of UTF-8


@pytest.mark.parametrize(
    "data, why",
    [
        (b"", "empty"),
        (b"no-colon", "no ':'"),
        (b"req:", "bad consumer count"),
        (b"req:x", "bad consumer count"),
        (b"req: 3", "bad consumer count"),
        (b"req:+3", "bad consumer count"),
        (b"req:-1", "bad consumer count"),
        (b"req:0", "in 1..1024"),
        (b"req:1025", "in 1..1024"),
        (b"req:00001", "bad consumer count"),  # more digits than any valid count has
        (b"x:" + b"9" * 5000, "bad consumer count"),  # the crash: int() refuses 5000 digits
        (b"x" * (MAX_ID_BYTES + 1) + b":1", "longer than 256 bytes"),
        (b"HB:" + b",".join([b"a"] * (MAX_HEARTBEAT_IDS + 1)), "more than 4096"),
        (b"HB:ok," + b"y" * (MAX_ID_BYTES + 1), "longer than 256 bytes"),
        (b"HB:a,HB", "reserved"),
        (b"HB:" + b"a" * MAX_NOTIF_BYTES, "more than 1048576"),
        (b"req:\xd9", "not UTF-8"),  # truncated 2-byte sequence
        ("req:٣".encode(), "bad consumer count"),  # a Unicode digit int() would accept
        (b":3", "empty request id"),
        (b"a,b:3", "contains ','"),
        (b"\xff\xfe:1", "not UTF-8"),
        (b"HB:", "empty or invalid id"),
        (b"HB:a,,b", "empty or invalid id"),
        (b"HB:a:b", "empty or invalid id"),
        (b"PUSH_REG:", "not valid msgpack"),
        (b"PUSH_REG:\xc1", "not valid msgpack"),
        (b"PUSH_REG:" + msgpack.packb([1, 2]), "must be a msgpack map"),
        (b"PUSH_REG:" + msgpack.packb({"a": 1}) + b"junk", "not valid msgpack"),
    ],
)
def test_malformed_notifications(data, why):
    with pytest.raises(MalformedNotification) as ei:
        decode_notif(data)
    assert why in str(ei.value)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, WireError)


def test_decode_rejects_non_bytes():
    with pytest.raises(MalformedNotification):
        decode_notif("req:1")


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_decoder_total_on_garbage(data):
    # Any bytes either decode or raise MalformedNotification, nothing else.
    try:
        decode_notif(data)
    except MalformedNotification:
        pass


# ---------------------------------------------------------------- framing


@given(st.binary(max_size=2048))
def test_frame_roundtrip(payload):
    framed = frame_metadata(payload)
    assert len(framed) == HEADER_SIZE + len(payload)
    assert unframe_metadata(framed) == payload


@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_truncation_is_rejected(payload, data):
    framed = frame_metadata(payload)
    cut = data.draw(st.integers(min_value=0, max_value=len(framed) - 1))
    with pytest.raises(TruncatedMetadata):
        unframe_metadata(framed[:cut])


@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_bit_flip_is_rejected(payload, data):
    framed = bytearray(frame_metadata(payload))
    pos = data.draw(st.integers(min_value=0, max_value=len(framed) - 1))
    bit = data.draw(st.integers(min_value=0, max_value=7))
    framed[pos] ^= 1 << bit
    # A flipped length bit may make the frame look truncated; either is a WireError.
    with pytest.raises(WireError):
        unframe_metadata(bytes(framed))


def test_corruption_messages():
    framed = frame_metadata(b"hello")
    with pytest.raises(CorruptMetadata, match="magic"):
        unframe_metadata(b"XXXX" + framed[4:])
    with pytest.raises(CorruptMetadata, match="version"):
        unframe_metadata(framed[:4] + b"\x00\x09" + framed[6:])
    with pytest.raises(CorruptMetadata, match="reserved"):
        unframe_metadata(framed[:6] + b"\x00\x01" + framed[8:])
    with pytest.raises(CorruptMetadata, match="trailing"):
        unframe_metadata(framed + b"!")
    with pytest.raises(CorruptMetadata, match="checksum"):
        unframe_metadata(framed[:-1] + b"O")
    with pytest.raises(TruncatedMetadata, match="header"):
        unframe_metadata(framed[:3])
    assert zlib.crc32(b"hello").to_bytes(4, "big") == framed[HEADER_SIZE - 4:HEADER_SIZE]


# ---------------------------------------------------------------- bounds


def test_heartbeat_bound_on_ids_is_exact_and_the_splitting_encoder_respects_it():
    full = [f"r{i}" for i in range(MAX_HEARTBEAT_IDS)]
    assert decode_notif(encode_heartbeat(full)).request_ids == tuple(full)
    with pytest.raises(ValueError, match="more than 4096"):
        encode_heartbeat(full + ["one-more"])
    many = [f"r{i}" for i in range(2 * MAX_HEARTBEAT_IDS + 5)]
    msgs = encode_heartbeats(many)
    assert len(msgs) == 3
    got = [rid for m in msgs for rid in decode_notif(m).request_ids]
    assert got == many  # every id once, in order
    assert encode_heartbeats(["a", "b"]) == [encode_heartbeat(["a", "b"])]
    with pytest.raises(ValueError):
        encode_heartbeats([])


def test_splitting_encoder_respects_the_size_bound_with_long_ids():
    long_ids = [f"{i:05d}" + "x" * (MAX_ID_BYTES - 5) for i in range(MAX_HEARTBEAT_IDS)]
    with pytest.raises(ValueError, match="bytes"):
        encode_heartbeat(long_ids)  # 4096 ids of 256 bytes exceed 1 MiB by a few bytes
    msgs = encode_heartbeats(long_ids)
    assert len(msgs) == 2 and all(len(m) <= MAX_NOTIF_BYTES for m in msgs)
    assert [r for m in msgs for r in decode_notif(m).request_ids] == long_ids


def _raw_reg(**changes) -> bytes:
    body = {**REG, **changes}
    for k in [k for k, v in changes.items() if v is _DROP]:
        del body[k]
    return PUSH_REG_PREFIX + msgpack.packb(body, use_bin_type=True)


_DROP = object()


@pytest.mark.parametrize("changes, why", [
    ({"request_id": _DROP}, "lacks field(s) ['request_id']"),
    ({"port": _DROP, "host": _DROP}, "lacks field(s) ['host', 'port']"),
    ({"request_id": 7}, "request id must be str"),
    ({"request_id": b"r1"}, "request id must be str"),
    ({"request_id": "a:b"}, "reserved character"),
    ({"decode_request_id": "x" * (MAX_ID_BYTES + 1)}, "longer than 256 bytes"),
    ({"decode_request_id": ""}, "must not be empty"),
    ({"engine_id": None}, "engine_id must be str"),
    ({"engine_id": "decode-0\nINFO forged"}, "non-printable"),
    ({"block_ids": "1,2"}, "block ids must be a list"),
    ({"block_ids": [1, -1]}, "block id -1"),
    ({"block_ids": [MAX_BLOCK_ID + 1]}, "block id"),
    ({"block_ids": [True]}, "block id True"),
    ({"block_ids": [1.0]}, "block id 1.0"),
    ({"block_ids": list(range(MAX_BLOCK_IDS + 1))}, "more than 131072"),
    ({"host": ""}, "host must be 1 to"),
    ({"host": "a b"}, "not a hostname"),
    ({"host": "evil.example/../x"}, "not a hostname"),
    ({"host": "h" * 300}, "host must be 1 to"),
    ({"host": "-x.example"}, "not a hostname"),
    ({"host": 127}, "host must be str"),
    ({"port": 0}, "port must be an int in 1..65535"),
    ({"port": 65536}, "port must be an int in 1..65535"),
    ({"port": "5555"}, "port must be an int"),
    ({"port": True}, "port must be an int"),
    ({"deadline": float("nan")}, "finite number"),
    ({"deadline": float("inf")}, "finite number"),
    ({"deadline": float("-inf")}, "finite number"),
    ({"deadline": "soon"}, "finite number"),
    ({"deadline": True}, "finite number"),
    ({"deadline": [1.0]}, "finite number"),
])
def test_push_reg_fields_are_validated(changes, why):
    with pytest.raises(MalformedNotification) as ei:
        decode_notif(_raw_reg(**changes))
    assert why in str(ei.value)


@pytest.mark.parametrize("body", [
    b"\x81\x01\x02",  # a map with an int key
    msgpack.packb({"request_id": "\udcff"}, unicode_errors="surrogateescape"),  # not UTF-8
    b"\x91" * 5000 + b"\x90",  # arrays nested 5000 deep
    b"\xdd\xff\xff\xff\xff",  # an array claiming 4 billion items
    b"\xc7\x01\xff\x00",  # a timestamp ext with a bad length
])
def test_push_reg_bodies_msgpack_refuses_are_malformed(body):
    with pytest.raises(MalformedNotification):
        decode_notif(PUSH_REG_PREFIX + body)


def test_push_reg_validated_record():
    reg = decode_notif(_raw_reg(deadline=7, extra_from_a_newer_decoder=[1])).registration
    assert reg.deadline == 7.0 and isinstance(reg.deadline, float)  # unknown keys ignored
    assert reg.block_ids == (1, 2) and reg.side_channel == "tcp://127.0.0.1:5555"
    assert PushRegistration(**{**REG, "host": "::1"}).side_channel == "tcp://[::1]:5555"
    assert PushRegistration(**{**REG, "host": "[::1]"}).side_channel == "tcp://[::1]:5555"


# ------------------------------------------------------ through the driver (loopback)


def _driver(fabric, name):
    from kvplane.connector.driver import PlaneDriver
    from kvplane.transport.loopback import LoopbackEndpoint

    return PlaneDriver(engine_id=name, endpoint=LoopbackEndpoint(fabric, name), clock=lambda: 100.0)


def test_huge_and_oversized_notifications_are_counted_and_the_plane_keeps_its_lease():
    """The issue's crash: one ``x:<5000 digits>`` killed P; now it is a counted
    malformed notification and a live lease is untouched."""
    from kvplane.statemachines import events as E
    from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

    fabric = LoopbackFabric()
    p = _driver(fabric, "P")
    try:
        peer = LoopbackEndpoint(fabric, "X")
        peer.add_remote(p.endpoint.local_metadata())
        # A peer P trusts (allow-listed), so its bytes reach the decoder.
        import zmq
        p.trust_peer("X", zmq.curve_keypair()[0])
        p.feed(E.LeaseGranted(request_id="L", block_ids=[1, 2]))
        for msg in (b"x:" + b"9" * 5000, b"L:" + b"9" * 5000, b"HB:" + b",".join([b"L"] * 5000),
                    b"HB:" + b"L" * (MAX_NOTIF_BYTES + 1), _raw_reg(deadline=float("nan"))):
            peer.send_notif("P", msg)
        p.step()
        assert p.counters["notifs_malformed"] == 5 and p.counters["notifs_received"] == 0
        assert p.plane.get("lease", "L").state == "LEASED" and p.freed == []
    finally:
        p.close()


def test_a_heartbeat_batch_over_the_bound_goes_out_as_several_messages():
    from kvplane.statemachines import actions as A
    from kvplane.statemachines import events as E
    from kvplane.transport.loopback import LoopbackFabric

    fabric = LoopbackFabric()
    p, d = _driver(fabric, "P"), _driver(fabric, "D")
    try:
        ids = [f"p-{i}" for i in range(MAX_HEARTBEAT_IDS + 10)]
        for rid in ids:
            p.feed(E.LeaseGranted(request_id=rid, block_ids=[1]))
        before = p.plane.get("lease", ids[-1]).deadline
        names = [p.export_lease(rid) for rid in ids]  # what D was handed in kv_transfer_params
        p.trust_peer("D", d.public_key)
        d.agents["P"] = d.endpoint.add_remote(p.endpoint.local_metadata())
        d._execute([A.SendHeartbeat("P", (0,), tuple(names))])
        assert d.counters["heartbeats_sent"] == 2
        p.clock = lambda: 115.0  # late enough for a heartbeat to extend a 30 s lease
        p.step()
        assert p.counters["heartbeats_received"] == 2 and p.counters["notifs_malformed"] == 0
        assert all(p.plane.get("lease", rid).deadline > before for rid in (ids[0], ids[-1]))
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("data, err, why", [
    ("KVPM", CorruptMetadata, "must be bytes"),
    (5, CorruptMetadata, "must be bytes"),  # bytes(5) would be five zero bytes
    (None, CorruptMetadata, "must be bytes"),
    (frame_metadata(b"x")[:8] + (2**63).to_bytes(8, "big") + frame_metadata(b"x")[16:], CorruptMetadata, "claims"),
])
def test_unframe_refuses_non_bytes_and_oversized_claims(data, err, why):
    with pytest.raises(err, match=why):
        unframe_metadata(data)


@pytest.mark.nixl
def test_huge_notifications_over_real_nixl_leave_the_plane_running_and_holding_only_its_lease():
    """The issue's crash end to end on real NIXL (UCX, DRAM): a stranger
    agent sends the notifications that crashed P; P counts them and steps on."""
    import time

    import torch

    from kvplane.connector.driver import PlaneDriver
    from kvplane.statemachines import events as E
    from kvplane.transport.nixl_agent import NixlEndpoint

    p_ep, x = NixlEndpoint("P-huge"), NixlEndpoint("X-huge")
    p = PlaneDriver(engine_id="P", endpoint=p_ep)
    try:
        for ep in (p_ep, x):
            ep.register_kv_cache(torch.zeros(4, 4096, dtype=torch.uint8), 4096)
        x.add_remote(p_ep.local_metadata())
        # Allow-listed, so its bytes reach the decoders (a stranger's are dropped before).
        import zmq
        p.trust_peer("X-huge", zmq.curve_keypair()[0])
        p.feed(E.LeaseGranted(request_id="L", block_ids=[1, 2]))
        hostile = [b"x:" + b"9" * 5000, b"L:" + b"9" * 5000, b"HB:" + b",".join([b"L"] * 5000),
                   _raw_reg(deadline=float("nan")), b"HB:" + b"L" * (MAX_NOTIF_BYTES + 1)]
        for msg in hostile:
            x.send_notif(p_ep.name, msg)
        end = time.monotonic() + 30  # generous: UCX wires the connection lazily; a busy machine is slow
        while p.counters["notifs_malformed"] < len(hostile) and time.monotonic() < end:
            x.poll_notifs()  # without a progress thread the sender must progress too
            p.step()
            time.sleep(0.001)
        assert p.counters["notifs_malformed"] == len(hostile) and p.counters["notifs_received"] == 0
        assert p.plane.get("lease", "L").state == "LEASED" and p.freed == []
        p.feed(E.LeaseAbort(request_id="L"))
        assert p.plane.held() == []
    finally:
        p.close()
        p_ep.close()
        x.close()
