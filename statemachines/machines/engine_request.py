"""A request as the engine's scheduler sees it: the connector's scheduler half.

One machine for both roles, chosen by the params at on_new_request: a
consumer (D, or a turn-2 reader: ``remote_prefill``) and a producer (P:
``remote_decode``).  Its events are the engine's calls
(``engine_calls``), its actions the connector's answers and the records
it sends every worker rank.  Its resources are the engine's obligations,
which the validator proves are each ended exactly once on every path:

- an awaited recv (``recv_report``) is ended only by the workers'
  aggregated report of it, which in any other state is a protocol error:
  reported once, and nothing the engine does not await is reported;
- a delayed free (``delayed_free``) is ended only by one aggregated
  ``finished_sending``, and so is the ranks' lease;
- the ranks' decode request (``rank_request``) is ended by a finish, an
  abort or an empty unawaited load (aborted before allocation: the ranks
  tell P to free now).

The machine's Tell* actions are what the engine's ``get_finished`` names
(finished_recving, failed_recving, finished_sending): each accepted report
tells it once.

A read of fewer tokens than the request's ``recompute_below``
(``kv_recompute_threshold``, set by the embedder for the reads it applies
to) is declined at get_num_new_matched_tokens: the engine computes them,
and the allocation with nothing to load tells the holder to free now.

Preemption: vLLM frees a preempted request's blocks and computes it again
from scratch, asking for matched tokens again.  After its recv the
connector answers 0 (the remote's blocks may be gone; the prompt is
recomputed locally) and tells the ranks nothing: their request already
ran.  P is preempted only while prefilling, before anything was granted.

Deadlines: the ranks bound an awaited recv (recv_timeout) and a hold
(its TTL) themselves; a grace after that bound the machine aborts them on
the ranks, which makes every rank report, and flags what stays overdue.
P's lease is extended by the reader's heartbeats, so its bound is only a
watchdog that flags it, never frees it.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

import attrs

from ..base import Instance, TimerFired
from ..emit import emits
from ..engine_calls import (
    AnswerDelayFree, AnswerFinished, AnswerMatched, DeclineSmallRead, EngineAllocated, EngineFinished, EngineLeaseAbort, EngineMatched,
    EngineNewRequest, EnginePreempted, EngineScheduled, FlagOverdue, GrantLease, RecvFinished, SendAbort,
    SendFinish, SendingFinished, SendLeaseAbort, SendLoad, SendNewRemote, SendNotifyOnly, SendRunning,
    TellRecvFinished, TellSendingFinished,
)
from ..spec import Spec, State
from ..table import error, ignore, on, rows

# How long after the ranks' own bound the machine steps in (seconds): the
# ranks' deadlines fire first, their reports take a step or two to arrive.
GRACE_S = 5.0


@attrs.define(slots=True)
class EngineRequest(Instance):
    KIND: ClassVar[str] = "engine_request"
    block_ids: tuple = ()
    num_external_tokens: int = 0
    # The prompt tokens the engine had computed when it asked (its local
    # prefix hit: the read starts there).
    local_hit: int = 0
    # A read of fewer tokens is declined (EngineNewRequest.recompute_below).
    recompute_below: int = 0
    # When the machine steps in (the state's deadline; moved on each stage).
    bound: float = 0.0
    # Whether every rank read (None: no recv reported); kept for what the
    # embedder records of the request when it finishes (a KV dump's read_ok).
    recv_ok: bool | None = None
    # The embedder's inputs for the records it builds from the actions (the
    # remote's params); never read by the table, not compared, not logged.
    context: Any = attrs.field(default=None, eq=False)


# ----------------------------------------------------------------- effects
def _created(r: EngineRequest, ev: EngineNewRequest, cfg, now) -> None:
    r.recompute_below = ev.recompute_below


def _matched(r: EngineRequest, ev: EngineMatched, cfg, now) -> None:
    r.local_hit = ev.num_computed_tokens


def _awaiting(r: EngineRequest, ev: EngineAllocated, cfg, now) -> None:
    """Keep the allocation; the ranks report the recv by now + recv_timeout."""
    r.block_ids = ev.block_ids
    r.num_external_tokens = ev.num_external_tokens
    r.bound = now + cfg.recv_timeout + GRACE_S


def _recv_reported(r: EngineRequest, ev: RecvFinished, cfg, now) -> None:
    r.recv_ok = ev.ok


def _grace(r: EngineRequest, ev, cfg, now) -> None:
    """The ranks were told; their reports are due within the grace."""
    r.bound = now + GRACE_S


def _leased(r: EngineRequest, ev: EngineFinished, cfg, now) -> None:
    """Keep the leased blocks; watch the lease from its first term on."""
    r.block_ids = ev.block_ids
    r.bound = now + cfg.kv_lease_duration + GRACE_S


def _watch_again(r: EngineRequest, ev, cfg, now) -> None:
    """Heartbeats may keep a lease for many terms: look again one term on."""
    r.bound = now + cfg.kv_lease_duration


def _held(r: EngineRequest, ev: EngineFinished, cfg, now) -> None:
    """Keep the held blocks; the hold's TTL is fixed (no heartbeat extends it)."""
    r.block_ids = ev.block_ids
    r.bound = now + cfg.decoder_kv_blocks_ttl + GRACE_S


# ------------------------------------------------------------------ guards
def consumer(r, ev: EngineNewRequest, cfg, now) -> bool:
    """remote prefill: D reads the KV"""
    return ev.remote_prefill


def producer(r, ev: EngineNewRequest, cfg, now) -> bool:
    """remote decode: P is read"""
    return ev.remote_decode


def below_recompute_threshold(r, ev: EngineMatched, cfg, now) -> bool:
    """tokens to read, fewer than the recompute threshold"""
    return 0 < ev.num_prompt_tokens - ev.num_computed_tokens < r.recompute_below


def external_tokens(r, ev: EngineAllocated, cfg, now) -> bool:
    """tokens to load > 0, or awaited anyway"""
    return ev.num_external_tokens > 0 or ev.awaiting


def serves(r, ev: EngineFinished, cfg, now) -> bool:
    """finished normally, with blocks, serving a remote decode"""
    return ev.normal and ev.serve_remote_decode and bool(ev.block_ids)


def leased(r, ev: EngineFinished, cfg, now) -> bool:
    """finished normally, with blocks"""
    return ev.normal and bool(ev.block_ids)


def hold_for_next_turn(r, ev: EngineFinished, cfg, now) -> bool:
    """finished normally, held for the next turn"""
    return ev.normal and ev.hold_for_next_turn


def recv_ok(r, ev: RecvFinished, cfg, now) -> bool:
    """every rank read"""
    return ev.ok


# ----------------------------------------------------------------- answers
@emits(AnswerMatched)
def answer_remote_tokens(r, ev: EngineMatched, cfg, now) -> AnswerMatched:
    """What the engine lacks of the prompt comes from the remote, asynchronously."""
    n = max(0, ev.num_prompt_tokens - ev.num_computed_tokens)
    return AnswerMatched(r.key, n, n > 0)


@emits(AnswerMatched)
def answer_nothing(r, ev: EngineMatched, cfg, now) -> AnswerMatched:
    return AnswerMatched(r.key, 0, False)


@emits(DeclineSmallRead)
def decline_small_read(r, ev: EngineMatched, cfg, now) -> DeclineSmallRead:
    return DeclineSmallRead(r.key, ev.num_prompt_tokens - ev.num_computed_tokens, r.recompute_below)


@emits(AnswerFinished)
def answer_free_now(r, ev, cfg, now) -> AnswerFinished:
    return AnswerFinished(r.key)


@emits(AnswerDelayFree)
def answer_delay_free(r, ev: EngineFinished, cfg, now) -> AnswerDelayFree:
    return AnswerDelayFree(r.key, ev.block_ids)


# ------------------------------------------------- the engine's get_finished
@emits(TellRecvFinished)
def tell_recv(r, ev: RecvFinished, cfg, now) -> TellRecvFinished:
    return TellRecvFinished(r.key, ev.ok)


@emits(TellSendingFinished)
def tell_sent(r, ev: SendingFinished, cfg, now) -> TellSendingFinished:
    return TellSendingFinished(r.key)


# ------------------------------------------------------- records to the ranks
@emits(SendNewRemote)
def send_new_remote(r, ev, cfg, now) -> SendNewRemote:
    return SendNewRemote(r.key)


@emits(SendLoad)
def send_load(r, ev: EngineAllocated, cfg, now) -> SendLoad:
    return SendLoad(r.key, ev.block_ids, ev.num_external_tokens)


@emits(SendNotifyOnly)
def send_notify_only(r, ev, cfg, now) -> SendNotifyOnly:
    return SendNotifyOnly(r.key)


@emits(SendRunning)
def send_running(r, ev, cfg, now) -> SendRunning:
    return SendRunning(r.key)


@emits(SendFinish)
def send_finish(r, ev: EngineFinished, cfg, now) -> SendFinish:
    return SendFinish(r.key, ev.block_ids or r.block_ids)


@emits(SendAbort)
def send_abort(r, ev, cfg, now) -> SendAbort:
    return SendAbort(r.key)


@emits(GrantLease)
def grant_lease(r, ev: EngineFinished, cfg, now) -> GrantLease:
    return GrantLease(r.key, ev.block_ids)


@emits(GrantLease)
def grant_hold(r, ev: EngineFinished, cfg, now) -> GrantLease:
    return GrantLease(r.key, ev.block_ids or r.block_ids, hold=True)


@emits(SendLeaseAbort)
def send_lease_abort(r, ev, cfg, now) -> SendLeaseAbort:
    return SendLeaseAbort(r.key)


@emits(FlagOverdue)
def flag_recv_overdue(r, ev, cfg, now) -> FlagOverdue:
    return FlagOverdue(r.key, "recv report")


@emits(FlagOverdue)
def flag_lease_overdue(r, ev, cfg, now) -> FlagOverdue:
    return FlagOverdue(r.key, "finished_sending")


# ----------------------------------------------------------------- states
class EngineState(StrEnum):
    """The states of a request at the engine boundary: the names its table uses."""

    NEW = "NEW"
    # Consumer (D).
    QUEUED = "QUEUED"
    AWAITING_RECV = "AWAITING_RECV"
    OVERDUE = "OVERDUE"
    RECV_DONE = "RECV_DONE"
    RECV_FAILED = "RECV_FAILED"
    RUNNING = "RUNNING"
    LOCAL = "LOCAL"
    ABORTING = "ABORTING"
    HELD = "HELD"
    # Producer (P).
    PREFILLING = "PREFILLING"
    LEASED = "LEASED"
    # Either, a lease the machine aborted and still awaits.
    FREEING = "FREEING"
    ENDED = "ENDED"


S = EngineState  # the short name the table rows use

RANKS_AWAITED = {"rank_request", "recv_report"}
BLOCKS_HELD = {"lease", "delayed_free"}
_bound = lambda r, cfg, now: r.bound  # noqa: E731  (a deadline is data on the instance)

STATES = (
    State(S.NEW, doc="created by on_new_request"),
    State(S.QUEUED, holds={"rank_request"}, doc="D: queued; the ranks heartbeat P's lease"),
    State(S.AWAITING_RECV, holds=RANKS_AWAITED, waits_on_remote=True, deadline=_bound,
          doc="WAITING_FOR_REMOTE_KVS: the ranks read"),
    State(S.OVERDUE, holds={"recv_report"}, waits_on_remote=True, deadline=_bound,
          doc="the ranks missed their bound: aborted there, each still reports"),
    State(S.RECV_DONE, holds={"rank_request"}),
    State(S.RECV_FAILED, holds={"rank_request"}, doc="kv_load_failure_policy: the engine fails or recomputes it"),
    State(S.RUNNING, holds={"rank_request"}),
    State(S.LOCAL, doc="computed by the engine alone; the ranks hold nothing of it"),
    State(S.ABORTING, holds={"recv_report"}, waits_on_remote=True, deadline=_bound,
          doc="finished while awaited: the engine keeps the blocks until the ranks report"),
    State(S.HELD, holds=BLOCKS_HELD, waits_on_remote=True, deadline=_bound,
          doc="D's blocks under a fixed-TTL lease for the next turn"),
    State(S.PREFILLING, doc="P computes the prompt; nothing granted yet"),
    State(S.LEASED, holds=BLOCKS_HELD, waits_on_remote=True, deadline=_bound,
          doc="P's blocks under a lease the reader's heartbeats extend"),
    State(S.FREEING, holds=BLOCKS_HELD, waits_on_remote=True, deadline=_bound,
          doc="the lease was aborted on the ranks; their finished_sending is due"),
    State(S.ENDED, terminal=True),
)

EVENTS = (EngineNewRequest, EngineMatched, EngineAllocated, EngineScheduled, EnginePreempted, EngineFinished,
          RecvFinished, SendingFinished, TimerFired, EngineLeaseAbort)

CALLS = EVENTS[1:6]  # the engine's calls after on_new_request
AFTER_RECV = [S.RECV_DONE, S.RECV_FAILED, S.RUNNING]
ENGINE_DONE = [S.ABORTING, S.HELD, S.LEASED, S.FREEING]  # request_finished was answered
NOT_AWAITED = [s for s in S if s not in (S.NEW, S.AWAITING_RECV, S.OVERDUE, S.ABORTING, S.ENDED)]
NOT_HELD = [s for s in S if s not in (S.NEW, S.HELD, S.LEASED, S.FREEING, S.ENDED)]

TABLE = rows(
    on(S.NEW, EngineNewRequest, S.QUEUED, send_new_remote, when=consumer, do=_created),
    on(S.NEW, EngineNewRequest, S.PREFILLING, when=producer),
    # Neither role: the engine computes it alone; nothing to keep (the
    # plane's creation rule: every creating row is a transition).
    on(S.NEW, EngineNewRequest, S.ENDED),
    error(S.NEW, CALLS, "no call precedes on_new_request"),
    error(S.NEW, [RecvFinished, SendingFinished], "a report for a request the engine never sent"),
    error([s for s in S if s not in (S.NEW, S.ENDED)], EngineNewRequest, "on_new_request twice"),

    # ---- consumer: allocation decides what the engine awaits.
    # Too few tokens to be worth a read (kv_recompute_threshold): the engine
    # computes them; allocated with nothing to load, the ranks tell the
    # holder to free now (notify only).
    on(S.QUEUED, EngineMatched, S.QUEUED, answer_nothing, decline_small_read, when=below_recompute_threshold,
       do=_matched),
    on(S.QUEUED, EngineMatched, S.QUEUED, answer_remote_tokens, do=_matched),
    on(S.QUEUED, EngineAllocated, S.AWAITING_RECV, send_load, when=external_tokens, do=_awaiting,
       acquires={"recv_report"}),
    on(S.QUEUED, EngineAllocated, S.LOCAL, send_notify_only),
    error(S.QUEUED, [EngineScheduled, EnginePreempted], "scheduled before its blocks were allocated"),
    # Aborted before allocation: nothing is awaited, and P may free now.
    on(S.QUEUED, EngineFinished, S.ENDED, send_notify_only, answer_free_now),

    error([S.AWAITING_RECV, S.OVERDUE], [EngineMatched, EngineAllocated, EngineScheduled, EnginePreempted],
          "the engine holds a request waiting for remote KV back from scheduling"),
    on(S.AWAITING_RECV, RecvFinished, S.RECV_DONE, tell_recv, when=recv_ok, do=_recv_reported),
    on(S.AWAITING_RECV, RecvFinished, S.RECV_FAILED, tell_recv, do=_recv_reported),
    on(S.AWAITING_RECV, EngineFinished, S.ABORTING, send_abort, answer_free_now, do=_grace),
    on(S.AWAITING_RECV, TimerFired, S.OVERDUE, send_abort, do=_grace),
    on(S.OVERDUE, RecvFinished, S.LOCAL, tell_recv, do=_recv_reported),
    on(S.OVERDUE, EngineFinished, S.ABORTING, answer_free_now),
    on(S.OVERDUE, TimerFired, S.OVERDUE, flag_recv_overdue, do=_grace),
    on(S.ABORTING, RecvFinished, S.ENDED, tell_recv),
    on(S.ABORTING, TimerFired, S.ABORTING, flag_recv_overdue, do=_grace),

    # After the recv: rescheduled (recompute after a failed recv, or after
    # preemption) it loads nothing again; a repeated allocation loads nothing.
    *(on(s, EngineMatched, s, answer_nothing) for s in AFTER_RECV + [S.LOCAL, S.PREFILLING]),
    ignore(AFTER_RECV + [S.LOCAL, S.PREFILLING], EngineAllocated,
           "allocated again (scheduled after its recv, or rescheduled): nothing to load"),
    on([S.RECV_DONE, S.RECV_FAILED], EngineScheduled, S.RUNNING, send_running),
    ignore(S.RUNNING, EngineScheduled, "already running"),
    ignore([S.LOCAL, S.PREFILLING], EngineScheduled, "the ranks have nothing running for it"),
    error([S.RECV_DONE, S.RECV_FAILED], EnginePreempted, "only a running request is preempted"),
    ignore([S.RUNNING, S.LOCAL, S.PREFILLING], EnginePreempted,
           "computed again by the engine from scratch; nothing to load again, nothing granted yet"),
    # A reader that serves a remote decode once done (P's turn 2): its
    # blocks go under a lease like a prefill's.
    *(rows(on(s, EngineFinished, S.LEASED, send_finish, grant_lease, answer_delay_free, when=serves, do=_leased),
           on(s, EngineFinished, S.HELD, send_finish, grant_hold, answer_delay_free, when=hold_for_next_turn,
              do=_held),
           on(s, EngineFinished, S.ENDED, send_finish, answer_free_now))
      for s in AFTER_RECV),
    on(S.LOCAL, EngineFinished, S.LEASED, grant_lease, answer_delay_free, when=serves, do=_leased),
    on(S.LOCAL, EngineFinished, S.ENDED, answer_free_now),

    # ---- producer: finished normally, its blocks go under a lease.
    on(S.PREFILLING, EngineFinished, S.LEASED, grant_lease, answer_delay_free, when=leased, do=_leased),
    on(S.PREFILLING, EngineFinished, S.ENDED, answer_free_now),

    # ---- the blocks the engine keeps: freed on one finished_sending.
    on([S.HELD, S.LEASED, S.FREEING], SendingFinished, S.ENDED, tell_sent),
    on(S.HELD, TimerFired, S.FREEING, send_lease_abort, do=_grace),
    on(S.LEASED, TimerFired, S.LEASED, flag_lease_overdue, do=_watch_again),
    on(S.FREEING, TimerFired, S.FREEING, flag_lease_overdue, do=_grace),
    error(ENGINE_DONE, CALLS, "a call after request_finished"),
    # The embedder frees a lease or hold early (its readers are gone).
    on([S.HELD, S.LEASED], EngineLeaseAbort, S.FREEING, send_lease_abort, do=_grace),
    ignore(S.FREEING, EngineLeaseAbort, "already aborted on the ranks"),
    error([s for s in S if s not in (S.HELD, S.LEASED, S.FREEING, S.ENDED)], EngineLeaseAbort,
          "no lease or hold to abort"),

    # ---- reports nothing awaits: the engine core would trip on them.
    error(NOT_AWAITED, RecvFinished, "a recv reported that the engine does not await (or reported twice)"),
    error(NOT_HELD, SendingFinished, "finished_sending for blocks the engine does not keep (or sent twice)"),
)

SPEC = Spec(
    name="engine_request",
    instance_type=EngineRequest,
    initial=S.NEW,
    states=STATES,
    events=EVENTS,
    created_by=(EngineNewRequest,),
    table=TABLE,
    doc=__doc__,
)
