"""Every instruction a transition can emit: fields and resources only.

What goes into an action is written beside the table that emits it (the
machine-local builders in ``machines/<machine>.py``, see ``emit``); the
validator reads the resources declared here statically.  Internal actions
are carried out by the ControlPlane (cross-machine ones as declared in
``composition``); the rest go to the transport or the scheduler.

Actions are frozen ``msgspec.Struct`` classes (see ``base.Action``): one is
built per emitted row entry on the hot path, and a Struct's constructor is
C (about 45 ns for three fields against 120 ns for an attrs slots class's
generated ``__init__``).  They are hashable, compare by class and fields,
and have no converters: builders pass tuples where a field says ``tuple``.
Each class says ``frozen=True`` again, though a Struct inherits it, for mypy.
"""
from __future__ import annotations

from typing import ClassVar


from .base import Action, declared
from .recv_failure import RecvFailure


# ------------------------------------------------------------- heartbeats (internal)
class StartHeartbeat(Action, frozen=True):
    engine_id: str
    remote_request_id: str
    ranks: tuple
    internal: ClassVar[bool] = True
    acquires: ClassVar[frozenset[str]] = frozenset({"heartbeat"})


class StopHeartbeat(Action, frozen=True):
    engine_id: str
    remote_request_id: str
    internal: ClassVar[bool] = True
    releases: ClassVar[frozenset[str]] = frozenset({"heartbeat"})


class SendHeartbeat(Action, frozen=True):
    """One batched ``HB:`` message for one remote engine, to every rank."""

    engine_id: str
    ranks: tuple
    request_ids: tuple


# --------------------------------------------------------- engine references (internal)
class AcquireEngine(Action, frozen=True):
    engine_id: str
    kind: str
    key: str
    internal: ClassVar[bool] = True
    acquires: ClassVar[frozenset[str]] = frozenset({"engine_ref"})


class ReleaseEngine(Action, frozen=True):
    engine_id: str
    kind: str
    key: str
    internal: ClassVar[bool] = True
    releases: ClassVar[frozenset[str]] = frozenset({"engine_ref"})


class NoteActivity(Action, frozen=True):
    """Internal: refresh the engine's liveness (any READ/WRITE/completion)."""

    engine_id: str
    internal: ClassVar[bool] = True


class SupersedeEngine(Action, frozen=True):
    """A request's params name a newer incarnation of the engine than the
    one connected: the connected one is gone (drop it; the next reference
    handshakes afresh)."""

    engine_id: str
    internal: ClassVar[bool] = True


class WakeRequesters(Action, frozen=True):
    engine_id: str
    requesters: tuple
    clock_offset: float = 0.0
    internal: ClassVar[bool] = True


class FailRequesters(Action, frozen=True):
    engine_id: str
    requesters: tuple
    reason: str = ""
    internal: ClassVar[bool] = True


# ------------------------------------------------------------------- transport
class StartHandshake(Action, frozen=True):
    engine_id: str
    attempt: int


class RemoveRemoteAgent(Action, frozen=True):
    engine_id: str
    releases: ClassVar[frozenset[str]] = frozenset({"remote_agent"})


class PostRead(Action, frozen=True):
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


class PostWrite(Action, frozen=True):
    request_id: str
    engine_id: str
    remote_request_id: str
    local_block_ids: tuple
    remote_block_ids: tuple
    acquires: ClassVar[frozenset[str]] = frozenset({"xfer"})


class ReleaseXfer(Action, frozen=True):
    """Release the transfer handle; ``cancel`` when it may still be in flight."""

    request_id: str
    cancel: bool = False
    releases: ClassVar[frozenset[str]] = frozenset({"xfer"})


class SendNotif(Action, frozen=True):
    """Notify-only completion: tell the remote its blocks are no longer needed."""

    engine_id: str
    remote_request_id: str
    expected_consumers: int = 1


class SendPushRegistration(Action, frozen=True):
    """``PUSH_REG``: our blocks await the remote's WRITE until ``deadline`` (our
    clock), when we give up and may reuse them."""

    request_id: str
    engine_id: str
    remote_request_id: str
    block_ids: tuple
    deadline: float | None = None


# ------------------------------------------------------------------- scheduler
class ReportRecv(Action, frozen=True, omit_defaults=True):
    """Tell the scheduler an awaited recv finished; reported exactly once.
    A failed one names why (``reason``; None when ``ok``).

    ``omit_defaults``: the event log writes ``reason`` only when set, so a
    success reads as before the field existed, and a recorded line without
    it (an older log) reads as None.  ``failed_block_ids`` has no default,
    so it is always written, as it always was."""

    request_id: str
    ok: bool
    failed_block_ids: tuple
    reason: RecvFailure | None = None
    releases: ClassVar[frozenset[str]] = frozenset({"report"})


class FreeBlocks(Action, frozen=True):
    request_id: str
    block_ids: tuple
    reason: str = ""
    releases: ClassVar[frozenset[str]] = frozenset({"blocks"})


class GrantHold(Action, frozen=True):
    """Internal: keep a finished decode request's blocks for turn 2 (fixed TTL lease)."""

    request_id: str
    block_ids: tuple
    internal: ClassVar[bool] = True


class ConsumeLease(Action, frozen=True):
    """Internal: a push WRITE completed, which consumes the lease like a READ."""

    request_id: str
    consumer: str
    internal: ClassVar[bool] = True


class RefuseNotification(Action, frozen=True):
    """A heartbeat or completion a lease refused; nothing changed.  For the
    embedder to count and log (a forged or misdirected message)."""

    request_id: str
    sender: str | None
    reason: str
    abstract: ClassVar[bool] = True  # the common base of the refusals below


class RefuseForeignSender(RefuseNotification, frozen=True):
    """From a sender the lease is not bound to (lease), or a push completion
    not from the engine the request reads (decode_request)."""


class RefuseWrongCount(RefuseNotification, frozen=True):
    """A completion whose consumer count disagrees with the lease's plan."""


# Every action the machines' tables name, by name (the event log resolves
# names here; ArmTimer/CancelTimer, the framework's, are added there).
ALL_ACTIONS: dict[str, type[Action]] = declared(Action, __name__)
