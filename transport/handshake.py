"""ZMQ side channel: fetch a peer's NIXL metadata and sample its clock.

Request (REQ -> ROUTER): ``msgpack((b"get_meta_msg", pp_rank, tp_rank))``.
Reply: two frames ``[msgpack(payload dict), msgpack(time.perf_counter())]``.

Each client attempt uses a fresh REQ socket with RCVTIMEO/SNDTIMEO and
LINGER 0, so a dead or slow peer costs at most ``timeout_s`` and leaves no
queued request behind to block handshakes with other peers.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import attrs
import msgpack
import zmq

from .wire import WireError, frame_metadata, unframe_metadata

HANDSHAKE_VERSION = 1
GET_META_MSG = b"get_meta_msg"


class HandshakeError(Exception):
    """Base class for handshake failures."""


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The peer did not answer within the timeout (dead, hung, or refused auth)."""


class HandshakeVersionMismatch(HandshakeError):
    pass


class CompatHashMismatch(HandshakeError):
    pass


class EngineIdMismatch(HandshakeError):
    pass


class HandshakeProtocolError(HandshakeError):
    """The peer answered with something that is not a valid reply."""


class HandshakeRefused(HandshakeError):
    """The server understood the request but has nothing for that rank."""


# ---------------------------------------------------------------- payload


def build_payload(
    *,
    engine_id: str,
    compat_hash: str,
    tp_rank: int,
    metadata: bytes,
    cache: dict,
    **extra: Any,
) -> dict[str, Any]:
    """The dict a server returns; ``metadata`` is raw NIXL metadata, framed here."""
    return {
        "version": HANDSHAKE_VERSION,
        "compat_hash": compat_hash,
        "engine_id": engine_id,
        "tp_rank": tp_rank,
        "metadata": frame_metadata(metadata),
        "cache": cache,
        **extra,
    }


@attrs.frozen
class ClockSample:
    offset: float  # remote clock - local clock, seconds
    rtt: float


def clock_sample(t_send: float, t_recv: float, remote_clock: float) -> ClockSample:
    # The remote stamped its clock somewhere inside [t_send, t_recv]; assume the middle.
    return ClockSample(remote_clock - (t_send + t_recv) / 2, t_recv - t_send)


def best_offset(samples: Sequence[ClockSample]) -> ClockSample:
    """The lowest-RTT sample bounds the midpoint error most tightly."""
    if not samples:
        raise ValueError("best_offset needs at least one sample")
    return min(samples, key=lambda s: s.rtt)


@attrs.frozen
class HandshakeResult:
    payload: dict[str, Any]
    metadata: bytes  # unframed, checksum verified: ready for add_remote
    t_send: float
    t_recv: float
    remote_clock: float
    samples: tuple[ClockSample, ...] = ()

    @property
    def engine_id(self) -> str:
        return self.payload["engine_id"]

    @property
    def cache(self) -> dict:
        return self.payload["cache"]

    @property
    def sample(self) -> ClockSample:
        return clock_sample(self.t_send, self.t_recv, self.remote_clock)

    @property
    def clock(self) -> ClockSample:
        """Best clock estimate over all samples taken in this handshake."""
        return best_offset(self.samples or (self.sample,))


# ---------------------------------------------------------------- server

PayloadFn = Callable[[int, int], "dict[str, Any] | None"]


class HandshakeServer:
    """ROUTER socket answering metadata requests; drive it with poll_once()."""

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        payload_fn: PayloadFn | None = None,
        *,
        curve_keypair: tuple[bytes, bytes] | None = None,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if payload_fn is None:
            raise TypeError("payload_fn is required")
        self._payload_fn = payload_fn
        # The clock the control plane runs on (a skewed one in fault tests).
        self._clock = clock
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve_keypair is not None:
            public, secret = curve_keypair
            self._sock.curve_server = True
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
        self._sock.bind(bind)
        self.url: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.requests_served = 0
        self.bad_requests = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def poll_once(self, timeout_ms: int = 0) -> int:
        """Answer every request that is waiting (waiting up to timeout_ms for one)."""
        with self._lock:
            if self._sock.closed:
                return 0
            n = 0
            if not self._sock.poll(timeout_ms, zmq.POLLIN):
                return 0
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return n
                self._answer(frames)
                n += 1

    def _answer(self, frames: list[bytes]) -> None:
        # REQ envelope: [identity, b"", body]
        if len(frames) != 3 or frames[1] != b"":
            self.bad_requests += 1
            return  # not a REQ peer; nothing sensible to answer
        ident, _, body = frames
        try:
            req = msgpack.unpackb(body, raw=True)
            tag, pp_rank, tp_rank = req
            if tag != GET_META_MSG or not isinstance(pp_rank, int) or not isinstance(tp_rank, int):
                raise ValueError(f"unexpected request {req!r}")
        except Exception as e:
            self.bad_requests += 1
            reply = {"error": f"bad request: {e}"}
        else:
            payload = self._payload_fn(pp_rank, tp_rank)
            reply = payload if payload is not None else {
                "error": f"no metadata for pp_rank={pp_rank} tp_rank={tp_rank}"
            }
            self.requests_served += 1
        # Stamp as late as possible: the sample's error is bounded by RTT/2.
        stamp = msgpack.packb(self._clock())
        self._sock.send_multipart([ident, b"", msgpack.packb(reply, use_bin_type=True), stamp])

    def serve_in_thread(self, poll_ms: int = 50) -> threading.Thread:
        """Convenience for tests / standalone processes: poll until close()."""
        if self._thread is not None:
            raise RuntimeError("already serving")

        def loop() -> None:
            while not self._stop.is_set():
                self.poll_once(poll_ms)

        self._thread = threading.Thread(target=loop, name=f"handshake {self.url}", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            self._sock.close(linger=0)

    def __enter__(self) -> "HandshakeServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- client


def handshake(
    endpoint_url: str,
    expected_engine_id: str,
    compat_hash: str,
    timeout_s: float,
    tp_rank: int = 0,
    *,
    pp_rank: int = 0,
    samples: int = 1,
    server_public_key: bytes | None = None,
    client_keypair: tuple[bytes, bytes] | None = None,
    context: zmq.Context | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> HandshakeResult:
    """One handshake attempt; retries and backoff belong to the caller's FSM.

    ``samples`` > 1 repeats the request on the same socket to collect more clock
    samples (the metadata of the last reply is returned).
    """
    if samples < 1:
        raise ValueError("samples must be >= 1")
    ctx = context or zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if server_public_key is not None:
            public, secret = client_keypair or zmq.curve_keypair()
            sock.curve_serverkey = server_public_key
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        sock.connect(endpoint_url)
        request = msgpack.packb((GET_META_MSG, pp_rank, tp_rank), use_bin_type=True)
        got: list[ClockSample] = []
        for _ in range(samples):
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise HandshakeTimeout(f"handshake with {endpoint_url} timed out after {timeout_s} s")
            sock.setsockopt(zmq.SNDTIMEO, remaining_ms)
            sock.setsockopt(zmq.RCVTIMEO, remaining_ms)
            t_send = clock()
            try:
                sock.send(request)
                frames = sock.recv_multipart()
            except zmq.Again as e:
                raise HandshakeTimeout(
                    f"handshake with {endpoint_url} timed out after {timeout_s} s"
                ) from e
            t_recv = clock()
            payload, remote_clock = _parse_reply(endpoint_url, frames)
            got.append(clock_sample(t_send, t_recv, remote_clock))
    finally:
        sock.close(linger=0)

    _validate(endpoint_url, payload, expected_engine_id, compat_hash, tp_rank)
    try:
        metadata = unframe_metadata(payload["metadata"])
    except WireError as e:
        raise HandshakeProtocolError(f"{endpoint_url}: bad NIXL metadata: {e}") from e
    return HandshakeResult(payload, metadata, t_send, t_recv, remote_clock, tuple(got))


def _parse_reply(url: str, frames: list[bytes]) -> tuple[dict[str, Any], float]:
    if len(frames) != 2:
        raise HandshakeProtocolError(f"{url}: expected 2 reply frames, got {len(frames)}")
    try:
        payload = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        remote_clock = msgpack.unpackb(frames[1])
    except Exception as e:
        raise HandshakeProtocolError(f"{url}: undecodable reply: {e}") from e
    if not isinstance(payload, dict):
        raise HandshakeProtocolError(f"{url}: payload is {type(payload).__name__}, not a map")
    if "error" in payload:
        raise HandshakeRefused(f"{url}: {payload['error']}")
    if isinstance(remote_clock, bool) or not isinstance(remote_clock, (int, float)):
        raise HandshakeProtocolError(f"{url}: clock frame is {remote_clock!r}, not a number")
    return payload, float(remote_clock)


def _validate(url: str, p: dict[str, Any], engine_id: str, compat_hash: str, tp_rank: int) -> None:
    missing = [k for k in ("version", "compat_hash", "engine_id", "tp_rank", "metadata", "cache") if k not in p]
    if missing:
        raise HandshakeProtocolError(f"{url}: payload lacks {missing}")
    # Version first: a different version may not even mean the same thing by the other fields.
    if p["version"] != HANDSHAKE_VERSION:
        raise HandshakeVersionMismatch(
            f"{url}: handshake version mismatch: local {HANDSHAKE_VERSION}, remote {p['version']!r}"
        )
    if p["compat_hash"] != compat_hash:
        raise CompatHashMismatch(
            f"{url}: compatibility hash mismatch: local {compat_hash!r}, remote {p['compat_hash']!r}"
        )
    if p["engine_id"] != engine_id:
        raise EngineIdMismatch(
            f"{url}: engine id mismatch: expected {engine_id!r}, remote is {p['engine_id']!r}"
        )
    if p["tp_rank"] != tp_rank:
        raise HandshakeProtocolError(f"{url}: asked for tp_rank {tp_rank}, got {p['tp_rank']!r}")
    if not isinstance(p["metadata"], bytes):
        raise HandshakeProtocolError(f"{url}: metadata is {type(p['metadata']).__name__}, not bytes")
