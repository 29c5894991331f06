"""TransferTracker (test helper): a deadline for every posted transfer.

The library's driver gives each transfer its deadline through the machines;
the transport tests use this stand-alone tracker to show what a hung peer
does to a transfer and that the endpoint releases it.

A SIGSTOPped (hung, not dead) peer is never detected by NIXL: its transfers stay
"PROC" forever.  The tracker turns that into a timeout and frees the handle.
Works with any endpoint exposing ``poll_transfer(handle)`` and ``release(handle)``.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvplane.transport.endpoint import Endpoint
from kvplane.transport.errors import TransportError
from kvplane.transport.handle import DONE, XferHandle


@attrs.frozen
class Tracked:
    handle: XferHandle
    deadline: float
    tag: Any = None


@attrs.frozen
class TrackerPoll:
    completed: list[Tracked] = attrs.Factory(list)
    failed: list[tuple[Tracked, TransportError]] = attrs.Factory(list)
    timed_out: list[Tracked] = attrs.Factory(list)
    # Handles NIXL refused to release (cancel failed); retried on later polls.
    release_errors: list[tuple[Tracked, TransportError]] = attrs.Factory(list)

    def __bool__(self) -> bool:
        return bool(self.completed or self.failed or self.timed_out or self.release_errors)


class TransferTracker:
    def __init__(self, endpoint: Endpoint) -> None:
        self._ep = endpoint
        self._live: dict[int, Tracked] = {}
        self._unreleased: dict[int, Tracked] = {}

    def track(self, handle: XferHandle, deadline: float, tag: Any = None) -> Tracked:
        if handle.id in self._live:
            raise ValueError(f"transfer {handle.id} is already tracked")
        t = Tracked(handle, deadline, tag)
        self._live[handle.id] = t
        return t

    def __len__(self) -> int:
        return len(self._live)

    @property
    def unreleased(self) -> list[Tracked]:
        return list(self._unreleased.values())

    def poll(self, now: float) -> TrackerPoll:
        """Check every tracked transfer once; terminal ones are released and forgotten.

        Completion wins over the deadline: a transfer seen DONE at or after
        its deadline still counts as completed (its bytes are there).
        """
        res = TrackerPoll()
        for t in list(self._unreleased.values()):
            if self._try_release(t, res):
                del self._unreleased[t.handle.id]
        for hid, t in list(self._live.items()):
            try:
                state = self._ep.poll_transfer(t.handle)
            except TransportError as e:
                res.failed.append((t, e))
            else:
                if state == DONE:
                    res.completed.append(t)
                elif now >= t.deadline:
                    res.timed_out.append(t)
                else:
                    continue
            del self._live[hid]
            if not self._try_release(t, res):
                self._unreleased[hid] = t
        return res

    def _try_release(self, t: Tracked, res: TrackerPoll) -> bool:
        try:
            self._ep.release(t.handle, missing_ok=True)
            return True
        except TransportError as e:
            res.release_errors.append((t, e))
            return False
