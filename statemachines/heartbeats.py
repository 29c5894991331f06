"""Heartbeat batching on the decode side.

One ``HB:`` message per remote engine per interval, carrying every peer
request id registered for that engine, sent to every rank of that engine
(heterogeneous TP: each P rank holds its own lease records).  Registration
starts at request arrival, so a request queued for long on D keeps its
prefill lease alive.  Work per interval is O(engines + ids sent), never
O(all in-flight requests).
"""
from __future__ import annotations

from .actions import SendHeartbeat


class HeartbeatBatcher:
    __slots__ = ("interval", "max_gap", "_ids", "_ranks", "_next_at", "_last_sent", "_chain_start")

    def __init__(self, interval: float, max_gap: float | None = None):
        self.interval = interval
        # Two batches further apart than this may not chain: the lease the
        # first one extended can have expired before the second arrives.
        self.max_gap = interval if max_gap is None else max_gap
        self._ids: dict[str, dict[str, int]] = {}  # engine -> peer request id -> registrations
        self._ranks: dict[str, set[int]] = {}
        self._next_at: dict[str, float] = {}
        # When the engine's last batch went out: every id registered before
        # then had its lease extended to at least that time + extension.
        self._last_sent: dict[str, float] = {}
        # First send of the current unbroken chain (no gap over max_gap).
        self._chain_start: dict[str, float] = {}

    def start(self, engine_id: str, request_id: str, ranks, now: float) -> float | None:
        """Register an id; returns the engine's first send time if a timer must be armed."""
        ids = self._ids.get(engine_id)
        if ids is None:
            ids = self._ids[engine_id] = {}
            self._ranks[engine_id] = set()
        ids[request_id] = ids.get(request_id, 0) + 1
        self._ranks[engine_id].update(ranks)
        if engine_id not in self._next_at:
            at = self._next_at[engine_id] = now + self.interval
            return at
        return None

    def stop(self, engine_id: str, request_id: str) -> None:
        ids = self._ids.get(engine_id)
        if not ids or request_id not in ids:
            return
        ids[request_id] -= 1
        if ids[request_id] <= 0:
            del ids[request_id]

    def clone(self) -> "HeartbeatBatcher":
        copy = HeartbeatBatcher(self.interval, self.max_gap)
        copy._ids = {e: dict(d) for e, d in self._ids.items()}
        copy._ranks = {e: set(r) for e, r in self._ranks.items()}
        copy._next_at = dict(self._next_at)
        copy._last_sent = dict(self._last_sent)
        copy._chain_start = dict(self._chain_start)
        return copy

    def chain(self, engine_id: str) -> tuple[float | None, float | None]:
        """(first, last) send time of the engine's current unbroken chain."""
        return self._chain_start.get(engine_id), self._last_sent.get(engine_id)

    def is_due(self, engine_id: str, at: float) -> bool:
        return self._next_at.get(engine_id) == at

    def fire(self, engine_id: str, now: float) -> tuple[SendHeartbeat | None, float | None]:
        """Emit the engine's batch; returns (action, next time to arm or None)."""
        ids = self._ids.get(engine_id)
        if not ids:
            # Nothing left to keep alive: forget the engine until the next start.
            self._ids.pop(engine_id, None)
            self._ranks.pop(engine_id, None)
            self._next_at.pop(engine_id, None)
            self._last_sent.pop(engine_id, None)
            self._chain_start.pop(engine_id, None)
            return None, None
        action = SendHeartbeat(engine_id, tuple(sorted(self._ranks[engine_id])), tuple(ids))
        last = self._last_sent.get(engine_id)
        if last is None or now - last > self.max_gap:
            self._chain_start[engine_id] = now  # e.g. after a stall: leases may be gone
        self._last_sent[engine_id] = now
        at = self._next_at[engine_id] = now + self.interval
        return action, at

    def registered(self, engine_id: str) -> tuple[str, ...]:
        return tuple(self._ids.get(engine_id, ()))

    def engines(self) -> tuple[str, ...]:
        return tuple(e for e, ids in self._ids.items() if ids)
