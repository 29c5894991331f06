import string
import zlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.wire import (
    HEADER_SIZE,
    CompletionNotif,
    CorruptMetadata,
    HeartbeatNotif,
    MalformedNotification,
    PushRegNotif,
    TruncatedMetadata,
    WireError,
    decode_notif,
    encode_completion,
    encode_heartbeat,
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


def test_push_reg_format_is_exact():
    reg = {"req": "r1", "blocks": [1, 2]}
    data = encode_push_reg(reg)
    assert data.startswith(b"PUSH_REG:")
    assert msgpack.unpackb(data[len(b"PUSH_REG:"):]) == reg
    assert decode_notif(data) == PushRegNotif(reg)


@given(ids, st.integers(min_value=1, max_value=2**40))
def test_completion_roundtrip(rid, n):
    assert decode_notif(encode_completion(rid, n)) == CompletionNotif(rid, n)


@given(st.lists(ids, min_size=1, max_size=20))
def test_heartbeat_roundtrip(rids):
    assert decode_notif(encode_heartbeat(rids)) == HeartbeatNotif(tuple(rids))


int64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)


@given(st.dictionaries(st.text(max_size=10), int64 | st.binary(max_size=10) | st.text(max_size=10), max_size=8))
def test_push_reg_roundtrip(reg):
    assert decode_notif(encode_push_reg(reg)) == PushRegNotif(reg)


@given(ids, st.integers(min_value=1, max_value=99))
def test_encode_notif_dispatch(rid, n):
    for notif in (CompletionNotif(rid, n), HeartbeatNotif((rid,)), PushRegNotif({"id": rid})):
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
    with pytest.raises(ValueError, match="msgpack"):
        encode_push_reg({"n": 2**70})


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
        (b"req:0", ">= 1"),
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
