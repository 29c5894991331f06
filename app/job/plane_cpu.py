"""The plane's own CPU time in a running process: what users feel of it.

``PlaneCpu.attach(plane)`` wraps the plane's ``handle`` and ``fire_due``
(the instance's attributes, so the driver calling them needs no change) and
adds the calling thread's CPU time spent inside them (``time.thread_time``):
dispatch, the machines' rows, the cascade of internal events, the recorders
that ship (the connector's Step recorder and the event log's capture and
encoding, which run inside ``handle``).  A ``handle`` called by ``fire_due``
is counted once, in ``fire_due``.  Each call reads the clock twice (about
0.7 µs a read here), part of which falls inside what it measures.

Not counted (``apart``): observers the main job hangs on the plane for its
own summary (``kvplane run``'s lifecycle counts and lease timeline), which
no engine runs; their CPU inside the plane's calls is summed apart
(``apart_seconds``, not part of ``seconds``).

The garbage collections that run inside those calls (an allocation there
crossed the collector's threshold; a full collection walks every object of
the process, torch's included) are counted apart too (``gc_seconds``, part
of ``seconds``).
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class PlaneCpu:
    def __init__(self) -> None:
        self.seconds = 0.0  # thread CPU time inside handle / fire_due, ``apart`` observers excluded
        self.calls = 0  # top-level calls measured
        self.gc_seconds = 0.0  # of ``seconds``: garbage collections that ran inside those calls
        self.apart_seconds = 0.0  # inside those calls, in ``apart`` observers (not in ``seconds``)
        self._inside = False
        self._gc_started: float | None = None

    def attach(self, plane: Any) -> "PlaneCpu":
        handle, fire_due = plane.handle, plane.fire_due
        clock = time.thread_time

        def timed(fn: Any) -> Any:
            def call(*args: Any) -> Any:
                if self._inside:
                    return fn(*args)
                self._inside = True
                t0 = clock()
                try:
                    return fn(*args)
                finally:
                    self.seconds += clock() - t0
                    self.calls += 1
                    self._inside = False

            return call

        plane.handle, plane.fire_due = timed(handle), timed(fire_due)
        gc.callbacks.append(self._on_gc)
        return self

    def apart(self, fn: F) -> F:
        """``fn`` with its CPU time, when called inside a measured call, moved
        from ``seconds`` to ``apart_seconds`` (the job's own observers)."""
        clock = time.thread_time

        def call(*args: Any) -> Any:
            if not self._inside:
                return fn(*args)
            t0 = clock()
            try:
                return fn(*args)
            finally:
                spent = clock() - t0
                self.seconds -= spent
                self.apart_seconds += spent

        return call  # type: ignore[return-value]

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.thread_time() if self._inside else None
        elif self._gc_started is not None:
            self.gc_seconds += time.thread_time() - self._gc_started
            self._gc_started = None
