"""ZMQ side channel: fetch a peer's NIXL metadata and sample its clock.

Request (REQ -> ROUTER): ``msgpack((b"get_meta_msg", pp_rank, tp_rank))``.
Reply: two frames ``[msgpack(payload dict), msgpack(time.perf_counter())]``;
a refusal is ``{"error": <code>}`` with one of ``ERROR_CODES`` (never an
echo of the request).

The metadata includes the KV cache's base addresses, and NIXL/UCX do not
authenticate: whoever gets it can READ and WRITE those blocks.  So the
channel is authenticated by default: CURVE (the server proves its key, the
traffic is encrypted) with a client allow-list checked by a ZAP handler
(pyzmq's ``zmq.auth.Authenticator``) that the server polls in its own loop,
no thread.  ``insecure=True`` opts out, loudly, for tests and benchmarks.

Both ends cap what they accept (``ZMQ_MAXMSGSIZE``): a bigger message drops
that peer's connection inside libzmq, before it is read into memory.

Each client attempt uses a fresh REQ socket with LINGER 0 and waits (in a
poll, never in a blocking send or recv) against one deadline, so a dead or
slow peer costs at most ``timeout_s`` and leaves no queued request behind to
block handshakes with other peers.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import attrs
import msgpack
import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from .layout import CacheLayout
from .wire import WireError, frame_metadata, unframe_metadata

log = logging.getLogger("kvplane.handshake")

HANDSHAKE_VERSION = 1
GET_META_MSG = b"get_meta_msg"
# A request is ~20 bytes; anything near this limit is not one.  libzmq drops
# the connection of a peer that sends more (CURVE framing adds ~50 bytes).
MAX_REQUEST_BYTES = 4096
# A reply carries the framed NIXL metadata: KBs per registered region.
MAX_REPLY_BYTES = 64 << 20
MAX_RANK = 1 << 16
# Requests answered per poll_once: a flood cannot hold the caller's loop.
MAX_REQUESTS_PER_POLL = 64
# Typed refusal codes, the whole of what a refused client learns.
ERR_BAD_REQUEST = "bad_request"
ERR_NO_METADATA = "no_metadata"
ERR_UNAUTHORIZED = "unauthorized"
ERR_UNAVAILABLE = "unavailable"
ERROR_CODES = frozenset({ERR_BAD_REQUEST, ERR_NO_METADATA, ERR_UNAUTHORIZED, ERR_UNAVAILABLE})
_MAX_DEPTH = 32  # nesting accepted in a reply payload


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
    """The peer sent something that is not a valid request or reply."""


class HandshakeRefused(HandshakeError):
    """The server answered with a typed refusal (``code``, one of ERROR_CODES)."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class HandshakeAuthError(HandshakeError):
    """CURVE authentication failed or is impossible: no server key known, or
    the server's ZAP handler refused our key."""


def _brief(value: Any, limit: int = 48) -> str:
    """A peer's value in a message, bounded: an error never echoes input whole."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


# ---------------------------------------------------------------- keys


def public_key(value: "bytes | str | os.PathLike") -> bytes:
    """A CURVE public key as 40 z85 bytes, from z85 text/bytes, 32 raw bytes,
    or the path of a ``zmq.auth`` certificate file (``*.key`` / ``*.key_secret``)."""
    if isinstance(value, os.PathLike) or (isinstance(value, str) and (len(value) != 40 or os.path.isfile(value))):
        # A certificate file: not z85 text (40 characters), or an existing file
        # (a path can be 40 characters long, and z85 has "/" and ".").
        pub, _ = zmq.auth.load_certificate(os.fspath(value))
        return pub
    if isinstance(value, str):
        value = value.encode("ascii", "replace")
    if not isinstance(value, bytes):
        raise TypeError(f"a CURVE key must be bytes, z85 text or a certificate path, got {type(value).__name__}")
    if len(value) == 32:
        return z85.encode(value)
    if len(value) == 40:
        try:
            if len(z85.decode(value)) == 32:
                return value
        except (ValueError, KeyError, IndexError, TypeError):
            pass
    raise ValueError("a CURVE key is 40 z85 characters or 32 raw bytes")


def load_keypair(path: "str | os.PathLike") -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``zmq.auth`` secret certificate file
    (``zmq.auth.create_certificates`` writes one)."""
    pub, secret = zmq.auth.load_certificate(os.fspath(path))
    if secret is None:
        raise ValueError(f"{os.fspath(path)} holds no secret key (a *.key_secret file is needed)")
    return pub, secret


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

    @property
    def finite(self) -> bool:
        return math.isfinite(self.offset) and math.isfinite(self.rtt) and self.rtt >= 0


def clock_sample(t_send: float, t_recv: float, remote_clock: float) -> ClockSample:
    """The remote stamped its clock somewhere inside [t_send, t_recv]; assume
    the middle.  A non-finite or backwards sample is a protocol error: NaN
    compares false, so an offset of NaN or -inf would open the READ gate."""
    sample = ClockSample(remote_clock - (t_send + t_recv) / 2, t_recv - t_send)
    if not sample.finite:
        raise HandshakeProtocolError(
            f"clock sample is not finite (send {_brief(t_send)}, recv {_brief(t_recv)}, "
            f"remote {_brief(remote_clock)})")
    return sample


def best_offset(samples: Sequence[ClockSample]) -> ClockSample:
    """The lowest-RTT finite sample bounds the midpoint error most tightly;
    a non-finite one is never chosen (and none at all is an error)."""
    usable = [s for s in samples if s.finite]
    if not usable:
        raise HandshakeProtocolError(f"no finite clock sample among {len(samples)}")
    return min(usable, key=lambda s: s.rtt)


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


# ---------------------------------------------------------------- parsing


def parse_request(body: bytes) -> tuple[int, int]:
    """(pp_rank, tp_rank) of a request body; anything else is a
    HandshakeProtocolError whose message does not quote the input."""
    if not isinstance(body, (bytes, bytearray, memoryview)) or len(body) > MAX_REQUEST_BYTES:
        raise HandshakeProtocolError("request is not a bounded byte string")
    try:
        req = msgpack.unpackb(bytes(body), raw=True)
    except Exception:  # msgpack raises several unrelated types
        raise HandshakeProtocolError("request is not msgpack") from None
    if not isinstance(req, (list, tuple)) or len(req) != 3:
        raise HandshakeProtocolError("request is not a (tag, pp_rank, tp_rank) triple")
    tag, pp_rank, tp_rank = req
    if tag != GET_META_MSG:
        raise HandshakeProtocolError("unknown request tag")
    for rank in (pp_rank, tp_rank):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
            raise HandshakeProtocolError("rank is not an int in range")
    return pp_rank, tp_rank


def _check_finite(value: Any, where: str, depth: int = 0) -> None:
    """Every number a peer sends must be finite, at any depth (bounded)."""
    if depth > _MAX_DEPTH:
        raise HandshakeProtocolError(f"{where}: payload nested deeper than {_MAX_DEPTH}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise HandshakeProtocolError(f"{where}: non-finite number {value!r} in the payload")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_finite(k, where, depth + 1)
            _check_finite(v, where, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_finite(v, where, depth + 1)


def parse_clock(url: str, frame: bytes) -> float:
    """The server's clock stamp: a finite number, or a HandshakeProtocolError."""
    try:
        remote_clock = msgpack.unpackb(frame)
    except Exception:
        raise HandshakeProtocolError(f"{url}: undecodable clock frame") from None
    if isinstance(remote_clock, bool) or not isinstance(remote_clock, (int, float)):
        raise HandshakeProtocolError(f"{url}: clock frame is {_brief(remote_clock)}, not a number")
    remote_clock = float(remote_clock)
    if not math.isfinite(remote_clock):
        raise HandshakeProtocolError(f"{url}: clock frame is {remote_clock!r}, not a finite number")
    return remote_clock


def parse_reply(url: str, frames: Sequence[bytes], expected_engine_id: str, compat_hash: str,
                tp_rank: int) -> tuple[dict[str, Any], bytes, float]:
    """(payload, unframed metadata, remote clock) of one reply.  Any defect is
    a HandshakeError subclass; nothing else escapes."""
    if len(frames) != 2 or not all(isinstance(f, (bytes, bytearray, memoryview)) for f in frames):
        raise HandshakeProtocolError(f"{url}: expected 2 reply frames, got {len(frames)}")
    try:
        payload = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=False)
    except Exception:
        raise HandshakeProtocolError(f"{url}: undecodable reply payload") from None
    remote_clock = parse_clock(url, bytes(frames[1]))
    if not isinstance(payload, dict):
        raise HandshakeProtocolError(f"{url}: payload is {type(payload).__name__}, not a map")
    if "error" in payload:
        code = payload["error"]
        if not isinstance(code, str) or code not in ERROR_CODES:
            raise HandshakeProtocolError(f"{url}: refusal with an unknown code {_brief(code)}")
        raise HandshakeRefused(f"{url}: refused: {code}", code)
    _check_finite(payload, url)
    _validate(url, payload, expected_engine_id, compat_hash, tp_rank)
    try:
        metadata = unframe_metadata(payload["metadata"])
    except WireError as e:
        raise HandshakeProtocolError(f"{url}: bad NIXL metadata: {e}") from e
    return payload, metadata, remote_clock


def _validate(url: str, p: dict[str, Any], engine_id: str, compat_hash: str, tp_rank: int) -> None:
    missing = [k for k in ("version", "compat_hash", "engine_id", "tp_rank", "metadata", "cache") if k not in p]
    if missing:
        raise HandshakeProtocolError(f"{url}: payload lacks {missing}")
    # Version first: a different version may not even mean the same thing by the other fields.
    if type(p["version"]) is not int or p["version"] != HANDSHAKE_VERSION:
        raise HandshakeVersionMismatch(
            f"{url}: handshake version mismatch: local {HANDSHAKE_VERSION}, remote {_brief(p['version'])}"
        )
    if not isinstance(p["compat_hash"], str) or p["compat_hash"] != compat_hash:
        raise CompatHashMismatch(
            f"{url}: compatibility hash mismatch: local {compat_hash!r}, remote {_brief(p['compat_hash'])}"
        )
    if not isinstance(p["engine_id"], str) or p["engine_id"] != engine_id:
        raise EngineIdMismatch(
            f"{url}: engine id mismatch: expected {engine_id!r}, remote is {_brief(p['engine_id'])}"
        )
    if type(p["tp_rank"]) is not int or p["tp_rank"] != tp_rank:
        raise HandshakeProtocolError(f"{url}: asked for tp_rank {tp_rank}, got {_brief(p['tp_rank'])}")
    if not isinstance(p["metadata"], bytes):
        raise HandshakeProtocolError(f"{url}: metadata is {type(p['metadata']).__name__}, not bytes")
    try:
        CacheLayout.from_dict(p["cache"])
    except (ValueError, TypeError) as e:
        raise HandshakeProtocolError(f"{url}: bad cache description: {_brief(str(e), 120)}") from None


# ---------------------------------------------------------------- server

PayloadFn = Callable[[int, int], "dict[str, Any] | None"]


class _AllowList(zmq.auth.Authenticator):
    """pyzmq's ZAP authenticator, answering from a live map of allowed client
    keys (z85) -> the engine id each belongs to, which becomes the ZMQ
    User-Id of that client's messages."""

    def __init__(self, context: zmq.Context, allowed: dict[bytes, str]):
        super().__init__(context, log=logging.getLogger("kvplane.handshake.zap"))
        self.allowed = allowed
        self.refused = 0
        self.configure_curve_callback("*", self)

    def callback(self, domain: str, z85_client_key: bytes) -> bool:
        if z85_client_key in self.allowed:
            return True
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:  # a flood costs a counter, not a line each
            log.warning("side channel: refused a CURVE client whose key is not on the allow-list (%s..., #%d)",
                        z85_client_key[:8].decode("ascii", "replace"), self.refused)
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.allowed.get(z85.encode(client_public_key), "")

    def handle_one(self, msg: list[bytes]) -> None:
        # pyzmq >= 25 makes the handler a coroutine for async credential
        # providers; ours answers at once, so it finishes on its first step.
        result = self.handle_zap_message(msg)
        if inspect.isawaitable(result):
            try:
                result.send(None)
            except StopIteration:
                return
            result.close()
            raise RuntimeError("the ZAP handler suspended; a synchronous credentials check was expected")


class HandshakeServer:
    """ROUTER socket answering metadata requests; drive it with poll_once().

    Authenticated unless ``insecure=True``: ``curve_keypair`` (public, secret)
    is the server's CURVE key and ``allowed_clients`` maps each client public
    key allowed to fetch metadata to the engine it belongs to (live: see
    ``allow_client``).  A client with another key fails the CURVE handshake
    and never reaches the request handler.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        payload_fn: PayloadFn | None = None,
        *,
        curve_keypair: tuple[bytes, bytes] | None = None,
        allowed_clients: Mapping[Any, str] | None = None,
        insecure: bool = False,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.perf_counter,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        if payload_fn is None:
            raise TypeError("payload_fn is required")
        if curve_keypair is None and not insecure:
            raise ValueError("HandshakeServer serves KV-cache addresses: pass curve_keypair= (and allowed_clients=) "
                             "or, for tests only, insecure=True")
        if curve_keypair is not None and insecure:
            raise ValueError("curve_keypair and insecure=True are exclusive")
        self._payload_fn = payload_fn
        # The clock the control plane runs on (a skewed one in fault tests).
        self._clock = clock
        self.insecure = insecure
        self._allowed: dict[bytes, str] = {}
        self._auth: _AllowList | None = None
        self._own_ctx = curve_keypair is not None and context is None
        if curve_keypair is not None:
            if not zmq.has("curve"):
                raise RuntimeError("libzmq lacks CURVE: the side channel cannot be authenticated")
            # ZAP is per context (one handler at inproc://zeromq.zap.01): a
            # server gets a context of its own, so servers in one process
            # never answer for each other.
            self._ctx = context or zmq.Context()
            for key, engine in (allowed_clients or {}).items():
                self._allowed[public_key(key)] = engine
            self._auth = _AllowList(self._ctx, self._allowed)
            self._auth.start()
        else:
            log.warning("side channel at %s is NOT authenticated (insecure=True): any local process can fetch "
                        "the NIXL metadata and with it read and write the KV cache", bind)
            self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_request_bytes)
        if curve_keypair is not None:
            public, secret = curve_keypair
            self._sock.curve_server = True
            self._sock.curve_publickey = public_key(public)
            self._sock.curve_secretkey = secret
        self._sock.bind(bind)
        self.url: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.public_key: bytes | None = public_key(curve_keypair[0]) if curve_keypair is not None else None
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._auth is not None:
            self._poller.register(self._auth.zap_socket, zmq.POLLIN)
        self.requests_served = 0
        self.bad_requests = 0
        self.unauthorized = 0
        self.served_by_client: dict[str, int] = {}  # engine id (CURVE User-Id) -> requests answered
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    @property
    def auth_refused(self) -> int:
        """CURVE clients the ZAP handler refused (key not on the allow-list)."""
        return self._auth.refused if self._auth is not None else 0

    def allow_client(self, key: Any, engine_id: str) -> None:
        """Let the holder of CURVE public ``key`` (engine ``engine_id``) fetch metadata."""
        if self._auth is None:
            raise ValueError("an insecure server has no allow-list")
        with self._lock:
            self._allowed[public_key(key)] = engine_id

    def revoke_client(self, key: Any) -> None:
        """Refuse ``key`` from now on, on connections already open too."""
        with self._lock:
            self._allowed.pop(public_key(key), None)

    def poll_once(self, timeout_ms: int = 0) -> int:
        """Answer what is waiting (waiting up to timeout_ms for something):
        ZAP authentication requests, then up to MAX_REQUESTS_PER_POLL
        metadata requests.  Returns how many metadata requests were handled."""
        with self._lock:
            if self._sock.closed:
                return 0
            ready = dict(self._poller.poll(timeout_ms))
            if not ready:
                return 0
            if self._auth is not None and self._auth.zap_socket in ready:
                while True:
                    try:
                        msg = self._auth.zap_socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._auth.handle_one(msg)
            n = 0
            while n < MAX_REQUESTS_PER_POLL:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._answer(frames)
                n += 1
            return n

    def _client_of(self, frame: zmq.Frame) -> str | None:
        """The engine an authenticated message came from (None: insecure)."""
        if self._auth is None:
            return None
        try:
            return str(frame.get("User-Id"))  # a string property (pyzmq types get() as int | str)
        except zmq.ZMQError:
            return ""

    def _answer(self, frames: list[zmq.Frame]) -> None:
        # REQ envelope: [identity, b"", body]
        if len(frames) != 3 or frames[1].bytes != b"":
            self.bad_requests += 1
            return  # not a REQ peer; nothing sensible to answer
        ident, body = frames[0].bytes, frames[2]
        client = self._client_of(body)
        if client is not None and client not in self._allowed.values():
            # Authenticated once, since revoked: the connection outlived its key.
            self.unauthorized += 1
            reply: dict[str, Any] = {"error": ERR_UNAUTHORIZED}
        else:
            try:
                pp_rank, tp_rank = parse_request(body.bytes)
            except HandshakeProtocolError:
                self.bad_requests += 1
                reply = {"error": ERR_BAD_REQUEST}
            else:
                reply = self._payload(pp_rank, tp_rank)
                self.requests_served += 1
                if client is not None:
                    self.served_by_client[client] = self.served_by_client.get(client, 0) + 1
        # Stamp as late as possible: the sample's error is bounded by RTT/2.
        stamp = msgpack.packb(self._clock())
        self._sock.send_multipart([ident, b"", msgpack.packb(reply, use_bin_type=True), stamp])

    def _payload(self, pp_rank: int, tp_rank: int) -> dict[str, Any]:
        try:
            payload = self._payload_fn(pp_rank, tp_rank)
        except Exception as exc:  # our own endpoint failing must not kill the caller's loop
            log.warning("side channel: no payload for pp_rank=%d tp_rank=%d: %s", pp_rank, tp_rank, exc)
            return {"error": ERR_UNAVAILABLE}
        return payload if payload is not None else {"error": ERR_NO_METADATA}

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
            if self._sock.closed:
                return
            self._sock.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            if self._own_ctx:
                self._ctx.term()

    def __enter__(self) -> "HandshakeServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- client

_AUTH_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def handshake(
    endpoint_url: str,
    expected_engine_id: str,
    compat_hash: str,
    timeout_s: float,
    tp_rank: int = 0,
    *,
    pp_rank: int = 0,
    samples: int = 1,
    server_public_key: Any = None,
    client_keypair: tuple[bytes, bytes] | None = None,
    insecure: bool = False,
    context: zmq.Context | None = None,
    clock: Callable[[], float] = time.perf_counter,
    max_reply_bytes: int = MAX_REPLY_BYTES,
) -> HandshakeResult:
    """One handshake attempt; retries and backoff belong to the caller's FSM.

    ``server_public_key`` authenticates the server (CURVE) and
    ``client_keypair`` is our key, which the server must have on its
    allow-list; without a server key the attempt fails with
    HandshakeAuthError unless ``insecure=True`` (plaintext).  ``samples`` > 1
    repeats the request on the same socket to collect more clock samples
    (the metadata of the last reply is returned).
    """
    if samples < 1:
        raise ValueError("samples must be >= 1")
    if server_public_key is None and not insecure:
        raise HandshakeAuthError(f"{endpoint_url}: no CURVE public key known for the server "
                                 "(pass server_public_key=, or insecure=True for tests)")
    ctx = context or zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    sock = ctx.socket(zmq.REQ)
    monitor = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
        if server_public_key is not None:
            public, secret = client_keypair or zmq.curve_keypair()
            sock.curve_serverkey = public_key(server_public_key)
            sock.curve_publickey = public_key(public)
            sock.curve_secretkey = secret
            # A refused key shows up as a monitor event: fail at once, typed,
            # instead of waiting out the timeout.
            monitor = sock.get_monitor_socket(_AUTH_FAILURES)
        sock.connect(endpoint_url)
        request = msgpack.packb((GET_META_MSG, pp_rank, tp_rank), use_bin_type=True)
        got: list[ClockSample] = []
        for _ in range(samples):
            t_send = clock()
            frames = _exchange(sock, monitor, request, endpoint_url, deadline, timeout_s)
            t_recv = clock()
            payload, metadata, remote_clock = parse_reply(endpoint_url, frames, expected_engine_id, compat_hash,
                                                          tp_rank)
            got.append(clock_sample(t_send, t_recv, remote_clock))
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
    return HandshakeResult(payload, metadata, t_send, t_recv, remote_clock, tuple(got))


def _exchange(sock: zmq.Socket, monitor: zmq.Socket | None, request: bytes, url: str, deadline: float,
              timeout_s: float) -> list[bytes]:
    """Send ``request`` and return the reply, all against one deadline.

    The send waits in a poll on the monitor too, not in a blocking send: a
    refused CURVE client's session ends (a protocol error: no reconnect) and
    takes the REQ socket's only pipe with it, so when the refusal comes
    before the send (the ZAP answer is fast, the calling thread slow) a
    blocking send would wait out the whole time-out while the
    HANDSHAKE_FAILED_AUTH event sat unread in the monitor."""
    poller = zmq.Poller()
    if monitor is not None:
        poller.register(monitor, zmq.POLLIN)
    poller.register(sock, zmq.POLLOUT)
    while True:
        _wait(poller, sock, zmq.POLLOUT, monitor, url, deadline, timeout_s)
        try:
            sock.send(request, zmq.NOBLOCK)
            break
        except zmq.Again:  # the pipe went away between the poll and the send
            continue
    poller.modify(sock, zmq.POLLIN)
    _wait(poller, sock, zmq.POLLIN, monitor, url, deadline, timeout_s)
    return sock.recv_multipart()


def _wait(poller: zmq.Poller, sock: zmq.Socket, flag: int, monitor: zmq.Socket | None, url: str, deadline: float,
          timeout_s: float) -> None:
    """Until ``sock`` is ready for ``flag``: a refusal on the monitor raises
    HandshakeAuthError, the deadline HandshakeTimeout."""
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            raise HandshakeTimeout(f"handshake with {url} timed out after {timeout_s} s")
        ready = dict(poller.poll(remaining_ms))
        if monitor is not None and monitor in ready:
            # Before the socket: a refused client's socket is never ready.
            event = recv_monitor_message(monitor)
            if event["event"] & _AUTH_FAILURES:
                raise HandshakeAuthError(f"{url}: the server refused the CURVE handshake "
                                         "(our key is not on its allow-list, or its key is not the one we hold)")
        if ready.get(sock, 0) & flag:
            return
