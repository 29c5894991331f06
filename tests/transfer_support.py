"""Driving two endpoints until a transfer is over (test helper, not a test module).

Without a progress thread the initiator's ``poll_transfer`` is what
progresses a transfer, and the target must poll to receive its
notification; both helpers poll, sleeping between polls (never spinning).
"""
from __future__ import annotations

import time


def wait_for(fn, timeout=2.0, step=0.001):
    """Poll fn() until truthy; sleeps between polls (never busy-spins)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = fn()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


def complete(initiator, h, target, notif=b"", timeout=2.0):
    """Drive both sides until the transfer is DONE and, when ``notif`` is
    given, the target got it from the initiator; returns the target's notifs."""
    got, done = [], False

    def step():
        nonlocal done
        done = done or initiator.poll_transfer(h) == "DONE"
        got.extend(target.poll_notifs())
        return done and (not notif or (initiator.name, notif) in got)

    wait_for(step, timeout)
    return got
