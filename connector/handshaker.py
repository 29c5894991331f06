"""Side-channel handshakes off the step loop.

A handshake waits on a remote (up to its timeout); the step loop must not.
A small pool runs them and hands results back through a queue that the
step loop drains, so the plane is only ever touched by one thread, and one
dead peer delays nobody else's handshake.
"""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from kvplane.transport.handshake import HandshakeResult, handshake


@attrs.frozen
class HandshakeOutcome:
    engine_id: str
    url: str
    result: HandshakeResult | None
    error: Exception | None


class Handshaker:
    def __init__(self, compat_hash: str, timeout_s: float, *, samples: int = 3, workers: int = 4,
                 clock: Any = None, client_keypair: tuple[bytes, bytes] | None = None, insecure: bool = False):
        """``client_keypair``: our CURVE key, on the allow-list of the peers we
        handshake with; ``insecure``: talk plaintext to a peer whose server
        key we do not know (tests only)."""
        self.compat_hash = compat_hash
        self.timeout_s = timeout_s
        self.samples = samples
        self.clock = clock
        self.client_keypair = client_keypair
        self.insecure = insecure
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvplane-handshake")
        self._done: queue.SimpleQueue[HandshakeOutcome] = queue.SimpleQueue()

    def submit(self, engine_id: str, url: str, tp_rank: int = 0, server_public_key: bytes | None = None) -> None:
        """``server_public_key``: the peer's CURVE key; without one the attempt
        fails (HandshakeAuthError) unless this handshaker is insecure."""
        self._pool.submit(self._run, engine_id, url, tp_rank, server_public_key)

    def _run(self, engine_id: str, url: str, tp_rank: int, server_public_key: bytes | None) -> None:
        try:
            kwargs = {"clock": self.clock} if self.clock is not None else {}
            result = handshake(url, engine_id, self.compat_hash, self.timeout_s, tp_rank,
                               samples=self.samples, server_public_key=server_public_key,
                               client_keypair=self.client_keypair, insecure=self.insecure, **kwargs)
            self._done.put(HandshakeOutcome(engine_id, url, result, None))
        except Exception as exc:  # every failure becomes a HandshakeFailed event
            self._done.put(HandshakeOutcome(engine_id, url, None, exc))

    def completed(self) -> list[HandshakeOutcome]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
