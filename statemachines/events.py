"""Every stimulus the machines understand.

``machine`` routes an event to a machine kind, ``key_field`` to one instance.
Events marked internal in their docstring are produced by the ControlPlane
from another machine's actions; the rest come from the scheduler, the worker
or the transport.

Events are mutable attrs slots classes (a frozen one sets each field through
object.__setattr__); nothing mutates one once built, and they stay hashable.
The internal events the plane builds on every request from a wire (engine
references, wake-ups, activity, heartbeat registration) are frozen msgspec
Structs instead (``base.StructEvent``: built in C, for a third of the cost).
Fields an embedder fills from its own lists keep a converter to a tuple.
Events are built by keyword only, except those the plane builds itself: a
class called with keywords costs about twice a positional call, and the
plane's wires (wire_executor) pass their fields in order.
"""
from __future__ import annotations

from typing import Any, ClassVar

import attrs

from . import actions as A
from .base import Event, StructEvent, TimerFired, declared

def _ids(value: Any) -> tuple:
    return tuple(value)


# ----------------------------------------------------------------- decode side
@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class NewRequest(Event):
    """on_new_request: a request with remote KV arrives (before scheduling)."""

    request_id: str
    engine_id: str
    remote_request_id: str
    remote_block_ids: tuple = attrs.field(converter=_ids, default=())
    remote_ranks: tuple = attrs.field(converter=_ids, default=(0,))
    # Consumers P planned for these blocks; echoed in the completion notif.
    expected_consumers: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    # Remote expiry of the blocks, in the remote engine's clock (turn-2 reads
    # of blocks a decoder holds); None when the remote gave no deadline.
    remote_expiry: float | None = None
    # The remote extends the expiry on our heartbeats (P's lease); a
    # decoder's hold for turn 2 is not renewable.
    remote_renewable: bool = False
    push: bool = False
    # The holder's incarnation when it granted the blocks (its params say;
    # None: not said, not checked).  A restarted engine keeps its engine id
    # but is another incarnation: it does not hold these blocks.
    remote_incarnation: str | None = None
    machine: ClassVar[str] = "decode_request"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class BlocksAllocated(Event):
    """update_state_after_alloc: local blocks allocated for the request.

    ``awaiting`` says whether the scheduler waits for this recv to be
    reported; a full-prefix hit may be notify-only.
    """

    request_id: str
    block_ids: tuple = attrs.field(converter=_ids, default=())
    num_remote_tokens: int = 0
    awaiting: bool = True
    machine: ClassVar[str] = "decode_request"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class StartLoad(Event):
    """start_load_kv on the worker: the load may begin."""

    request_id: str
    machine: ClassVar[str] = "decode_request"


class EngineReady(StructEvent, frozen=True):
    """Internal: the remote engine a requester waits on is connected."""

    kind: str
    request_id: str
    engine_id: str
    clock_offset: float = 0.0
    # Our heartbeats to this engine (our clock): the last batch, and the first
    # of the unbroken chain it ends (see machines/heartbeat.py, read_gate.py).
    heartbeat_at: float | None = None
    heartbeats_since: float | None = None
    # The incarnation the engine's handshake named (None: it named none).
    incarnation: str | None = None
    machine: ClassVar[str] = ""  # routed by ``kind``


class EngineLost(StructEvent, frozen=True):
    """Internal: the remote engine was evicted, disconnected or never reached."""

    kind: str
    request_id: str
    engine_id: str
    reason: str = ""
    machine: ClassVar[str] = ""


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class ReadDone(Event):
    """The posted READ completed (transport)."""

    request_id: str
    machine: ClassVar[str] = "decode_request"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class ReadFailed(Event):
    request_id: str
    reason: str = ""
    machine: ClassVar[str] = "decode_request"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class PushDone(Event):
    """Push mode, decode side: P notified that its WRITE into our blocks
    completed.  ``sender``: the engine the notification came from (None:
    in-process, trusted); only the engine the request reads from may say so."""

    request_id: str
    sender: str | None = None
    machine: ClassVar[str] = "decode_request"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class RequestRunning(Event):
    """The scheduler runs the request (after a reported recv)."""

    request_id: str
    machine: ClassVar[str] = "decode_request"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class RequestFinished(Event):
    """request_finished on the decode side.  ``hold_for_next_turn`` keeps the
    blocks for a bidirectional turn 2 under a fixed TTL lease."""

    request_id: str
    block_ids: tuple = attrs.field(converter=_ids, default=())
    hold_for_next_turn: bool = False
    machine: ClassVar[str] = "decode_request"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class Abort(Event):
    """The scheduler dropped the request.  A recv it awaited is still reported
    (as failed): its blocks may not be freed while a READ could write them."""

    request_id: str
    machine: ClassVar[str] = "decode_request"


# -------------------------------------------------------------- lease (P, or D hold)
@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class LeaseGranted(Event):
    """Blocks handed to the lease: P after prefill, or D holding for turn 2.

    ``renewable`` leases are extended by heartbeats; a decoder's hold has a
    fixed TTL.
    """

    request_id: str
    block_ids: tuple = attrs.field(converter=_ids, default=())
    expected_consumers: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    duration: float | None = None  # None: config.kv_lease_duration
    renewable: bool = True
    machine: ClassVar[str] = "lease"
    acquires: ClassVar[frozenset[str]] = frozenset({"blocks"})


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class LeaseHeartbeat(Event):
    """One id of a ``HB:`` notification from ``sender`` (the engine the
    transport says sent it; None for a stimulus without one)."""

    request_id: str
    sender: str | None = None
    machine: ClassVar[str] = "lease"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class ConsumerDone(Event):
    """Completion notification ``<id>:<expected_consumers>`` from ``consumer``
    (the engine that sent it)."""

    request_id: str
    consumer: str
    expected_consumers: int
    machine: ClassVar[str] = "lease"

    @property
    def sender(self) -> str:
        return self.consumer


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class LeaseAbort(Event):
    request_id: str
    machine: ClassVar[str] = "lease"


# ------------------------------------------------------------ push write (P side)
@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class PushRegistered(Event):
    """``PUSH_REG`` from D: its blocks are registered and waiting for our WRITE."""

    request_id: str
    engine_id: str
    remote_request_id: str
    remote_block_ids: tuple = attrs.field(converter=_ids, default=())
    # When D gives up waiting for the WRITE, in D's clock (its AWAITING_PUSH
    # deadline); after it D may reuse the blocks.  None: D sent no deadline.
    remote_deadline: float | None = None
    machine: ClassVar[str] = "push_write"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class PushReady(Event):
    """Internal: P's prefill finished and its blocks are leased; WRITE may start."""

    request_id: str
    block_ids: tuple = attrs.field(converter=_ids, default=())
    machine: ClassVar[str] = "push_write"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class WriteDone(Event):
    request_id: str
    machine: ClassVar[str] = "push_write"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class WriteFailed(Event):
    request_id: str
    reason: str = ""
    machine: ClassVar[str] = "push_write"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class PushAbort(Event):
    request_id: str
    machine: ClassVar[str] = "push_write"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class SourceEnded(Event):
    """Internal: the resource this machine uses is no longer held by its
    source (a push's lease expired, was released or aborted, or was never
    held when the push needed it); see ``spec.Source``."""

    kind: str
    request_id: str
    # The source's state now; None when there is no such instance.
    source_state: str | None = None
    machine: ClassVar[str] = ""  # routed by ``kind``


# ------------------------------------------------------------------ remote engine
class EngineAcquire(StructEvent, frozen=True):
    """Internal: a requester needs this engine connected and holds a reference."""

    engine_id: str
    requester_kind: str
    requester_key: str
    machine: ClassVar[str] = "remote_engine"
    key_field: ClassVar[str] = "engine_id"


class EngineRelease(StructEvent, frozen=True):
    """Internal: a requester drops its reference."""

    engine_id: str
    requester_kind: str
    requester_key: str
    machine: ClassVar[str] = "remote_engine"
    key_field: ClassVar[str] = "engine_id"


class HeartbeatRegister(StructEvent, frozen=True):
    """Internal: keep a peer request id in the engine's heartbeat batches."""

    engine_id: str
    request_id: str
    ranks: tuple = (0,)
    machine: ClassVar[str] = "heartbeat"
    key_field: ClassVar[str] = "engine_id"


class HeartbeatUnregister(StructEvent, frozen=True):
    """Internal: one registration of the id ends."""

    engine_id: str
    request_id: str
    machine: ClassVar[str] = "heartbeat"
    key_field: ClassVar[str] = "engine_id"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class HandshakeOk(Event):
    """The side-channel handshake succeeded and the remote agent was added.

    ``samples`` are (clock_offset, rtt) pairs; the lowest-RTT one is kept.
    """

    engine_id: str
    samples: tuple = attrs.field(converter=lambda v: tuple(tuple(s) for s in v), default=())
    notify_only: bool = False
    # The incarnation the peer's handshake reply named: a token its process
    # made at start (None: the reply named none).
    incarnation: str | None = None
    machine: ClassVar[str] = "remote_engine"
    key_field: ClassVar[str] = "engine_id"
    acquires: ClassVar[frozenset[str]] = frozenset({"remote_agent"})

    def refund(self):
        # The transport added the remote agent before reporting success; a
        # result nobody waits for any more (engine evicted) must remove it.
        return A.RemoveRemoteAgent(self.engine_id)


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class HandshakeFailed(Event):
    engine_id: str
    reason: str = ""
    machine: ClassVar[str] = "remote_engine"
    key_field: ClassVar[str] = "engine_id"


class EngineActivity(StructEvent, frozen=True):
    """Anything observed from or done to the engine: READ, WRITE, completion, heartbeat."""

    engine_id: str
    machine: ClassVar[str] = "remote_engine"
    key_field: ClassVar[str] = "engine_id"


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class PeerDisconnected(Event):
    engine_id: str
    reason: str = ""
    machine: ClassVar[str] = "remote_engine"
    key_field: ClassVar[str] = "engine_id"


# Every event of the machines, by name (the event log resolves names here).
ALL_EVENTS: dict[str, type[Event]] = declared(Event, TimerFired.__module__, __name__)
