"""The plane's own CPU time in a running process: what users feel of it.

``PlaneCpu.attach(plane)`` wraps the plane's ``handle`` and ``fire_due``
(the instance's attributes, so the driver calling them needs no change) and
adds the calling thread's CPU time spent inside them (``time.thread_time``):
dispatch, the machines' rows, the cascade of internal events, the recorder
(the event log's capture and encoding, which run inside ``handle``).  A
``handle`` called by ``fire_due`` is counted once, in ``fire_due``.  Each
call reads the clock twice (about 0.2 µs each here), part of which falls
inside what it measures.
"""
from __future__ import annotations

import time
from typing import Any


class PlaneCpu:
    def __init__(self) -> None:
        self.seconds = 0.0  # thread CPU time inside handle / fire_due
        self.calls = 0  # top-level calls measured
        self._inside = False

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
        return self
