"""What the scheduler half tells the engine at ``get_finished``.

One record per call, built from the ``engine_request`` machines' Tell*
actions since the last call (and the ranks' load-error blocks), then
handed over whole: the scheduler half keeps no request-id set of its own
between steps, only this outbox, which each ``get_finished`` empties.
"""
from __future__ import annotations

from typing import Iterable

import attrs


@attrs.frozen
class FailedRecv:
    """A recv that failed, and why (the first failing rank's reason, with
    its rank at TP > 1, or "rank <r> lost")."""

    request_id: str
    reason: str


@attrs.frozen
class EngineReport:
    """finished_sending / finished_recving / failed_recving (vLLM's names)
    and the blocks whose load failed, each request named once."""

    finished_sending: tuple[str, ...] = ()
    finished_recving: tuple[str, ...] = ()
    failed_recving: tuple[FailedRecv, ...] = ()
    load_error_blocks: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving or self.load_error_blocks)

    @property
    def failed_ids(self) -> tuple[str, ...]:
        return tuple(f.request_id for f in self.failed_recving)

    def sent(self, request_id: str) -> EngineReport:
        return attrs.evolve(self, finished_sending=self.finished_sending + (request_id,))

    def received(self, request_id: str) -> EngineReport:
        return attrs.evolve(self, finished_recving=self.finished_recving + (request_id,))

    def failed(self, request_id: str, reason: str) -> EngineReport:
        return attrs.evolve(self, failed_recving=self.failed_recving + (FailedRecv(request_id, reason),))

    def load_errors(self, blocks: Iterable[int]) -> EngineReport:
        """The blocks added (each named once)."""
        new = set(blocks) - set(self.load_error_blocks)
        return attrs.evolve(self, load_error_blocks=self.load_error_blocks + tuple(sorted(new))) if new else self
