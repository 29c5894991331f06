"""Wire codecs: NIXL notification strings and framed agent metadata.

Formats (see docs/architecture.md, "Wire formats"; they match vLLM's where one exists):

* completion notif  ``"<peer_request_id>:<expected_consumers>"``
* heartbeat         ``"HB:<id>,<id>,..."``
* push registration ``b"PUSH_REG:" + msgpack(dict)``; the dict carries
  ``request_id`` (P's), ``engine_id``, ``decode_request_id``, ``block_ids``,
  ``host``, ``port`` and optionally ``deadline``: when the decoder gives up
  waiting, in its own clock (a float; absent from older decoders).  It is
  decoded into a validated :class:`PushRegistration`.

Every decoder is total: any bytes either decode to a validated record or
raise a :class:`WireError` subclass, and every field is bounded (see the
``MAX_*`` constants) before it is parsed.

Metadata framing exists because NIXL's ``add_remote_agent`` remembers a peer
name even from a truncated blob, poisoning that name; we verify length and
CRC before NIXL ever sees the bytes.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import re
import struct
import zlib
from typing import Any, Iterable, Sequence

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


# ---------------------------------------------------------------- bounds
# Every field a peer sends is bounded before it is parsed, so no input can
# cost more than a linear pass over a message of at most MAX_NOTIF_BYTES.
# Request ids: vLLM's are ~40 characters ("cmpl-<uuid>-0"); 256 bytes of
# UTF-8 leaves room for any prefix scheme.
MAX_ID_BYTES = 256
# Ids in one ``HB:``; a sender with more for one engine splits them over
# several messages (encode_heartbeats), a receiver refuses more.
MAX_HEARTBEAT_IDS = 4096
# Consumers of one lease (the decode ranks P planned); the count is parsed
# from at most this many digits, never by an unbounded int().
MAX_EXPECTED_CONSUMERS = 1024
_MAX_COUNT_DIGITS = len(str(MAX_EXPECTED_CONSUMERS))
# Blocks of one request: 2**17 blocks of 16 tokens is a 2M-token prompt.
MAX_BLOCK_IDS = 131072
# Block ids are indices into a KV cache: a u32 is plenty.
MAX_BLOCK_ID = 2**32 - 1
# One notification, whatever its kind: a full heartbeat of MAX_HEARTBEAT_IDS
# ids of up to 250 bytes, or a PUSH_REG of MAX_BLOCK_IDS u32s (~650 KB).
# encode_heartbeats also splits on this size when ids are longer.
MAX_NOTIF_BYTES = 1 << 20
MAX_HOST_BYTES = 253  # a DNS name's limit
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")


# ---------------------------------------------------------------- notifications


@attrs.frozen
class CompletionNotif:
    """Sent with a READ (or after a WRITE): one consumer is done with the blocks."""

    request_id: str
    expected_consumers: int


def _ids(ids: Iterable[str]) -> tuple[str, ...]:
    return tuple(ids)  # typed: ``converter=tuple`` leaves the item type unsolved for mypy


@attrs.frozen
class HeartbeatNotif:
    """Keeps the prefill-side leases of ``request_ids`` alive."""

    request_ids: tuple[str, ...] = attrs.field(converter=_ids)


_RESERVED_IDS = frozenset({"HB", "PUSH_REG"})


def id_problem(request_id: Any) -> str | None:
    """Why ``request_id`` cannot travel in a notification, or None if it can."""
    if not isinstance(request_id, str):
        return f"request id must be str, got {type(request_id).__name__}"
    if not request_id:
        return "request id must not be empty"
    if len(request_id) > MAX_ID_BYTES or len(request_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        return f"request id is longer than {MAX_ID_BYTES} bytes"
    # ',' separates heartbeat ids; ':' separates the consumer count.  Decoding
    # splits on the last ':' anyway, but rejecting both keeps ids unambiguous
    # in every format.
    bad = [c for c in (":", ",") if c in request_id]
    if bad:
        return f"request id {request_id!r} contains reserved character(s) {bad}"
    # "HB:3" would decode as a heartbeat, "PUSH_REG:3" as a registration.
    if request_id in _RESERVED_IDS:
        return f"request id {request_id!r} is reserved (it is a notification prefix)"
    return None


def name_problem(name: Any, what: str) -> str | None:
    """Why an engine id (or another free-form name) is unacceptable, or None."""
    if not isinstance(name, str):
        return f"{what} must be str, got {type(name).__name__}"
    if not name:
        return f"{what} must not be empty"
    if len(name) > MAX_ID_BYTES or len(name.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        return f"{what} is longer than {MAX_ID_BYTES} bytes"
    if not name.isprintable():
        return f"{what} {name[:40]!r} contains non-printable characters"
    return None


def host_problem(host: Any) -> str | None:
    """Why ``host`` is not a hostname, an IPv4 or an IPv6 address, or None."""
    if not isinstance(host, str):
        return f"host must be str, got {type(host).__name__}"
    return _str_host_problem(host)


@functools.lru_cache(maxsize=256)
def _str_host_problem(host: str) -> str | None:
    """host_problem of a str, kept for the few hosts an engine hears of
    (``ipaddress`` was a tenth of a reader's accept of params, per request)."""
    if not host or len(host) > MAX_HOST_BYTES + 2:
        return f"host must be 1 to {MAX_HOST_BYTES} characters"
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return None
    except ValueError:
        pass
    if bare is not host or not host.isascii():
        return f"host {host[:60]!r} is not a hostname or an IP address"
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > MAX_HOST_BYTES or not all(_HOST_LABEL.match(label) for label in labels):
        return f"host {host[:60]!r} is not a hostname or an IP address"
    return None


def port_problem(port: Any) -> str | None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        return f"port must be an int in 1..65535, got {port!r}"[:120]
    return None


def block_ids_problem(block_ids: Any) -> str | None:
    if not isinstance(block_ids, (list, tuple)):
        return f"block ids must be a list, got {type(block_ids).__name__}"
    if len(block_ids) > MAX_BLOCK_IDS:
        return f"{len(block_ids)} block ids, more than {MAX_BLOCK_IDS}"
    for b in block_ids:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BLOCK_ID:
            return f"block id {b!r} is not an int in 0..{MAX_BLOCK_ID}"[:120]
    return None


def finite_problem(value: Any, what: str, *, optional: bool = True) -> str | None:
    """Why ``value`` is not a finite number (None allowed if ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{what} must be a finite number, got {type(value).__name__}"
    try:
        if not math.isfinite(value):
            return f"{what} must be a finite number, got {value!r}"
    except OverflowError:  # an int too large for a float
        return f"{what} is out of range"
    return None


def _check_id(request_id: str) -> None:
    problem = id_problem(request_id)
    if problem is not None:
        raise (TypeError if not isinstance(request_id, str) else ValueError)(problem)


def _raise_if(problem: str | None) -> None:
    if problem is not None:
        raise ValueError(problem)


@attrs.frozen(kw_only=True)
class PushRegistration:
    """The body of a ``PUSH_REG``: D's blocks are registered and wait for P's WRITE.

    Constructing one validates every field (ValueError naming it); the
    decoder turns that into :class:`MalformedNotification`.  On the wire it
    is the msgpack map of these fields, ``deadline`` left out when None
    (what older decoders send); unknown keys are ignored (newer senders).
    """

    request_id: str  # P's request id (whose lease the WRITE reads from)
    engine_id: str  # D's engine id
    decode_request_id: str  # D's request id, echoed in P's completion
    block_ids: tuple[int, ...]  # validated, then made a tuple
    host: str  # D's side channel
    port: int
    # When D gives up waiting for the WRITE, in D's clock; None: not sent.
    deadline: float | None = None
    # HMAC-SHA256 (hex) over the other fields with the deployment's key
    # (connector/push_auth); None: not sent (per-engine keys, insecure).
    mac: str | None = None

    def __attrs_post_init__(self) -> None:
        for problem in (
            id_problem(self.request_id), name_problem(self.engine_id, "engine_id"),
            id_problem(self.decode_request_id), block_ids_problem(self.block_ids),
            host_problem(self.host), port_problem(self.port), finite_problem(self.deadline, "deadline"),
            _mac_problem(self.mac),
        ):
            _raise_if(problem)
        object.__setattr__(self, "block_ids", tuple(self.block_ids))
        if self.deadline is not None:
            object.__setattr__(self, "deadline", float(self.deadline))

    @classmethod
    def at_side_channel(cls, url: str, **fields: Any) -> "PushRegistration":
        """A registration naming the side channel at ``url`` (``tcp://host:port``,
        the inverse of ``side_channel``); ValueError as the constructor."""
        host, port = url[len("tcp://"):].rsplit(":", 1)
        return cls(host=host, port=int(port), **fields)

    @property
    def side_channel(self) -> str:
        host = self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # a bare IPv6 address
        return f"tcp://{host}:{self.port}"

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"request_id": self.request_id, "engine_id": self.engine_id,
                             "decode_request_id": self.decode_request_id, "block_ids": list(self.block_ids),
                             "host": self.host, "port": self.port}
        if self.deadline is not None:
            d["deadline"] = self.deadline
        if self.mac is not None:
            d["mac"] = self.mac
        return d

    def signed_bytes(self) -> bytes:
        """What ``mac`` covers: every other field, canonically encoded."""
        fields = self.to_wire()
        fields.pop("mac", None)
        return msgpack.packb(sorted(fields.items()), use_bin_type=True)

    @classmethod
    def from_wire(cls, obj: Any) -> "PushRegistration":
        """Validate a decoded msgpack map; raise MalformedNotification naming the field."""
        if not isinstance(obj, dict):
            raise MalformedNotification(f"PUSH_REG body must be a msgpack map, got {type(obj).__name__}")
        missing = [k for k in ("request_id", "engine_id", "decode_request_id", "block_ids", "host", "port")
                   if k not in obj]
        if missing:
            raise MalformedNotification(f"PUSH_REG lacks field(s) {missing}")
        try:
            return cls(request_id=obj["request_id"], engine_id=obj["engine_id"],
                       decode_request_id=obj["decode_request_id"], block_ids=obj["block_ids"],
                       host=obj["host"], port=obj["port"], deadline=obj.get("deadline"), mac=obj.get("mac"))
        except (TypeError, ValueError) as e:  # only the field checks above raise here
            raise MalformedNotification(f"bad PUSH_REG: {e}") from None


def _mac_problem(mac: Any) -> str | None:
    if mac is None or (isinstance(mac, str) and re.fullmatch(r"[0-9a-f]{64}", mac)):
        return None
    return "mac must be 64 lowercase hex digits"


@attrs.frozen
class PushRegNotif:
    """Decode side registers its blocks so prefill can WRITE (push mode)."""

    registration: PushRegistration


Notification = CompletionNotif | HeartbeatNotif | PushRegNotif


def encode_completion(request_id: str, expected_consumers: int) -> bytes:
    _check_id(request_id)
    if isinstance(expected_consumers, bool) or not isinstance(expected_consumers, int):
        raise TypeError("expected_consumers must be int")
    if not 1 <= expected_consumers <= MAX_EXPECTED_CONSUMERS:
        raise ValueError(f"expected_consumers must be in 1..{MAX_EXPECTED_CONSUMERS}, got {expected_consumers}")
    return f"{request_id}:{expected_consumers}".encode()


def encode_heartbeat(request_ids: Sequence[str]) -> bytes:
    """One ``HB:`` message; refuses more ids (or bytes) than a receiver accepts."""
    if isinstance(request_ids, (str, bytes)):
        raise TypeError("request_ids must be a sequence of ids, not a single string")
    ids = list(request_ids)
    if not ids:
        raise ValueError("a heartbeat needs at least one request id")
    if len(ids) > MAX_HEARTBEAT_IDS:
        raise ValueError(f"{len(ids)} ids in one heartbeat, more than {MAX_HEARTBEAT_IDS} (use encode_heartbeats)")
    for rid in ids:
        _check_id(rid)
    msg = HB_PREFIX + ",".join(ids).encode()
    if len(msg) > MAX_NOTIF_BYTES:
        raise ValueError(f"heartbeat of {len(msg)} bytes, more than {MAX_NOTIF_BYTES} (use encode_heartbeats)")
    return msg


def encode_heartbeats(request_ids: Sequence[str]) -> list[bytes]:
    """As many ``HB:`` messages as the bounds need, in order, every id once."""
    if isinstance(request_ids, (str, bytes)):
        raise TypeError("request_ids must be a sequence of ids, not a single string")
    out: list[bytes] = []
    batch: list[bytes] = []
    size = len(HB_PREFIX) - 1  # -1: the first id has no ','
    for rid in request_ids:
        _check_id(rid)
        raw = rid.encode()
        if batch and (len(batch) == MAX_HEARTBEAT_IDS or size + 1 + len(raw) > MAX_NOTIF_BYTES):
            out.append(HB_PREFIX + b",".join(batch))
            batch, size = [], len(HB_PREFIX) - 1
        batch.append(raw)
        size += 1 + len(raw)
    if batch:
        out.append(HB_PREFIX + b",".join(batch))
    if not out:
        raise ValueError("a heartbeat needs at least one request id")
    return out


def encode_push_reg(registration: PushRegistration) -> bytes:
    if not isinstance(registration, PushRegistration):
        raise TypeError(f"push registration must be a PushRegistration, got {type(registration).__name__}")
    return PUSH_REG_PREFIX + msgpack.packb(registration.to_wire(), use_bin_type=True)


def decode_notif(data: bytes) -> Notification:
    """Decode one notification; raise :class:`MalformedNotification` otherwise.

    Total: any input either decodes to a validated record or raises
    MalformedNotification; the size is checked before anything is parsed.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedNotification(f"notification must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise MalformedNotification("empty notification")
    if len(data) > MAX_NOTIF_BYTES:
        raise MalformedNotification(f"notification of {len(data)} bytes, more than {MAX_NOTIF_BYTES}")

    if data.startswith(PUSH_REG_PREFIX):
        body = data[len(PUSH_REG_PREFIX):]
        try:
            reg = msgpack.unpackb(body, raw=False)
        except Exception as e:  # msgpack raises several unrelated types
            raise MalformedNotification(f"PUSH_REG body is not valid msgpack: {type(e).__name__}") from None
        return PushRegNotif(PushRegistration.from_wire(reg))

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedNotification(f"notification is not UTF-8: {data[:40]!r}") from None

    if text.startswith("HB:"):
        ids = text[3:].split(",")
        if len(ids) > MAX_HEARTBEAT_IDS:
            raise MalformedNotification(f"heartbeat carries {len(ids)} ids, more than {MAX_HEARTBEAT_IDS}")
        for i in ids:
            problem = id_problem(i)
            if problem is not None:
                raise MalformedNotification(f"heartbeat has an empty or invalid id: {problem[:120]}")
        return HeartbeatNotif(ids)

    rid, sep, count = text.rpartition(":")
    if not sep:
        raise MalformedNotification(f"unknown notification (no ':'): {text[:80]!r}")
    if not rid:
        raise MalformedNotification(f"completion notif has an empty request id: {text[:80]!r}")
    if "," in rid:
        raise MalformedNotification(f"completion notif request id contains ',': {text[:80]!r}")
    if len(rid.encode()) > MAX_ID_BYTES:
        raise MalformedNotification(f"completion notif request id is longer than {MAX_ID_BYTES} bytes")
    # int() alone would accept " 3", "+3" and "3_0"; only plain digits are on
    # the wire, and few of them: int() of thousands of digits is refused (or slow).
    if not (count.isascii() and count.isdigit()) or len(count) > _MAX_COUNT_DIGITS:
        raise MalformedNotification(f"bad consumer count {count[:20]!r} in {text[:80]!r}")
    n = int(count)
    if not 1 <= n <= MAX_EXPECTED_CONSUMERS:
        raise MalformedNotification(f"consumer count must be in 1..{MAX_EXPECTED_CONSUMERS} in {text[:80]!r}")
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


# NIXL agent metadata is kilobytes (a worker address and one descriptor
# list per registered region); a frame claiming more is refused unread.
MAX_METADATA_BYTES = 16 << 20


def frame_metadata(payload: bytes) -> bytes:
    payload = bytes(payload)
    if len(payload) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata of {len(payload)} bytes, more than {MAX_METADATA_BYTES}")
    header = _HEADER.pack(METADATA_MAGIC, METADATA_VERSION, 0, len(payload), zlib.crc32(payload))
    return header + payload


def unframe_metadata(data: bytes) -> bytes:
    """Return the payload of a framed blob, or raise a :class:`WireError`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        # bytes(5) would be five zero bytes, bytes("x") a TypeError.
        raise CorruptMetadata(f"metadata frame must be bytes, got {type(data).__name__}")
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
    if length > MAX_METADATA_BYTES:
        raise CorruptMetadata(f"metadata frame claims {length} bytes, more than {MAX_METADATA_BYTES}")
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
