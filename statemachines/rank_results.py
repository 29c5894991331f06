"""Aggregate per-rank outcomes of one request into the engine's outcome.

A request spread over ``n`` ranks (TP) is finished only when every rank
reported it exactly once; it failed when any rank reported a failure or a
rank it waits on was lost.  A report for an unknown request, from a rank
outside ``0..n-1``, or a second report from the same rank is counted and
ignored, never double-counted (vLLM's scheduler has the same rule for
``finished_sending`` / ``finished_recving`` across workers).  Pure.
"""
from __future__ import annotations

from collections import Counter

import attrs

# Why a report was ignored (the keys of ``RankResults.ignored``).
UNKNOWN_REQUEST = "unknown request"
BAD_RANK = "rank out of range"
DUPLICATE = "second report from a rank"


@attrs.frozen
class Outcome:
    """A request every rank has answered for."""

    request_id: str
    ok: bool
    failed_ranks: tuple[int, ...] = ()
    # Why it failed: the first failed report's reason (a lost rank: "rank <r> lost").
    reason: str | None = None


@attrs.define
class _Pending:
    reported: set = attrs.Factory(set)
    failed: set = attrs.Factory(set)
    reason: str | None = None


@attrs.define
class RankResults:
    """Per-request aggregation over ``num_ranks`` ranks."""

    num_ranks: int
    _pending: dict[str, _Pending] = attrs.Factory(dict)
    ignored: Counter = attrs.Factory(Counter)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {self.num_ranks!r}")

    def expect(self, request_id: str) -> None:
        """Start waiting for every rank's report on ``request_id`` (idempotent)."""
        self._pending.setdefault(request_id, _Pending())

    def expecting(self, request_id: str) -> bool:
        return request_id in self._pending

    def forget(self, request_id: str) -> None:
        """Stop waiting (the request is gone); later reports are ignored."""
        self._pending.pop(request_id, None)

    def report(self, rank: int, request_id: str, ok: bool = True, reason: str | None = None) -> Outcome | None:
        """Rank ``rank`` is done with ``request_id`` (``reason``: why it
        failed, when it did); the outcome once every rank is."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            self.ignored[BAD_RANK] += 1
            return None
        pending = self._pending.get(request_id)
        if pending is None:
            self.ignored[UNKNOWN_REQUEST] += 1
            return None
        if rank in pending.reported:
            self.ignored[DUPLICATE] += 1
            return None
        pending.reported.add(rank)
        if not ok:
            pending.failed.add(rank)
            pending.reason = pending.reason or reason
        return self._done(request_id, pending)

    def rank_lost(self, rank: int) -> list[Outcome]:
        """Rank ``rank`` died: every request still waiting on it fails now."""
        outcomes = []
        for rid, pending in list(self._pending.items()):
            if rank not in pending.reported:
                pending.reported.add(rank)
                pending.failed.add(rank)
                pending.reason = pending.reason or f"rank {rank} lost"
                done = self._done(rid, pending)
                if done is not None:
                    outcomes.append(done)
        return outcomes

    def waiting_on(self, request_id: str) -> tuple[int, ...]:
        """The ranks that have not reported ``request_id`` yet."""
        pending = self._pending.get(request_id)
        if pending is None:
            return ()
        return tuple(r for r in range(self.num_ranks) if r not in pending.reported)

    def __len__(self) -> int:
        return len(self._pending)

    def _done(self, request_id: str, pending: _Pending) -> Outcome | None:
        if len(pending.reported) < self.num_ranks:
            return None
        del self._pending[request_id]
        return Outcome(request_id, ok=not pending.failed, failed_ranks=tuple(sorted(pending.failed)),
                       reason=pending.reason if pending.failed else None)
