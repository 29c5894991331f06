"""What the heartbeat batches hold, read-only, for the driver and the explorer.

The batches are machines (machines/heartbeat.py), one per remote engine,
living in the plane's instances; this is their public query surface, so
no caller reads a batch's fields.
"""
from __future__ import annotations

from . import read_gate


class Heartbeats:
    __slots__ = ("_batches", "interval", "max_gap")

    def __init__(self, batches: dict, config):
        self._batches = batches  # the plane's "heartbeat" instances, by engine id
        self.interval = config.heartbeat_interval
        self.max_gap = read_gate.max_gap(config)

    def over(self, batches: dict) -> "Heartbeats":
        """The same reader over another plane's batches (a clone's)."""
        h = Heartbeats.__new__(Heartbeats)
        h._batches, h.interval, h.max_gap = batches, self.interval, self.max_gap
        return h

    def registered(self, engine_id: str) -> tuple[str, ...]:
        """Peer request ids the engine's next batch carries."""
        b = self._batches.get(engine_id)
        return () if b is None else tuple(b.ids)

    def registrations(self, engine_id: str, request_id: str) -> int | None:
        """How many live registrations the id has (None: not registered)."""
        b = self._batches.get(engine_id)
        return None if b is None else b.ids.get(request_id)

    def engines(self) -> tuple[str, ...]:
        """Engines with ids to keep alive."""
        return tuple(e for e, b in self._batches.items() if b.ids)

    def scheduled(self) -> tuple[str, ...]:
        """Engines with a batch scheduled (with or without ids left)."""
        return tuple(self._batches)

    def due(self, engine_id: str) -> float | None:
        """When the engine's next batch goes out (None: none scheduled)."""
        b = self._batches.get(engine_id)
        return None if b is None else b.next_at

    def ranks(self, engine_id: str) -> tuple[int, ...]:
        """Ranks of the engine the batches go to, sorted."""
        b = self._batches.get(engine_id)
        return () if b is None else tuple(sorted(b.ranks))

    def chain(self, engine_id: str) -> tuple[float | None, float | None]:
        """(first, last) send time of the engine's current unbroken chain."""
        b = self._batches.get(engine_id)
        return (None, None) if b is None else (b.chain_start, b.last_sent)
