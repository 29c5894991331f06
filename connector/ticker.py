"""Ticker: a background thread that keeps stepping a PlaneDriver.

Why a thread: a driver only acts when ``step`` is called, and vLLM's engine
steps only while it has requests.  An idle prefill engine would then expire
no lease and process no heartbeat or completion until the next request
arrives (measured with vLLM's NixlConnector: an idle P handles no
notification at all).  A thread works with any engine and needs nothing
from its loop.

Why a lock: the driver is single-threaded by contract (one thread touches
the plane at a time).  The ticker steps it under ``ticker.lock``, and the
engine's own calls into the driver (``feed``/``step`` from its step loop)
must hold the same lock::

    with Ticker(driver) as ticker:
        ...
        with ticker.lock:
            driver.feed(event)
        ticker.wake_for(driver.plane.next_deadline())  # it may have armed an earlier timer

No busy loop: the thread sleeps on an Event for
min(``max_idle_wait``, time until the plane's next deadline), so an idle
engine costs about 1/max_idle_wait cheap polls a second, and a timer fires
within milliseconds of its deadline.  The deadline is read in the driver's
clock and slept in real time: right for the default ``time.monotonic``; with
any other clock ``max_idle_wait`` alone bounds the sleep.  A deadline armed
by the engine while the thread sleeps is seen at the next wake-up: within
``max_idle_wait``, or at once after ``wake()`` (or ``wake_for(deadline)``,
which wakes the thread only if that deadline comes before its wake-up).

Why not wake the thread on every engine call: it then takes the GIL from
the engine's thread for its whole step.  Measured in vLLM's D worker
(py-spy, bench.connector, 2026-12-06): 64 of 73 samples inside
``bind_connector_metadata`` were in the ``wake()`` it made every step.

An exception inside ``step`` is counted (``errors``) and logged (the first
few, then every 1000th) and the thread goes on; it never dies silently.

``longest_late_ms``: the most a step started after it was due (the end of
its wait, or the ``wake()``), which is time the thread was not scheduled or
waited for the lock.  ``longest_step_ms``: the longest a step took, its
``after_step`` included: a thread descheduled inside its step (once 118 s
where ``longest_late_ms`` read 6.5 s).  A rank's stall is the larger.
Heartbeats and lease expiries are that late too: on an overloaded machine
a worker process that gets no CPU for longer than a lease's slack lets
leases expire although nothing else is wrong (docs/parity.md, "TP").
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .driver import PlaneDriver

log = logging.getLogger("kvplane.ticker")

# The shortest sleep between two steps, whatever the deadline says: a timer
# that stays due (or a step that does work every time) costs at most a
# thousand steps a second, never a spinning core.
MIN_WAIT = 0.001


class Ticker:
    """Steps ``driver`` from a daemon thread; see the module docstring.

    ``lock``: a ``threading.Lock`` or ``RLock`` shared with the engine's
    calls into the driver (an RLock is created when none is given).
    ``after_step``: called after every step, outside the lock.
    ``step``: what a tick runs (default ``driver.step``), under the lock.
    Stats, written by the thread only: ``ticks`` (steps run),
    ``steps_with_work`` (steps that processed a stimulus), ``errors``
    (steps that raised; the last one is ``last_error``).
    """

    def __init__(self, driver: PlaneDriver, *, lock: Any = None, max_idle_wait: float = 0.1,
                 name: str | None = None, after_step: Callable[[], None] | None = None,
                 step: Callable[[], int] | None = None):
        if not max_idle_wait >= MIN_WAIT:  # also refuses NaN
            raise ValueError(f"max_idle_wait must be >= {MIN_WAIT} s, got {max_idle_wait!r}")
        self._step = step if step is not None else driver.step
        self.driver = driver
        self.lock = lock if lock is not None else threading.RLock()
        self.max_idle_wait = float(max_idle_wait)
        # Housekeeping off the engine's steps (status files, log flushes):
        # called after each step, outside the lock (it takes it if it needs it).
        self.after_step = after_step
        # When the thread last began a step (time.monotonic; -inf: never): an
        # embedder whose calls leave work to the thread can tell that it is
        # not being scheduled and do that work itself.
        self.stepped_at = float("-inf")
        self.ticks = 0
        self.steps_with_work = 0
        self.errors = 0
        self.longest_late_ms = 0
        self.longest_step_ms = 0
        self.last_error: BaseException | None = None
        self._wake = threading.Event()
        # When the thread's next sleep ends (time.monotonic), set with the
        # sleep's length; -inf before the first step (which comes at once).
        self._sleep_ends = float("-inf")
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name or f"kvplane-ticker-{driver.engine_id}",
                                        daemon=True)

    # ----------------------------------------------------------------- control
    def start(self) -> Ticker:
        """Start the thread (once; a stopped ticker is not restarted)."""
        if self._stopping:
            raise RuntimeError("a stopped Ticker cannot be started again")
        self._thread.start()  # raises RuntimeError when already started
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread and join it; idempotent.  Once it returns True no
        step runs any more.  False: the thread is still inside a step after
        ``timeout`` seconds (it exits when the step returns)."""
        self._stopping = True
        self._wake.set()
        if not self._thread.is_alive() or self._thread is threading.current_thread():
            return not self._thread.is_alive()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wake(self) -> None:
        """Step now rather than at the next timeout (e.g. the engine posted a
        transfer or armed an earlier deadline)."""
        self._wake.set()

    def wake_for(self, deadline: float | None) -> bool:
        """Wake the thread if ``deadline`` (the driver's clock; None: no
        timer) comes before its current sleep ends; otherwise it steps in
        time anyway and is left asleep.  True when it was woken."""
        if deadline is None:
            return False
        if deadline - self.driver.clock() >= self._sleep_ends - time.monotonic():  # NaN: woken
            return False
        self._wake.set()
        return True

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        return {"ticks": self.ticks, "steps_with_work": self.steps_with_work, "errors": self.errors,
                "longest_late_ms": self.longest_late_ms, "longest_step_ms": self.longest_step_ms}

    def __enter__(self) -> Ticker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- thread
    def _loop(self) -> None:
        timeout = 0.0  # the first step at once
        while True:
            planned = time.monotonic() + timeout
            woken = self._wake.wait(timeout)
            # When this step was due: the end of the wait; woken early, about now.
            due = min(planned, time.monotonic()) if woken else planned
            # A wake() between the wait and this clear is not lost: the step
            # it asked for follows right away.
            self._wake.clear()
            with self.lock:
                if self._stopping:
                    return
                self._note_lateness(due)
                self.stepped_at = time.monotonic()
                try:
                    work = self._step()
                except Exception as exc:  # counted and logged; the thread goes on
                    self._failed("driver step", exc)
                    work = 0  # no quick retry: a step that keeps failing costs one per timeout
                self.ticks += 1
                if work:
                    self.steps_with_work += 1
                timeout = MIN_WAIT if work else self._idle_timeout()
                # Set under the lock: a deadline the engine arms after this is compared with it.
                self._sleep_ends = time.monotonic() + timeout
            if self.after_step is not None:
                try:
                    self.after_step()
                except Exception as exc:  # counted and logged like a failed step
                    self._failed("after_step", exc)
            # The step and its after_step: a thread descheduled inside them shows
            # here, where longest_late_ms does not see it (only this thread writes
            # stepped_at).
            self._note_step(self.stepped_at)

    def _failed(self, what: str, exc: Exception) -> None:
        """Count a failure and log it: the first few, then every 1000th (a
        call that keeps failing writes no line per tick).  Called from the
        ``except`` block, so the log carries its traceback."""
        self.errors += 1
        self.last_error = exc
        if self.errors <= 3 or self.errors % 1000 == 0:
            log.exception("%s: %s failed (%d so far); the ticker goes on", self.driver.engine_id, what, self.errors)

    def _note_step(self, began: float) -> None:
        step_ms = int((time.monotonic() - began) * 1000)
        if step_ms > self.longest_step_ms:
            self.longest_step_ms = step_ms

    def _note_lateness(self, due: float) -> None:
        late_ms = int((time.monotonic() - due) * 1000)
        if late_ms > self.longest_late_ms:
            self.longest_late_ms = late_ms

    def _idle_timeout(self) -> float:
        """min(max_idle_wait, time to the plane's next deadline), at least
        MIN_WAIT.  Under the lock: next_deadline prunes the timer heap."""
        try:
            deadline = self.driver.plane.next_deadline()
            until = None if deadline is None else deadline - self.driver.clock()
        except Exception as exc:
            self.errors += 1
            self.last_error = exc
            log.exception("%s: reading the next deadline failed; the ticker goes on", self.driver.engine_id)
            until = None
        if until is None or not until < self.max_idle_wait:  # NaN: the full wait
            return self.max_idle_wait
        return max(MIN_WAIT, until)
