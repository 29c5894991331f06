"""Fault injection around a real endpoint, for tests and the main job.

The production driver knows nothing of faults: a run that wants lost
notifications wraps its endpoint (``DropNotifications(endpoint, rate=0.3)``)
and hands the wrapper to the driver.  The loopback fabric has its own,
caller-driven rules; this wrapper works on NIXL as well.
"""
from __future__ import annotations

import random
from typing import Any

from .endpoint import Endpoint


class DropNotifications:
    """``inner`` with each received notification lost with probability
    ``rate`` (seeded: the same run loses the same ones).  Everything else
    is passed through unchanged; ``dropped`` counts the losses."""

    def __init__(self, inner: Endpoint, *, rate: float, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate!r}")
        self.inner = inner
        self.rate = rate
        self.dropped = 0
        self._rng = random.Random(seed)

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        kept = []
        for notif in self.inner.poll_notifs():
            if self._rng.random() < self.rate:
                self.dropped += 1
            else:
                kept.append(notif)
        return kept

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class does not define: the rest of the endpoint.
        return getattr(self.inner, name)
