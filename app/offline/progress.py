"""Progress of long commands on stderr: a live line on a terminal, a
plain line every few seconds otherwise (a CI log), nothing when quiet.

The explorer's search reports counts only (``SearchProgress``); the rates
and the ETA are computed here, with this process's clock.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from kvplane.statemachines.explorer import SearchProgress

if TYPE_CHECKING:
    from rich.status import Status

# Between two plain lines when stderr is not a terminal.
PLAIN_EVERY_S = 5.0


def explore_line(p: SearchProgress, elapsed: float) -> str:
    """One progress line: states, depth, states/s and, since the search is
    bounded by ``max_states``, the longest it can still take."""
    rate = p.states / elapsed if elapsed > 0 else 0.0
    line = (f"explore: {p.states:,} states, depth {p.depth}/{p.max_depth}, {p.frontier:,} to expand, "
            f"{rate:,.0f} states/s")
    if rate > 0:
        left = max(0, p.max_states - p.states) / rate
        line += f", at most {_duration(left)} more (--max-states {p.max_states:,})"
    if p.violations:
        line += f", {p.violations} violation(s)"
    return line


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s // 60:.0f} min {s % 60:02.0f} s"
    return f"{s // 3600:.0f} h {s % 3600 // 60:02.0f} min"


class ExploreProgress:
    """A context manager whose ``update`` is the explorer's progress callback."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 live: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.live = self.stream.isatty() if live is None else live
        self.start = clock()
        self._last_plain = self.start
        self._status: Status | None = None

    def __enter__(self) -> ExploreProgress:
        if self.live:
            from rich.console import Console

            console = Console(file=self.stream, highlight=False, markup=False, emoji=False)
            self._status = status = console.status("explore: starting")
            status.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._status is not None:
            self._status.stop()

    def update(self, p: SearchProgress) -> None:
        now = self.clock()
        line = explore_line(p, now - self.start)
        if self._status is not None:
            self._status.update(line)
        elif now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            print(line, file=self.stream, flush=True)
