"""What is in flight between the planes (the abstract network).

``plane`` is the plane whose loop handles the message: the receiver of a
notification, or the poster of a handshake or transfer (which handles its
reply or completion).  A transfer itself is executed by the fabric, not by
a loop, so it may execute while its poster is stalled.
"""
from __future__ import annotations

from typing import Any, ClassVar

import attrs


class Message:
    __slots__ = ()
    # The short name that opens the message's canonical tuple.
    KIND: ClassVar[str] = ""
    # Faults that may hit the message in flight (each a move), in move order.
    FAULTS: ClassVar[tuple[str, ...]] = ()
    # False for transfers: the fabric executes them, no loop needs to run.
    NEEDS_LOOP: ClassVar[bool] = True
    # Declared for the type checker only (no slot, no value here): every
    # message is an attrs class whose loop handles it in ``plane``.
    __attrs_attrs__: ClassVar[tuple[attrs.Attribute[Any], ...]]
    plane: str

    def fields(self) -> tuple:
        """The field values in declaration order."""
        return tuple(getattr(self, a.name) for a in self.__attrs_attrs__)


@attrs.frozen
class Handshake(Message):
    """A handshake from ``plane`` to ``engine`` awaiting its reply."""

    KIND: ClassVar[str] = "hs"
    FAULTS: ClassVar[tuple[str, ...]] = ("hs_fail", "hs_hang")
    plane: str
    engine: str


@attrs.frozen
class Read(Message):
    """A READ posted by ``plane`` of ``engine``'s lease ``remote_request_id``."""

    KIND: ClassVar[str] = "read"
    FAULTS: ClassVar[tuple[str, ...]] = ("read_fail", "read_hang")
    NEEDS_LOOP: ClassVar[bool] = False
    plane: str
    request_id: str
    engine: str
    remote_request_id: str
    consumers: int


@attrs.frozen
class ReadDone(Message):
    """``stale``: the fabric executed the READ while ``plane`` was stalled, after
    the lease it read was gone; accepting this completion is a violation."""

    KIND: ClassVar[str] = "rdone"
    plane: str
    request_id: str
    engine: str
    stale: bool


@attrs.frozen
class ReadFailed(Message):
    KIND: ClassVar[str] = "rfail"
    plane: str
    request_id: str


@attrs.frozen
class Notif(Message):
    """A completion notification to ``plane`` about its lease ``remote_request_id``."""

    KIND: ClassVar[str] = "notif"
    FAULTS: ClassVar[tuple[str, ...]] = ("lose", "dup")
    plane: str
    remote_request_id: str
    sender: str
    consumers: int


@attrs.frozen
class PushRegistration(Message):
    """``PUSH_REG`` to ``plane``: D's blocks for ``remote_request_id`` await the
    WRITE of ``plane``'s ``request_id`` until ``deadline`` (D's clock)."""

    KIND: ClassVar[str] = "preg"
    plane: str
    request_id: str
    remote_request_id: str
    deadline: float | None


@attrs.frozen
class Write(Message):
    KIND: ClassVar[str] = "write"
    FAULTS: ClassVar[tuple[str, ...]] = ("write_fail", "write_hang")
    NEEDS_LOOP: ClassVar[bool] = False
    plane: str
    request_id: str
    engine: str
    remote_request_id: str


@attrs.frozen
class WriteDone(Message):
    KIND: ClassVar[str] = "wdone"
    plane: str
    request_id: str


@attrs.frozen
class WriteFailed(Message):
    KIND: ClassVar[str] = "wfail"
    plane: str
    request_id: str


@attrs.frozen
class Pushed(Message):
    """The notification NIXL delivers with a WRITE, to the written side."""

    KIND: ClassVar[str] = "pushed"
    plane: str
    request_id: str


@attrs.frozen
class Params(Message):
    """A request's params P exported, waiting for a stalled D's loop."""

    KIND: ClassVar[str] = "new"
    plane: str
    request_id: str


@attrs.frozen
class Disconnect(Message):
    """The transport of ``plane`` saw ``engine`` go away."""

    KIND: ClassVar[str] = "disc"
    plane: str
    engine: str
