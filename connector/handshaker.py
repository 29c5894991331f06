"""Side-channel handshakes off the step loop.

A handshake waits on a remote (up to its timeout); the step loop must not.
A pool of threads runs them and hands results back through a queue that
the step loop drains, so the plane is only ever touched by one thread.

One dead or slow peer delays nobody else's handshake:

- at most one attempt per engine is in flight: a second ``submit`` for an
  engine whose attempt is still running is folded into it (its outcome
  answers both); one naming another address runs when the first ends;
- the pool has a thread for every attempt it admits (``max_in_flight``), so
  an admitted attempt never queues behind another engine's; past that many
  engines at once, a new attempt fails at once (``HandshakeBusy``): the
  remote_engine machine backs that engine off and its requests recompute,
  nobody waits.

Retries and backoff are the remote_engine machine's (its table), not here.
"""
from __future__ import annotations

import queue
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from kvplane.transport.handshake import HandshakeError, HandshakeResult, handshake

# Engines with an attempt in flight at once; one thread each (started lazily).
MAX_IN_FLIGHT = 32


class HandshakeBusy(HandshakeError):
    """As many engines as the pool serves are handshaking already."""


@attrs.frozen
class HandshakeOutcome:
    engine_id: str
    url: str
    result: HandshakeResult | None
    error: Exception | None


@attrs.frozen
class _Attempt:
    engine_id: str
    url: str
    tp_rank: int
    server_public_key: bytes | None


class Handshaker:
    def __init__(self, compat_hash: str, timeout_s: float, *, samples: int = 3, max_in_flight: int = MAX_IN_FLIGHT,
                 clock: Any = None, client_keypair: tuple[bytes, bytes] | None = None, insecure: bool = False):
        """``client_keypair``: our CURVE key, on the allow-list of the peers we
        handshake with; ``insecure``: talk plaintext to a peer whose server
        key we do not know (tests only)."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.compat_hash = compat_hash
        self.timeout_s = timeout_s
        self.samples = samples
        self.clock = clock
        self.client_keypair = client_keypair
        self.insecure = insecure
        self.max_in_flight = max_in_flight
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="kvplane-handshake")
        self._done: queue.SimpleQueue[HandshakeOutcome] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[str, _Attempt] = {}  # engine id -> its attempt in flight
        self._queued: dict[str, _Attempt] = {}  # engine id -> the next attempt (another address), latest wins
        self.counters: Counter = Counter()

    def submit(self, engine_id: str, url: str, tp_rank: int = 0, server_public_key: bytes | None = None) -> None:
        """``server_public_key``: the peer's CURVE key; without one the attempt
        fails (HandshakeAuthError) unless this handshaker is insecure."""
        attempt = _Attempt(engine_id, url, tp_rank, server_public_key)
        with self._lock:
            running = self._running.get(engine_id)
            if running is not None:
                if running == attempt:
                    self.counters["handshakes_coalesced"] += 1
                    self._queued.pop(engine_id, None)
                else:
                    self.counters["handshakes_queued_per_engine"] += 1
                    self._queued[engine_id] = attempt
                return
            if len(self._running) >= self.max_in_flight:
                self.counters["handshakes_refused_busy"] += 1
                self._done.put(HandshakeOutcome(engine_id, url, None, HandshakeBusy(
                    f"{len(self._running)} engines handshaking already (max_in_flight {self.max_in_flight})")))
                return
            self._running[engine_id] = attempt
        self._pool.submit(self._run, attempt)

    def in_flight(self) -> dict[str, str]:
        """Engine id -> the address its attempt in flight goes to."""
        with self._lock:
            return {e: a.url for e, a in self._running.items()}

    def _run(self, attempt: _Attempt) -> None:
        try:
            kwargs = {"clock": self.clock} if self.clock is not None else {}
            result = handshake(attempt.url, attempt.engine_id, self.compat_hash, self.timeout_s, attempt.tp_rank,
                               samples=self.samples, server_public_key=attempt.server_public_key,
                               client_keypair=self.client_keypair, insecure=self.insecure, **kwargs)
            outcome = HandshakeOutcome(attempt.engine_id, attempt.url, result, None)
        except Exception as exc:  # every failure becomes a HandshakeFailed event
            outcome = HandshakeOutcome(attempt.engine_id, attempt.url, None, exc)
        with self._lock:
            # The slot is free before the outcome is seen: a retry it causes is admitted.
            del self._running[attempt.engine_id]
            nxt = self._queued.pop(attempt.engine_id, None)
            if nxt is not None:
                self._running[nxt.engine_id] = nxt
        self._done.put(outcome)
        if nxt is not None:
            try:
                self._pool.submit(self._run, nxt)
            except RuntimeError:  # closed meanwhile
                with self._lock:
                    self._running.pop(nxt.engine_id, None)

    def completed(self) -> list[HandshakeOutcome]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
