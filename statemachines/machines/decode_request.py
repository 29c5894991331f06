"""Decode-side request: pulls remote KV blocks (or receives a push).

Also used by a prefill instance reading a decoder's held blocks for a
bidirectional turn 2: the reader is the consumer, whatever its role, and
the turn-2 expiry gate applies whenever the remote sent an expiry.

The "report" resource is the duty to tell the scheduler that an awaited
recv finished.  It is held exactly in the states where the scheduler
awaits, and only ReportRecv releases it, so the validator proves that an
awaited recv is reported exactly once and a notify-only one never is.
"""
from __future__ import annotations

from typing import ClassVar

import attrs

from .. import read_gate
from ..actions import (
    AcquireEngine, CancelXfer, GrantHold, NoteActivity, PostRead, ReleaseEngine, ReleaseXfer,
    ReportRecv, ReportRecvFailed, SendNotif, SendPushRegistration, StartHeartbeat, StopHeartbeat,
)
from ..base import Instance, TimerFired
from ..events import (
    Abort, BlocksAllocated, EngineLost, EngineReady, NewRequest, PushDone, ReadDone, ReadFailed,
    RequestFinished, RequestRunning, StartLoad,
)
from ..spec import Spec, State
from ..table import error, ignore, on, rows


@attrs.define(slots=True)
class DecodeRequest(Instance):
    KIND: ClassVar[str] = "decode_request"
    engine_id: str = ""
    remote_request_id: str = ""
    remote_block_ids: tuple = ()
    ranks: tuple = (0,)
    expected_consumers: int = 1
    remote_expiry: float | None = None
    remote_renewable: bool = False
    arrived: float = 0.0
    push: bool = False
    block_ids: tuple = ()
    num_remote_tokens: int = 0
    recv_deadline: float = 0.0
    push_deadline: float = 0.0
    transfer_deadline: float = 0.0
    clock_offset: float = 0.0

    def push_give_up(self) -> float:
        """When we stop waiting for a push (our clock): the AWAITING_PUSH
        deadline, and the deadline sent in PUSH_REG, so the WRITE the remote
        bounds by it is over (done or cancelled) before we reuse the blocks."""
        return min(self.recv_deadline, self.push_deadline)


# ----------------------------------------------------------------- effects
def _accept(r: DecodeRequest, ev: NewRequest, cfg, now) -> None:
    r.engine_id = ev.engine_id
    r.remote_request_id = ev.remote_request_id
    r.remote_block_ids = ev.remote_block_ids
    r.ranks = ev.remote_ranks
    r.expected_consumers = ev.expected_consumers
    r.remote_expiry = ev.remote_expiry
    r.remote_renewable = ev.remote_renewable
    r.arrived = now
    r.push = ev.push


def _allocated(r: DecodeRequest, ev: BlocksAllocated, cfg, now) -> None:
    r.block_ids = ev.block_ids
    r.num_remote_tokens = ev.num_remote_tokens
    r.recv_deadline = now + cfg.recv_timeout


def _connected(r: DecodeRequest, ev: EngineReady, cfg, now) -> None:
    r.clock_offset = ev.clock_offset
    r.transfer_deadline = now + cfg.transfer_timeout
    # A READ must also end before the remote blocks may be gone: otherwise a
    # READ stalled with us (SIGSTOP) could complete into reclaimed blocks.
    # The driver fires due deadlines before it polls completions.
    valid_until = remote_valid_until(r, ev, cfg)
    if valid_until is not None:
        r.transfer_deadline = min(r.transfer_deadline, valid_until)
    r.push_deadline = now + cfg.push_registration_timeout


# ------------------------------------------------------------------ guards
def has_remote_tokens(r, ev: BlocksAllocated, cfg, now) -> bool:
    """remote tokens > 0"""
    return ev.num_remote_tokens > 0


def awaited(r, ev: BlocksAllocated, cfg, now) -> bool:
    """0 remote tokens, awaited"""
    return ev.awaiting


def full_prefix_hit(r: DecodeRequest, ev, cfg, now) -> bool:
    """full prefix hit: notify only"""
    return r.num_remote_tokens == 0


def remote_blocks_expired(r: DecodeRequest, ev: EngineReady, cfg, now) -> bool:
    """remote blocks not valid beyond now + margin"""
    return read_gate.declines(gate_inputs(r, ev), cfg, now)


def remote_valid_until(r: DecodeRequest, ev: EngineReady, cfg) -> float | None:
    """Until when (our clock) the remote blocks are surely still held (see
    read_gate.valid_until)."""
    return read_gate.valid_until(gate_inputs(r, ev), cfg)


def gate_inputs(r: DecodeRequest, ev: EngineReady) -> read_gate.GateInputs:
    """What the READ gate reads: the remote's expiry from the request, the
    clock offset and our heartbeat chain from the wake-up."""
    return read_gate.GateInputs(expiry=r.remote_expiry, renewable=r.remote_renewable, clock_offset=ev.clock_offset,
                                arrived=r.arrived, chain_since=ev.heartbeats_since, chain_last=ev.heartbeat_at)


def push_mode(r: DecodeRequest, ev, cfg, now) -> bool:
    """push mode"""
    return r.push


def hold_for_next_turn(r, ev: RequestFinished, cfg, now) -> bool:
    """hold for next turn"""
    return ev.hold_for_next_turn


# --------------------------------------------------------------- states
AWAITED = {"heartbeat", "report"}
STATES = (
    State("NEW", doc="created by on_new_request"),
    State("HEARTBEATING", holds={"heartbeat"},
          doc="queued on D; heartbeats keep P's lease alive from arrival, not from scheduling"),
    State("WAITING_FOR_REMOTE_KVS", holds=AWAITED, waits_on_remote=True,
          deadline=lambda r, cfg, now: r.recv_deadline),
    State("FULL_PREFIX_HIT", holds=AWAITED, waits_on_remote=True, deadline=lambda r, cfg, now: r.recv_deadline,
          doc="0 remote tokens, scheduler awaits the (notify-only) recv"),
    State("NOTIFY_ONLY", holds={"heartbeat"}, doc="0 remote tokens, nobody awaits: notify P and vanish"),
    State("NOTIFYING", holds={"heartbeat", "engine_ref"}, waits_on_remote=True,
          deadline=lambda r, cfg, now: r.recv_deadline),
    State("HANDSHAKING", holds=AWAITED | {"engine_ref"}, waits_on_remote=True,
          deadline=lambda r, cfg, now: r.recv_deadline),
    State("READING", holds=AWAITED | {"engine_ref", "xfer"}, waits_on_remote=True,
          deadline=lambda r, cfg, now: min(r.recv_deadline, r.transfer_deadline)),
    State("AWAITING_PUSH", holds=AWAITED | {"engine_ref"}, waits_on_remote=True,
          deadline=lambda r, cfg, now: r.push_give_up()),
    State("RECV_DONE"),
    State("RECV_FAILED", doc="reported failed; kv_load_failure_policy decides recompute or fail"),
    State("RUNNING"),
    State("RELEASED", terminal=True),
    State("ABORTED", terminal=True),
)

EVENTS = (NewRequest, BlocksAllocated, StartLoad, EngineReady, EngineLost, ReadDone, ReadFailed,
          PushDone, RequestRunning, RequestFinished, Abort, TimerFired)

ACTIVE = ["HEARTBEATING", "WAITING_FOR_REMOTE_KVS", "FULL_PREFIX_HIT", "NOTIFY_ONLY", "NOTIFYING",
          "HANDSHAKING", "READING", "AWAITING_PUSH", "RECV_DONE", "RECV_FAILED", "RUNNING"]
AFTER_ALLOC = ACTIVE[1:]
UNTIL_RECV = ["HEARTBEATING", "WAITING_FOR_REMOTE_KVS", "FULL_PREFIX_HIT", "NOTIFY_ONLY"]
FINISHED_RECV = ["RECV_DONE", "RECV_FAILED", "RUNNING"]
NO_ENGINE_WAIT = [s for s in ACTIVE if s not in ("HANDSHAKING", "NOTIFYING")]
NO_XFER = [s for s in ACTIVE if s != "READING"]
NO_PUSH = [s for s in ACTIVE if s != "AWAITING_PUSH"]
GIVE_UP = (StopHeartbeat, ReleaseEngine, ReportRecvFailed)

TABLE = rows(
    on("NEW", NewRequest, "HEARTBEATING", StartHeartbeat, do=_accept),
    error("NEW", EVENTS[1:-1], "no event precedes on_new_request"),
    ignore(ACTIVE, NewRequest, "duplicate on_new_request for a live request"),

    # Allocation decides what the scheduler awaits.
    on("HEARTBEATING", BlocksAllocated, "WAITING_FOR_REMOTE_KVS", when=has_remote_tokens, do=_allocated,
       acquires={"report"}),
    on("HEARTBEATING", BlocksAllocated, "FULL_PREFIX_HIT", when=awaited, do=_allocated, acquires={"report"}),
    on("HEARTBEATING", BlocksAllocated, "NOTIFY_ONLY", do=_allocated),
    error(AFTER_ALLOC, BlocksAllocated, "blocks allocated twice"),

    on(["WAITING_FOR_REMOTE_KVS", "FULL_PREFIX_HIT"], StartLoad, "HANDSHAKING", AcquireEngine),
    on("NOTIFY_ONLY", StartLoad, "NOTIFYING", AcquireEngine),
    error("HEARTBEATING", StartLoad, "load started before blocks were allocated"),
    ignore(["NOTIFYING", "HANDSHAKING", "READING", "AWAITING_PUSH"] + FINISHED_RECV, StartLoad,
           "load already started (the worker repeats start_load_kv each step)"),

    # The engine is connected: gate, then read, notify, or register for push.
    # A full prefix hit reads nothing remote, so the expiry gate does not apply.
    on("HANDSHAKING", EngineReady, "RECV_DONE", SendNotif, StopHeartbeat, ReleaseEngine, ReportRecv,
       when=full_prefix_hit),
    on("HANDSHAKING", EngineReady, "RECV_FAILED", *GIVE_UP, when=remote_blocks_expired),
    on("HANDSHAKING", EngineReady, "AWAITING_PUSH", SendPushRegistration, when=push_mode, do=_connected),
    on("HANDSHAKING", EngineReady, "READING", PostRead, do=_connected),
    on("NOTIFYING", EngineReady, "RELEASED", SendNotif, StopHeartbeat, ReleaseEngine),
    ignore(NO_ENGINE_WAIT, EngineReady, "stale wake-up: the request no longer waits for the engine"),

    on("HANDSHAKING", [EngineLost, TimerFired], "RECV_FAILED", *GIVE_UP),
    on("NOTIFYING", [EngineLost, TimerFired], "RELEASED", StopHeartbeat, ReleaseEngine),
    on("READING", [EngineLost, TimerFired], "RECV_FAILED", CancelXfer, *GIVE_UP),
    on("AWAITING_PUSH", [EngineLost, TimerFired], "RECV_FAILED", *GIVE_UP),
    on(["WAITING_FOR_REMOTE_KVS", "FULL_PREFIX_HIT"], TimerFired, "RECV_FAILED", StopHeartbeat, ReportRecvFailed),
    ignore([s for s in ACTIVE if s not in ("HANDSHAKING", "NOTIFYING", "READING", "AWAITING_PUSH")], EngineLost,
           "the request holds no reference to the engine here"),

    # Transfer results.
    on("READING", ReadDone, "RECV_DONE", ReleaseXfer, NoteActivity, StopHeartbeat, ReleaseEngine, ReportRecv),
    on("READING", ReadFailed, "RECV_FAILED", ReleaseXfer, *GIVE_UP),
    ignore(NO_XFER, [ReadDone, ReadFailed], "late completion of a transfer already released"),
    on("AWAITING_PUSH", PushDone, "RECV_DONE", NoteActivity, StopHeartbeat, ReleaseEngine, ReportRecv),
    ignore(NO_PUSH, PushDone, "late or duplicate push completion"),

    # After the recv: the scheduler runs and finishes the request.
    on(["RECV_DONE", "RECV_FAILED"], RequestRunning, "RUNNING"),
    ignore("RUNNING", RequestRunning, "already running"),
    error(UNTIL_RECV + ["NOTIFYING", "HANDSHAKING", "READING", "AWAITING_PUSH"], RequestRunning,
          "scheduled before its recv was reported"),
    on(FINISHED_RECV, RequestFinished, "RELEASED", GrantHold, when=hold_for_next_turn),
    on(FINISHED_RECV, RequestFinished, "RELEASED"),
    error(UNTIL_RECV + ["NOTIFYING", "HANDSHAKING", "READING", "AWAITING_PUSH"], RequestFinished,
          "finished before its recv was reported (abort instead)"),

    # Abort: release everything held; an awaited recv is still reported.
    on(["HEARTBEATING", "NOTIFY_ONLY"], Abort, "ABORTED", StopHeartbeat),
    on(["WAITING_FOR_REMOTE_KVS", "FULL_PREFIX_HIT"], Abort, "ABORTED", StopHeartbeat, ReportRecvFailed),
    on("NOTIFYING", Abort, "ABORTED", StopHeartbeat, ReleaseEngine),
    on(["HANDSHAKING", "AWAITING_PUSH"], Abort, "ABORTED", *GIVE_UP),
    on("READING", Abort, "ABORTED", CancelXfer, *GIVE_UP),
    on(FINISHED_RECV, Abort, "ABORTED"),
)

SPEC = Spec(
    name="decode_request",
    instance_type=DecodeRequest,
    initial="NEW",
    states=STATES,
    events=EVENTS,
    table=TABLE,
    fail_closed_event=Abort,
    doc=__doc__,
)
