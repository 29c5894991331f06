"""Every instruction a transition can emit: fields and resources only.

What goes into an action is written beside the table that emits it (the
machine-local builders in ``machines/<machine>.py``, see ``emit``); the
validator reads the resources declared here statically.  Internal actions
are carried out by the ControlPlane (cross-machine ones as declared in
``composition``); the rest go to the transport or the scheduler.

Actions are mutable attrs slots classes without converters: one is built
per emitted row entry on the hot path, and a frozen class (object.__setattr__
per field) or a converter (``tuple()`` of what is already a tuple) made
that several times dearer.  Nothing mutates an action after it is built;
they stay hashable.  Builders pass tuples where a field says ``tuple``.
"""
from __future__ import annotations

from typing import ClassVar

import attrs

from .base import Action, declared


# ------------------------------------------------------------- heartbeats (internal)
@attrs.define(slots=True, unsafe_hash=True)
class StartHeartbeat(Action):
    engine_id: str
    remote_request_id: str
    ranks: tuple
    internal: ClassVar[bool] = True
    acquires: ClassVar[frozenset[str]] = frozenset({"heartbeat"})


@attrs.define(slots=True, unsafe_hash=True)
class StopHeartbeat(Action):
    engine_id: str
    remote_request_id: str
    internal: ClassVar[bool] = True
    releases: ClassVar[frozenset[str]] = frozenset({"heartbeat"})


@attrs.define(slots=True, unsafe_hash=True)
class SendHeartbeat(Action):
    """One batched ``HB:`` message for one remote engine, to every rank."""

    engine_id: str
    ranks: tuple
    request_ids: tuple


# --------------------------------------------------------- engine references (internal)
@attrs.define(slots=True, unsafe_hash=True)
class AcquireEngine(Action):
    engine_id: str
    kind: str
    key: str
    internal: ClassVar[bool] = True
    acquires: ClassVar[frozenset[str]] = frozenset({"engine_ref"})


@attrs.define(slots=True, unsafe_hash=True)
class ReleaseEngine(Action):
    engine_id: str
    kind: str
    key: str
    internal: ClassVar[bool] = True
    releases: ClassVar[frozenset[str]] = frozenset({"engine_ref"})


@attrs.define(slots=True, unsafe_hash=True)
class NoteActivity(Action):
    """Internal: refresh the engine's liveness (any READ/WRITE/completion)."""

    engine_id: str
    internal: ClassVar[bool] = True


@attrs.define(slots=True, unsafe_hash=True)
class WakeRequesters(Action):
    engine_id: str
    requesters: tuple
    clock_offset: float = 0.0
    internal: ClassVar[bool] = True


@attrs.define(slots=True, unsafe_hash=True)
class FailRequesters(Action):
    engine_id: str
    requesters: tuple
    reason: str = ""
    internal: ClassVar[bool] = True


# ------------------------------------------------------------------- transport
@attrs.define(slots=True, unsafe_hash=True)
class StartHandshake(Action):
    engine_id: str
    attempt: int


@attrs.define(slots=True, unsafe_hash=True)
class RemoveRemoteAgent(Action):
    engine_id: str
    releases: ClassVar[frozenset[str]] = frozenset({"remote_agent"})


@attrs.define(slots=True, unsafe_hash=True)
class PostRead(Action):
    """READ the remote blocks into ours.  The transport attaches the completion
    notification (``remote_request_id``, ``expected_consumers``), which NIXL
    delivers to the remote when the READ completes."""

    request_id: str
    engine_id: str
    remote_request_id: str
    local_block_ids: tuple
    remote_block_ids: tuple
    expected_consumers: int = 1
    acquires: ClassVar[frozenset[str]] = frozenset({"xfer"})


@attrs.define(slots=True, unsafe_hash=True)
class PostWrite(Action):
    request_id: str
    engine_id: str
    remote_request_id: str
    local_block_ids: tuple
    remote_block_ids: tuple
    acquires: ClassVar[frozenset[str]] = frozenset({"xfer"})


@attrs.define(slots=True, unsafe_hash=True)
class ReleaseXfer(Action):
    """Release the transfer handle; ``cancel`` when it may still be in flight."""

    request_id: str
    cancel: bool = False
    releases: ClassVar[frozenset[str]] = frozenset({"xfer"})


@attrs.define(slots=True, unsafe_hash=True)
class SendNotif(Action):
    """Notify-only completion: tell the remote its blocks are no longer needed."""

    engine_id: str
    remote_request_id: str
    expected_consumers: int = 1


@attrs.define(slots=True, unsafe_hash=True)
class SendPushRegistration(Action):
    """``PUSH_REG``: our blocks await the remote's WRITE until ``deadline`` (our
    clock), when we give up and may reuse them."""

    request_id: str
    engine_id: str
    remote_request_id: str
    block_ids: tuple
    deadline: float | None = None


# ------------------------------------------------------------------- scheduler
@attrs.define(slots=True, unsafe_hash=True)
class ReportRecv(Action):
    """Tell the scheduler an awaited recv finished; reported exactly once."""

    request_id: str
    ok: bool
    failed_block_ids: tuple = ()
    releases: ClassVar[frozenset[str]] = frozenset({"report"})


@attrs.define(slots=True, unsafe_hash=True)
class FreeBlocks(Action):
    request_id: str
    block_ids: tuple
    reason: str = ""
    releases: ClassVar[frozenset[str]] = frozenset({"blocks"})


@attrs.define(slots=True, unsafe_hash=True)
class GrantHold(Action):
    """Internal: keep a finished decode request's blocks for turn 2 (fixed TTL lease)."""

    request_id: str
    block_ids: tuple
    internal: ClassVar[bool] = True


@attrs.define(slots=True, unsafe_hash=True)
class ConsumeLease(Action):
    """Internal: a push WRITE completed, which consumes the lease like a READ."""

    request_id: str
    consumer: str
    internal: ClassVar[bool] = True


@attrs.define(slots=True, unsafe_hash=True)
class RefuseNotification(Action):
    """A heartbeat or completion a lease refused; nothing changed.  For the
    embedder to count and log (a forged or misdirected message)."""

    request_id: str
    sender: str | None
    reason: str
    abstract: ClassVar[bool] = True  # the common base of the refusals below


@attrs.define(slots=True, unsafe_hash=True)
class RefuseForeignSender(RefuseNotification):
    """From a sender the lease is not bound to."""


@attrs.define(slots=True, unsafe_hash=True)
class RefuseWrongCount(RefuseNotification):
    """A completion whose consumer count disagrees with the lease's plan."""


# Every action the machines' tables name, by name (the event log resolves
# names here; ArmTimer/CancelTimer, the framework's, are added there).
ALL_ACTIONS: dict[str, type[Action]] = declared(Action, __name__)
