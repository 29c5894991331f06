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

from enum import StrEnum
from typing import ClassVar

import attrs

from .. import read_gate
from ..actions import (
    GrantHold, PostRead, RefuseForeignSender, ReportRecv, SendNotif, SupersedeEngine,
    SendPushRegistration, StartHeartbeat, StopHeartbeat,
)
from ..base import Instance, TimerFired
from ..emit import Emit, emits
from ..events import (
    Abort, BlocksAllocated, EngineLost, EngineReady, NewRequest, PushDone, ReadDone, ReadFailed,
    RequestFinished, RequestRunning, StartLoad,
)
from ..recv_failure import RecvFailure
from ..spec import MachineDefinitionError, Spec, State
from ..table import error, ignore, on, rows
from .engine_refs import acquire_engine, note_activity, release_engine
from .transfers import cancel_xfer, release_xfer


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
    remote_incarnation: str | None = None
    superseded: bool = False  # it dropped an older incarnation of the engine once

    def push_give_up(self) -> float:
        """When we stop waiting for a push (our clock): the AWAITING_PUSH
        deadline, and the deadline sent in PUSH_REG, so the WRITE the remote
        bounds by it is over (done or cancelled) before we reuse the blocks."""
        return min(self.recv_deadline, self.push_deadline)


# ----------------------------------------------------------------- effects
def _accept(r: DecodeRequest, ev: NewRequest, cfg, now) -> None:
    """Keep what on_new_request says about the remote blocks; note the arrival time."""
    r.engine_id = ev.engine_id
    r.remote_request_id = ev.remote_request_id
    r.remote_block_ids = ev.remote_block_ids
    r.ranks = ev.remote_ranks
    r.expected_consumers = ev.expected_consumers
    r.remote_expiry = ev.remote_expiry
    r.remote_renewable = ev.remote_renewable
    r.arrived = now
    r.push = ev.push
    r.remote_incarnation = ev.remote_incarnation


def _allocated(r: DecodeRequest, ev: BlocksAllocated, cfg, now) -> None:
    """Keep the allocation; the whole recv must end by now + recv_timeout."""
    r.block_ids = ev.block_ids
    r.num_remote_tokens = ev.num_remote_tokens
    r.recv_deadline = now + cfg.recv_timeout


def _reading(r: DecodeRequest, ev: EngineReady, cfg, now) -> None:
    """Keep the clock offset; the READ must end by now + transfer_timeout and
    before the remote blocks may go."""
    r.clock_offset = ev.clock_offset
    r.transfer_deadline = now + cfg.transfer_timeout
    # A READ must also end before the remote blocks may be gone: otherwise a
    # READ stalled with us (SIGSTOP) could complete into reclaimed blocks.
    # The driver fires due deadlines before it polls completions.
    valid_until = remote_valid_until(r, ev, cfg)
    if valid_until is not None:
        r.transfer_deadline = min(r.transfer_deadline, valid_until)


def _awaiting_push(r: DecodeRequest, ev: EngineReady, cfg, now) -> None:
    """Keep the clock offset; the push must be registered and done by now + push_registration_timeout."""
    # Each path sets only its own deadline: a float per request in flight.
    r.clock_offset = ev.clock_offset
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
    # No expiry sent: the gate does not apply (read_gate.declines says so too;
    # asked first, it saves building the gate's inputs on every READ).
    return r.remote_expiry is not None and read_gate.declines(gate_inputs(r, ev), cfg, now)


def remote_valid_until(r: DecodeRequest, ev: EngineReady, cfg) -> float | None:
    """Until when (our clock) the remote blocks are surely still held (see
    read_gate.valid_until)."""
    return None if r.remote_expiry is None else read_gate.valid_until(gate_inputs(r, ev), cfg)


def gate_inputs(r: DecodeRequest, ev: EngineReady) -> read_gate.GateInputs:
    """What the READ gate reads: the remote's expiry from the request, the
    clock offset and our heartbeat chain from the wake-up."""
    return read_gate.GateInputs(expiry=r.remote_expiry, renewable=r.remote_renewable, clock_offset=ev.clock_offset,
                                arrived=r.arrived, chain_since=ev.heartbeats_since, chain_last=ev.heartbeat_at)


def _superseded(r: DecodeRequest, ev: EngineReady, cfg, now) -> None:
    """Once only: a second older incarnation fails the request (no loop)."""
    r.superseded = True


def older_incarnation(r: DecodeRequest, ev: EngineReady, cfg, now) -> bool:
    """the engine is an older incarnation than the holder (once)"""
    # Incarnations start with their start time (hex, fixed width): the
    # order only decides whether to handshake again; reading needs equality.
    return (not r.superseded and r.remote_incarnation is not None and ev.incarnation is not None
            and ev.incarnation < r.remote_incarnation)


def other_incarnation(r: DecodeRequest, ev: EngineReady, cfg, now) -> bool:
    """the engine is not the incarnation that holds the blocks"""
    # Fail closed: params that name an incarnation match only a handshake
    # that names the same one (a restarted engine keeps its engine id, not
    # the blocks, nor the lease, of its predecessor).
    return r.remote_incarnation is not None and ev.incarnation != r.remote_incarnation


def push_mode(r: DecodeRequest, ev, cfg, now) -> bool:
    """push mode"""
    return r.push


def foreign_pusher(r: DecodeRequest, ev: PushDone, cfg, now) -> bool:
    """not from the engine it reads"""
    return ev.sender is not None and ev.sender != r.engine_id


def hold_for_next_turn(r, ev: RequestFinished, cfg, now) -> bool:
    """hold for next turn"""
    return ev.hold_for_next_turn


# ----------------------------------------------------------------- actions
@emits(StartHeartbeat)
def start_heartbeat(r: DecodeRequest, ev, cfg, now) -> StartHeartbeat:
    return StartHeartbeat(r.engine_id, r.remote_request_id, r.ranks)


@emits(StopHeartbeat)
def stop_heartbeat(r: DecodeRequest, ev, cfg, now) -> StopHeartbeat:
    return StopHeartbeat(r.engine_id, r.remote_request_id)


@emits(PostRead)
def post_read(r: DecodeRequest, ev, cfg, now) -> PostRead:
    return PostRead(r.key, r.engine_id, r.remote_request_id, r.block_ids, r.remote_block_ids, r.expected_consumers)


@emits(SendNotif)
def send_notif(r: DecodeRequest, ev, cfg, now) -> SendNotif:
    return SendNotif(r.engine_id, r.remote_request_id, r.expected_consumers)


@emits(RefuseForeignSender)
def refuse_foreign_pusher(r: DecodeRequest, ev: PushDone, cfg, now) -> RefuseForeignSender:
    return RefuseForeignSender(r.key, ev.sender, "push_done_foreign_sender")


@emits(SendPushRegistration)
def send_push_registration(r: DecodeRequest, ev, cfg, now) -> SendPushRegistration:
    # The deadline of the AWAITING_PUSH state this registration enters.
    return SendPushRegistration(r.key, r.engine_id, r.remote_request_id, r.block_ids, r.push_give_up())


@emits(SupersedeEngine)
def supersede_engine(r: DecodeRequest, ev, cfg, now) -> SupersedeEngine:
    return SupersedeEngine(r.engine_id)


@emits(ReportRecv)
def report_done(r: DecodeRequest, ev, cfg, now) -> ReportRecv:
    return ReportRecv(r.key, ok=True, failed_block_ids=())


def report_failed(reason: RecvFailure) -> Emit:
    """The row entry reporting the recv failed for ``reason``, naming the
    blocks whose load failed (one builder per reason: ``report_<reason>``)."""
    def build(r: DecodeRequest, ev, cfg, now) -> ReportRecv:
        return ReportRecv(r.key, ok=False, failed_block_ids=r.block_ids, reason=reason)
    build.__name__ = build.__qualname__ = f"report_{reason.name.lower()}"
    return emits(ReportRecv)(build)


# The reasons this table reports, each where it happens.
report_declined = report_failed(RecvFailure.DECLINED)
report_other_incarnation = report_failed(RecvFailure.OTHER_INCARNATION)
report_transfer_failed = report_failed(RecvFailure.TRANSFER_FAILED)
report_aborted = report_failed(RecvFailure.ABORTED)
report_transfer_deadline = report_failed(RecvFailure.TRANSFER_DEADLINE)
report_handshake_timeout = report_failed(RecvFailure.HANDSHAKE_TIMEOUT)
report_push_timeout = report_failed(RecvFailure.PUSH_TIMEOUT)
report_recv_timeout = report_failed(RecvFailure.RECV_TIMEOUT)
report_handshake_failed = report_failed(RecvFailure.HANDSHAKE_FAILED)
report_engine_lost = report_failed(RecvFailure.ENGINE_LOST)


@emits(GrantHold)
def grant_hold(r: DecodeRequest, ev: RequestFinished, cfg, now) -> GrantHold:
    """Hold the blocks the scheduler names (ours when it names none) for turn 2."""
    return GrantHold(r.key, ev.block_ids or r.block_ids)


# --------------------------------------------------------------- states
class DecodeState(StrEnum):
    """The states of a decode request: the names its table uses."""

    NEW = "NEW"
    HEARTBEATING = "HEARTBEATING"
    WAITING_FOR_REMOTE_KVS = "WAITING_FOR_REMOTE_KVS"
    FULL_PREFIX_HIT = "FULL_PREFIX_HIT"
    NOTIFY_ONLY = "NOTIFY_ONLY"
    NOTIFYING = "NOTIFYING"
    HANDSHAKING = "HANDSHAKING"
    READING = "READING"
    AWAITING_PUSH = "AWAITING_PUSH"
    RECV_DONE = "RECV_DONE"
    RECV_FAILED = "RECV_FAILED"
    RUNNING = "RUNNING"
    RELEASED = "RELEASED"
    ABORTED = "ABORTED"


S = DecodeState  # the short name the table rows use

AWAITED = {"heartbeat", "report"}
STATES = (
    State(S.NEW, doc="created by on_new_request"),
    State(S.HEARTBEATING, holds={"heartbeat"},
          doc="queued on D; heartbeats keep P's lease alive from arrival, not from scheduling"),
    State(S.WAITING_FOR_REMOTE_KVS, holds=AWAITED, waits_on_remote=True,
          deadline=lambda r, cfg, now: r.recv_deadline),
    State(S.FULL_PREFIX_HIT, holds=AWAITED, waits_on_remote=True, deadline=lambda r, cfg, now: r.recv_deadline,
          doc="0 remote tokens, scheduler awaits the (notify-only) recv"),
    State(S.NOTIFY_ONLY, holds={"heartbeat"}, doc="0 remote tokens, nobody awaits: notify P and vanish"),
    State(S.NOTIFYING, holds={"heartbeat", "engine_ref"}, waits_on_remote=True,
          deadline=lambda r, cfg, now: r.recv_deadline),
    State(S.HANDSHAKING, holds=AWAITED | {"engine_ref"}, waits_on_remote=True,
          deadline=lambda r, cfg, now: r.recv_deadline),
    State(S.READING, holds=AWAITED | {"engine_ref", "xfer"}, waits_on_remote=True,
          deadline=lambda r, cfg, now: min(r.recv_deadline, r.transfer_deadline)),
    State(S.AWAITING_PUSH, holds=AWAITED | {"engine_ref"}, waits_on_remote=True,
          deadline=lambda r, cfg, now: r.push_give_up()),
    State(S.RECV_DONE),
    State(S.RECV_FAILED, doc="reported failed; kv_load_failure_policy decides recompute or fail"),
    State(S.RUNNING),
    State(S.RELEASED, terminal=True),
    State(S.ABORTED, terminal=True),
)

EVENTS = (NewRequest, BlocksAllocated, StartLoad, EngineReady, EngineLost, ReadDone, ReadFailed,
          PushDone, RequestRunning, RequestFinished, Abort, TimerFired)

ACTIVE = [S.HEARTBEATING, S.WAITING_FOR_REMOTE_KVS, S.FULL_PREFIX_HIT, S.NOTIFY_ONLY, S.NOTIFYING,
          S.HANDSHAKING, S.READING, S.AWAITING_PUSH, S.RECV_DONE, S.RECV_FAILED, S.RUNNING]
AFTER_ALLOC = ACTIVE[1:]
FINISHED_RECV = [S.RECV_DONE, S.RECV_FAILED, S.RUNNING]
NOTIFY = [S.NOTIFY_ONLY, S.NOTIFYING]
# Before the recv is reported, for a request whose recv is (or may be) awaited.
AWAITING_RECV = [S.HEARTBEATING, S.WAITING_FOR_REMOTE_KVS, S.FULL_PREFIX_HIT, S.HANDSHAKING, S.READING,
                 S.AWAITING_PUSH]
NO_ENGINE_WAIT = [s for s in ACTIVE if s not in (S.HANDSHAKING, S.NOTIFYING)]
NO_XFER = [s for s in ACTIVE if s != S.READING]
NO_PUSH = [s for s in ACTIVE if s != S.AWAITING_PUSH]


def give_up(report: Emit) -> tuple[Emit, ...]:
    """Stop waiting on the remote and report the recv failed (``report``: why)."""
    return stop_heartbeat, release_engine, report


TABLE = rows(
    on(S.NEW, NewRequest, S.HEARTBEATING, start_heartbeat, do=_accept),
    error(S.NEW, EVENTS[1:-1], "no event precedes on_new_request"),
    ignore(ACTIVE, NewRequest, "duplicate on_new_request for a live request"),

    # Allocation decides what the scheduler awaits.
    on(S.HEARTBEATING, BlocksAllocated, S.WAITING_FOR_REMOTE_KVS, when=has_remote_tokens, do=_allocated,
       acquires={"report"}),
    on(S.HEARTBEATING, BlocksAllocated, S.FULL_PREFIX_HIT, when=awaited, do=_allocated, acquires={"report"}),
    on(S.HEARTBEATING, BlocksAllocated, S.NOTIFY_ONLY, do=_allocated),
    error(AFTER_ALLOC, BlocksAllocated, "blocks allocated twice"),

    on([S.WAITING_FOR_REMOTE_KVS, S.FULL_PREFIX_HIT], StartLoad, S.HANDSHAKING, acquire_engine),
    on(S.NOTIFY_ONLY, StartLoad, S.NOTIFYING, acquire_engine),
    error(S.HEARTBEATING, StartLoad, "load started before blocks were allocated"),
    ignore([S.NOTIFYING, S.HANDSHAKING, S.READING, S.AWAITING_PUSH] + FINISHED_RECV, StartLoad,
           "load already started (the worker repeats start_load_kv each step)"),

    # The engine is connected: gate, then read, notify, or register for push.
    # The engine connected is older than the holder (it restarted under the
    # same engine id since): drop it, and wait for a fresh handshake.
    on(S.HANDSHAKING, EngineReady, S.HANDSHAKING, release_engine, supersede_engine, acquire_engine,
       when=older_incarnation, do=_superseded),
    # Another incarnation than the holder's holds none of its blocks: read
    # nothing, tell it nothing (the holder's lease ends on its own).
    on(S.HANDSHAKING, EngineReady, S.RECV_FAILED, *give_up(report_other_incarnation), when=other_incarnation),
    # A full prefix hit reads nothing remote, so the expiry gate does not apply.
    on(S.HANDSHAKING, EngineReady, S.RECV_DONE, send_notif, stop_heartbeat, release_engine, report_done,
       when=full_prefix_hit),
    on(S.HANDSHAKING, EngineReady, S.RECV_FAILED, *give_up(report_declined), when=remote_blocks_expired),
    on(S.HANDSHAKING, EngineReady, S.AWAITING_PUSH, send_push_registration, when=push_mode, do=_awaiting_push),
    on(S.HANDSHAKING, EngineReady, S.READING, post_read, do=_reading),
    on(S.NOTIFYING, EngineReady, S.NOTIFYING, release_engine, supersede_engine, acquire_engine,
       when=older_incarnation, do=_superseded),
    on(S.NOTIFYING, EngineReady, S.RELEASED, stop_heartbeat, release_engine, when=other_incarnation),
    on(S.NOTIFYING, EngineReady, S.RELEASED, send_notif, stop_heartbeat, release_engine),
    ignore(NO_ENGINE_WAIT, EngineReady, "stale wake-up: the request no longer waits for the engine"),

    # A full prefix hit loads nothing: the recv is done even when P cannot be
    # told (no block failed to load; P's lease then runs out on its own).
    # Lost while connecting: the handshake failed (refused, timed out, or
    # backing off after one); lost once connected: the engine is gone.
    *(rows(on(S.HANDSHAKING, ev, S.RECV_DONE, stop_heartbeat, release_engine, report_done, when=full_prefix_hit),
           on(S.HANDSHAKING, ev, S.RECV_FAILED, *give_up(report)))
      for ev, report in ((EngineLost, report_handshake_failed), (TimerFired, report_handshake_timeout))),
    on(S.NOTIFYING, [EngineLost, TimerFired], S.RELEASED, stop_heartbeat, release_engine),
    on(S.READING, EngineLost, S.RECV_FAILED, cancel_xfer, *give_up(report_engine_lost)),
    on(S.READING, TimerFired, S.RECV_FAILED, cancel_xfer, *give_up(report_transfer_deadline)),
    on(S.AWAITING_PUSH, EngineLost, S.RECV_FAILED, *give_up(report_engine_lost)),
    on(S.AWAITING_PUSH, TimerFired, S.RECV_FAILED, *give_up(report_push_timeout)),
    on([S.WAITING_FOR_REMOTE_KVS, S.FULL_PREFIX_HIT], TimerFired, S.RECV_FAILED, stop_heartbeat,
       report_recv_timeout),
    ignore([s for s in ACTIVE if s not in (S.HANDSHAKING, S.NOTIFYING, S.READING, S.AWAITING_PUSH)], EngineLost,
           "the request holds no reference to the engine here"),

    # Transfer results.
    on(S.READING, ReadDone, S.RECV_DONE, release_xfer, note_activity, stop_heartbeat, release_engine, report_done),
    on(S.READING, ReadFailed, S.RECV_FAILED, release_xfer, *give_up(report_transfer_failed)),
    ignore(NO_XFER, [ReadDone, ReadFailed], "late completion of a transfer already released"),
    # Only the engine it reads from may say its WRITE landed; a stranger's
    # completion changes nothing (refused, counted by the embedder).
    on(S.AWAITING_PUSH, PushDone, S.AWAITING_PUSH, refuse_foreign_pusher, when=foreign_pusher),
    on(S.AWAITING_PUSH, PushDone, S.RECV_DONE, note_activity, stop_heartbeat, release_engine, report_done),
    ignore(NO_PUSH, PushDone, "late or duplicate push completion"),

    # After the recv: the scheduler runs and finishes the request.
    # A notify-only request is not awaited: the scheduler runs and finishes it
    # at once, while the notify to the remote completes (or times out) alone.
    on([S.RECV_DONE, S.RECV_FAILED], RequestRunning, S.RUNNING),
    ignore(S.RUNNING, RequestRunning, "already running"),
    ignore(NOTIFY, RequestRunning, "notify-only: nobody awaits the recv, so the request runs at once"),
    error(AWAITING_RECV, RequestRunning, "scheduled before its recv was reported"),
    *(rows(on(s, RequestFinished, S.RELEASED, grant_hold, when=hold_for_next_turn),
           on(s, RequestFinished, S.RELEASED))
      for s in FINISHED_RECV),
    ignore(NOTIFY, RequestFinished,
           "notify-only: the notify ends the request on its own (finishing it here would leave P's lease to "
           "expire); nothing of the remote's is held for a next turn"),
    error(AWAITING_RECV, RequestFinished, "finished before its recv was reported (abort instead)"),

    # Abort: release everything held; an awaited recv is still reported.
    on([S.HEARTBEATING, S.NOTIFY_ONLY], Abort, S.ABORTED, stop_heartbeat),
    on([S.WAITING_FOR_REMOTE_KVS, S.FULL_PREFIX_HIT], Abort, S.ABORTED, stop_heartbeat, report_aborted),
    on(S.NOTIFYING, Abort, S.ABORTED, stop_heartbeat, release_engine),
    on([S.HANDSHAKING, S.AWAITING_PUSH], Abort, S.ABORTED, *give_up(report_aborted)),
    on(S.READING, Abort, S.ABORTED, cancel_xfer, *give_up(report_aborted)),
    on(FINISHED_RECV, Abort, S.ABORTED),
)



def check_reports_name_a_reason(table: tuple) -> None:
    """Definition time: every row's failed report names why, and a
    successful one names nothing (each builder is built once on a probe)."""
    probe = DecodeRequest(key="probe", state=S.NEW)
    for row in table:
        for entry in getattr(row, "actions", ()):
            if entry.action is ReportRecv:
                built = entry.build(probe, None, None, 0.0)
                if built.ok == (built.reason is not None):
                    raise MachineDefinitionError(
                        f"decode_request: {row.src} x {row.event.__name__}: {entry.name} reports ok={built.ok} "
                        f"with reason {built.reason!r} (a failed report names its reason, a success none)")


check_reports_name_a_reason(TABLE)

SPEC = Spec(
    name="decode_request",
    instance_type=DecodeRequest,
    initial=S.NEW,
    states=STATES,
    events=EVENTS,
    created_by=(NewRequest,),
    table=TABLE,
    fail_closed_event=Abort,
    doc=__doc__,
)
