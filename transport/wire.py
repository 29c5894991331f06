"""Wire codecs: NIXL notification strings and framed agent metadata.

Formats (see shared/design/ARCHITECTURE.md, they match vLLM's where one exists):

* completion notif  ``"<peer_request_id>:<expected_consumers>"``
* heartbeat         ``"HB:<id>,<id>,..."``
* push registration ``b"PUSH_REG:" + msgpack(dict)``; the dict carries
  ``request_id`` (P's), ``engine_id``, ``decode_request_id``, ``block_ids``,
  ``host``, ``port`` and optionally ``deadline``: when the decoder gives up
  waiting, in its own clock (a float; absent from older decoders)

Metadata framing exists because NIXL's ``add_remote_agent`` remembers a peer
name even from a truncated blob, poisoning that name; we verify length and
CRC before NIXL ever sees the bytes.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Sequence

import attrs
import msgpack

HB_PREFIX = b"HB:"
PUSH_REG_PREFIX = b"PUSH_REG:"


class WireError(ValueError):
    """Base class for undecodable bytes received from a peer."""


class MalformedNotification(WireError):
    """A notification matches none of the known formats."""


class TruncatedMetadata(WireError):
    """A framed metadata blob is shorter than its header claims."""


class CorruptMetadata(WireError):
    """A framed metadata blob has a bad magic, version, length or checksum."""


# ---------------------------------------------------------------- notifications


@attrs.frozen
class CompletionNotif:
    """Sent with a READ (or after a WRITE): one consumer is done with the blocks."""

    request_id: str
    expected_consumers: int


@attrs.frozen
class HeartbeatNotif:
    """Keeps the prefill-side leases of ``request_ids`` alive."""

    request_ids: tuple[str, ...] = attrs.field(converter=tuple)


@attrs.frozen
class PushRegNotif:
    """Decode side registers its blocks so prefill can WRITE (push mode)."""

    registration: dict[str, Any]


Notification = CompletionNotif | HeartbeatNotif | PushRegNotif

_RESERVED_IDS = frozenset({"HB", "PUSH_REG"})


def _check_id(request_id: str) -> None:
    if not isinstance(request_id, str):
        raise TypeError(f"request id must be str, got {type(request_id).__name__}")
    if not request_id:
        raise ValueError("request id must not be empty")
    # ',' separates heartbeat ids; ':' separates the consumer count.  Decoding
    # splits on the last ':' anyway, but rejecting both keeps ids unambiguous
    # in every format.
    bad = [c for c in (":", ",") if c in request_id]
    if bad:
        raise ValueError(f"request id {request_id!r} contains reserved character(s) {bad}")
    # "HB:3" would decode as a heartbeat, "PUSH_REG:3" as a registration.
    if request_id in _RESERVED_IDS:
        raise ValueError(f"request id {request_id!r} is reserved (it is a notification prefix)")


def encode_completion(request_id: str, expected_consumers: int) -> bytes:
    _check_id(request_id)
    if isinstance(expected_consumers, bool) or not isinstance(expected_consumers, int):
        raise TypeError("expected_consumers must be int")
    if expected_consumers < 1:
        raise ValueError(f"expected_consumers must be >= 1, got {expected_consumers}")
    return f"{request_id}:{expected_consumers}".encode()


def encode_heartbeat(request_ids: Sequence[str]) -> bytes:
    if isinstance(request_ids, (str, bytes)):
        raise TypeError("request_ids must be a sequence of ids, not a single string")
    ids = list(request_ids)
    if not ids:
        raise ValueError("a heartbeat needs at least one request id")
    for rid in ids:
        _check_id(rid)
    return HB_PREFIX + ",".join(ids).encode()


def encode_push_reg(registration: dict[str, Any]) -> bytes:
    if not isinstance(registration, dict):
        raise TypeError("push registration must be a dict")
    try:
        body = msgpack.packb(registration, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"push registration is not msgpack-serializable: {e}") from e
    return PUSH_REG_PREFIX + body


def decode_notif(data: bytes) -> Notification:
    """Decode one notification; raise :class:`MalformedNotification` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedNotification(f"notification must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise MalformedNotification("empty notification")

    if data.startswith(PUSH_REG_PREFIX):
        body = data[len(PUSH_REG_PREFIX):]
        try:
            reg = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types
            raise MalformedNotification(f"PUSH_REG body is not valid msgpack: {e}") from e
        if not isinstance(reg, dict):
            raise MalformedNotification(
                f"PUSH_REG body must be a msgpack map, got {type(reg).__name__}"
            )
        return PushRegNotif(reg)

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedNotification(f"notification is not UTF-8: {data[:40]!r}") from e

    if text.startswith("HB:"):
        ids = text[3:].split(",")
        if any(not i or ":" in i for i in ids):
            raise MalformedNotification(f"heartbeat has an empty or invalid id: {text[:80]!r}")
        return HeartbeatNotif(ids)

    rid, sep, count = text.rpartition(":")
    if not sep:
        raise MalformedNotification(f"unknown notification (no ':'): {text[:80]!r}")
    if not rid:
        raise MalformedNotification(f"completion notif has an empty request id: {text[:80]!r}")
    if "," in rid:
        raise MalformedNotification(f"completion notif request id contains ',': {text[:80]!r}")
    # int() alone would accept " 3", "+3" and "3_0"; only plain digits are on the wire.
    if not (count.isascii() and count.isdigit()):
        raise MalformedNotification(f"bad consumer count {count!r} in {text[:80]!r}")
    n = int(count)
    if n < 1:
        raise MalformedNotification(f"consumer count must be >= 1 in {text[:80]!r}")
    return CompletionNotif(rid, n)


def encode_notif(notif: Notification) -> bytes:
    if isinstance(notif, CompletionNotif):
        return encode_completion(notif.request_id, notif.expected_consumers)
    if isinstance(notif, HeartbeatNotif):
        return encode_heartbeat(notif.request_ids)
    if isinstance(notif, PushRegNotif):
        return encode_push_reg(notif.registration)
    raise TypeError(f"not a notification: {notif!r}")


# ---------------------------------------------------------------- metadata framing

METADATA_MAGIC = b"KVPM"
METADATA_VERSION = 1
# magic(4) | version(u16) | reserved(u16) | length(u64) | crc32(u32), big endian
_HEADER = struct.Struct(">4sHHQI")
HEADER_SIZE = _HEADER.size


def frame_metadata(payload: bytes) -> bytes:
    payload = bytes(payload)
    header = _HEADER.pack(METADATA_MAGIC, METADATA_VERSION, 0, len(payload), zlib.crc32(payload))
    return header + payload


def unframe_metadata(data: bytes) -> bytes:
    """Return the payload of a framed blob, or raise a :class:`WireError`."""
    data = bytes(data)
    if len(data) < HEADER_SIZE:
        raise TruncatedMetadata(
            f"metadata frame is {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, reserved, length, crc = _HEADER.unpack_from(data)
    if magic != METADATA_MAGIC:
        raise CorruptMetadata(f"bad metadata magic {magic!r}, expected {METADATA_MAGIC!r}")
    if version != METADATA_VERSION:
        raise CorruptMetadata(
            f"unsupported metadata frame version {version}, expected {METADATA_VERSION}"
        )
    if reserved != 0:
        raise CorruptMetadata(f"metadata frame reserved field is {reserved:#06x}, expected 0")
    body = data[HEADER_SIZE:]
    if len(body) < length:
        raise TruncatedMetadata(f"metadata payload is {len(body)} bytes, header says {length}")
    if len(body) > length:
        raise CorruptMetadata(
            f"metadata payload is {len(body)} bytes, header says {length} (trailing bytes)"
        )
    actual = zlib.crc32(body)
    if actual != crc:
        raise CorruptMetadata(f"metadata checksum mismatch: crc32 {actual:#010x} != {crc:#010x}")
    return body
