"""Every instruction a transition can emit.

``build(inst, event, config, now)`` constructs the action from the machine
instance and the triggering event, so transition tables list action classes
only and the validator can read their resource effects statically.
Internal actions are carried out by the ControlPlane; the rest go to the
transport or the scheduler.
"""
from __future__ import annotations

from typing import ClassVar

import attrs

from .base import Action


def _ids(value) -> tuple:
    return tuple(value)


# ------------------------------------------------------------- heartbeats (internal)
@attrs.frozen
class StartHeartbeat(Action):
    engine_id: str
    remote_request_id: str
    ranks: tuple = attrs.field(converter=_ids)
    internal: ClassVar[bool] = True
    acquires: ClassVar[frozenset[str]] = frozenset({"heartbeat"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.engine_id, inst.remote_request_id, inst.ranks)


@attrs.frozen
class StopHeartbeat(Action):
    engine_id: str
    remote_request_id: str
    internal: ClassVar[bool] = True
    releases: ClassVar[frozenset[str]] = frozenset({"heartbeat"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.engine_id, inst.remote_request_id)


@attrs.frozen
class SendHeartbeat(Action):
    """One batched ``HB:`` message for one remote engine, to every rank."""

    engine_id: str
    ranks: tuple = attrs.field(converter=_ids)
    request_ids: tuple = attrs.field(converter=_ids)

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.engine_id, tuple(sorted(inst.ranks)), tuple(inst.ids))


# --------------------------------------------------------- engine references (internal)
@attrs.frozen
class AcquireEngine(Action):
    engine_id: str
    kind: str
    key: str
    internal: ClassVar[bool] = True
    acquires: ClassVar[frozenset[str]] = frozenset({"engine_ref"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.engine_id, inst.KIND, inst.key)


@attrs.frozen
class ReleaseEngine(Action):
    engine_id: str
    kind: str
    key: str
    internal: ClassVar[bool] = True
    releases: ClassVar[frozenset[str]] = frozenset({"engine_ref"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.engine_id, inst.KIND, inst.key)


@attrs.frozen
class NoteActivity(Action):
    """Internal: refresh the engine's liveness (any READ/WRITE/completion)."""

    engine_id: str
    internal: ClassVar[bool] = True

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.engine_id)


@attrs.frozen
class WakeRequesters(Action):
    engine_id: str
    requesters: tuple = attrs.field(converter=_ids)
    clock_offset: float = 0.0
    internal: ClassVar[bool] = True

    @classmethod
    def build(cls, inst, ev, cfg, now):
        # On Acquire of a connected engine only the new requester is woken.
        if hasattr(ev, "requester_key"):
            return cls(inst.key, ((ev.requester_kind, ev.requester_key),), inst.clock_offset)
        return cls(inst.key, inst.woken, inst.clock_offset)


@attrs.frozen
class FailRequesters(Action):
    engine_id: str
    requesters: tuple = attrs.field(converter=_ids)
    reason: str = ""
    internal: ClassVar[bool] = True

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key, tuple(sorted(inst.refs)), getattr(ev, "reason", "") or inst.state.lower())


# ------------------------------------------------------------------- transport
@attrs.frozen
class StartHandshake(Action):
    engine_id: str
    attempt: int

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key, inst.attempts)


@attrs.frozen
class RemoveRemoteAgent(Action):
    engine_id: str
    releases: ClassVar[frozenset[str]] = frozenset({"remote_agent"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key)


@attrs.frozen
class PostRead(Action):
    """READ the remote blocks into ours.  The transport attaches the completion
    notification (``remote_request_id``, ``expected_consumers``), which NIXL
    delivers to the remote when the READ completes."""

    request_id: str
    engine_id: str
    remote_request_id: str
    local_block_ids: tuple = attrs.field(converter=_ids)
    remote_block_ids: tuple = attrs.field(converter=_ids)
    expected_consumers: int = 1
    acquires: ClassVar[frozenset[str]] = frozenset({"xfer"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key, inst.engine_id, inst.remote_request_id, inst.block_ids,
                   inst.remote_block_ids, inst.expected_consumers)


@attrs.frozen
class PostWrite(Action):
    request_id: str
    engine_id: str
    remote_request_id: str
    local_block_ids: tuple = attrs.field(converter=_ids)
    remote_block_ids: tuple = attrs.field(converter=_ids)
    acquires: ClassVar[frozenset[str]] = frozenset({"xfer"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        # The transport attaches the completion notif "<remote_request_id>:1".
        return cls(inst.key, inst.engine_id, inst.remote_request_id, inst.block_ids, inst.remote_block_ids)


@attrs.frozen
class ReleaseXfer(Action):
    """Release the transfer handle; ``cancel`` when it may still be in flight."""

    request_id: str
    cancel: bool = False
    releases: ClassVar[frozenset[str]] = frozenset({"xfer"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key, False)


class CancelXfer(ReleaseXfer):
    """ReleaseXfer for a transfer that has not completed (deadline, abort, peer lost)."""

    __slots__ = ()

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return ReleaseXfer(inst.key, True)


@attrs.frozen
class SendNotif(Action):
    """Notify-only completion: tell the remote its blocks are no longer needed."""

    engine_id: str
    remote_request_id: str
    expected_consumers: int = 1

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.engine_id, inst.remote_request_id, inst.expected_consumers)


@attrs.frozen
class SendPushRegistration(Action):
    """``PUSH_REG``: our blocks await the remote's WRITE until ``deadline`` (our
    clock), when we give up and may reuse them."""

    request_id: str
    engine_id: str
    remote_request_id: str
    block_ids: tuple = attrs.field(converter=_ids)
    deadline: float | None = None

    @classmethod
    def build(cls, inst, ev, cfg, now):
        # The deadline of the AWAITING_PUSH state this registration enters.
        return cls(inst.key, inst.engine_id, inst.remote_request_id, inst.block_ids, inst.push_give_up())


# ------------------------------------------------------------------- scheduler
@attrs.frozen
class ReportRecv(Action):
    """Tell the scheduler an awaited recv finished; reported exactly once."""

    request_id: str
    ok: bool
    failed_block_ids: tuple = attrs.field(converter=_ids, default=())
    releases: ClassVar[frozenset[str]] = frozenset({"report"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key, True)


class ReportRecvFailed(ReportRecv):
    """ReportRecv(ok=False) naming the blocks whose load failed."""

    __slots__ = ()

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return ReportRecv(inst.key, False, inst.block_ids)


@attrs.frozen
class FreeBlocks(Action):
    request_id: str
    block_ids: tuple = attrs.field(converter=_ids)
    reason: str = ""
    releases: ClassVar[frozenset[str]] = frozenset({"blocks"})

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key, inst.block_ids, _FREE_REASONS.get(type(ev).__name__, type(ev).__name__))


_FREE_REASONS = {"TimerFired": "expired", "ConsumerDone": "consumed", "LeaseAbort": "aborted"}


@attrs.frozen
class GrantHold(Action):
    """Internal: keep a finished decode request's blocks for turn 2 (fixed TTL lease)."""

    request_id: str
    block_ids: tuple = attrs.field(converter=_ids)
    internal: ClassVar[bool] = True

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key, ev.block_ids or inst.block_ids)


@attrs.frozen
class ConsumeLease(Action):
    """Internal: a push WRITE completed, which consumes the lease like a READ."""

    request_id: str
    consumer: str
    internal: ClassVar[bool] = True

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key, inst.engine_id)


@attrs.frozen
class RefuseNotification(Action):
    """A heartbeat or completion a lease refused; nothing changed.  For the
    embedder to count and log (a forged or misdirected message)."""

    request_id: str
    sender: str | None
    reason: str
    REASON: ClassVar[str] = "refused"

    @classmethod
    def build(cls, inst, ev, cfg, now):
        return cls(inst.key, ev.sender, cls.REASON)


@attrs.frozen
class RefuseForeignSender(RefuseNotification):
    """From a sender the lease is not bound to."""

    REASON: ClassVar[str] = "foreign_sender"


@attrs.frozen
class RefuseWrongCount(RefuseNotification):
    """A completion whose consumer count disagrees with the lease's plan."""

    REASON: ClassVar[str] = "wrong_consumer_count"


ALL_ACTIONS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        StartHeartbeat, StopHeartbeat, SendHeartbeat, AcquireEngine, ReleaseEngine, NoteActivity,
        WakeRequesters, FailRequesters, StartHandshake, RemoveRemoteAgent, PostRead, PostWrite,
        ReleaseXfer, SendNotif, SendPushRegistration, ReportRecv, FreeBlocks, GrantHold, ConsumeLease,
        RefuseForeignSender, RefuseWrongCount,
    )
}
