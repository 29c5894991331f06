"""The plane's own CPU time in a running process: what users feel of it.

``PlaneCpu.attach(plane)`` wraps the plane's ``handle`` and ``fire_due``
(the instance's attributes, so the driver calling them needs no change) and
adds the calling thread's CPU time spent inside them (``time.thread_time``):
dispatch, the machines' rows, the cascade of internal events, the recorder
(the event log's capture and encoding, which run inside ``handle``).  A
``handle`` called by ``fire_due`` is counted once, in ``fire_due``.  Each
call reads the clock twice (about 0.2 µs each here), part of which falls
inside what it measures.  The garbage collections that run inside those
calls (an allocation there crossed the collector's threshold; a full
collection walks every object of the process, torch's included) are
counted apart too (``gc_seconds``, part of ``seconds``).
"""
from __future__ import annotations

import gc
import time
from typing import Any


class PlaneCpu:
    def __init__(self) -> None:
        self.seconds = 0.0  # thread CPU time inside handle / fire_due
        self.calls = 0  # top-level calls measured
        self.gc_seconds = 0.0  # of ``seconds``: garbage collections that ran inside those calls
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

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.thread_time() if self._inside else None
        elif self._gc_started is not None:
            self.gc_seconds += time.thread_time() - self._gc_started
            self._gc_started = None
