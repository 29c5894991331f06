"""The engine boundary as events and actions: the calls vLLM's scheduler
makes on the connector's scheduler half, and the connector's answers.

Events are the engine's calls (``KVConnectorBase_V1``'s scheduler-side
methods, plus the workers' aggregated per-step reports); actions are what
the connector answers the engine (a return value) or sends every worker
rank (a record of ``connector.records.StepMeta``).  They are kept apart
from ``events`` / ``actions`` (the plane's alphabet): the scheduler half
(``connector.scheduler``) runs them in a plane of its own and writes its
own event log, which ``eventlog`` reads with ``ENGINE_EVENTS`` /
``ENGINE_ACTIONS`` beside the plane's names.

Resources are the engine's obligations:

- ``rank_request``: every rank holds a decode request for it (sent with
  the next metadata); ended by a finish, an abort, or an empty unawaited
  load (the rank notifies the remote and ends on its own);
- ``recv_report``: the engine awaits the recv (vLLM keeps the request in
  WAITING_FOR_REMOTE_KVS, or its blocks when it was aborted there); only
  the workers' aggregated report of it releases it, so it is reported
  once and nothing not awaited is reported;
- ``delayed_free``: ``request_finished`` answered delay-free, so the
  engine keeps the blocks until one aggregated ``finished_sending``;
- ``lease``: every rank holds the blocks under a lease (P's, or D's hold
  for a next turn); ended by that same ``finished_sending``.
"""
from __future__ import annotations

from typing import ClassVar, Iterable

import attrs

from .base import Action, Event, declared

MACHINE = "engine_request"


def _ids(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


# ------------------------------------------------------------------ events
@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class EngineNewRequest(Event):
    """on_new_request.  ``remote_prefill``: its KV is to be read from a remote
    engine (D, or a turn-2 reader); ``remote_decode``: a remote engine will
    read its KV (P).  The adapter validated the params first."""

    request_id: str
    remote_prefill: bool = False
    remote_decode: bool = False
    # A reader's read of fewer tokens than this is declined: the engine
    # computes them and the holder is told to free at once (NixlConnector's
    # kv_recompute_threshold, which 0.32.0 applies to a turn-2 read of a
    # decoder's hold only).  0: every read is made.
    recompute_below: int = 0
    machine: ClassVar[str] = MACHINE


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class EngineMatched(Event):
    """get_num_new_matched_tokens: the prompt's size and what the engine has
    computed (its local prefix hit, block-aligned)."""

    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    machine: ClassVar[str] = MACHINE


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class EngineAllocated(Event):
    """update_state_after_alloc: blocks allocated; ``num_external_tokens`` to
    load into ``block_ids`` (0: nothing to load)."""

    request_id: str
    block_ids: tuple = attrs.field(converter=_ids, default=())
    num_external_tokens: int = 0
    # Awaited even with nothing to load: an embedder that waits for the
    # ranks' notify of a full-prefix hit (the main job's await_full).
    awaiting: bool = False
    machine: ClassVar[str] = MACHINE


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class EngineScheduled(Event):
    """build_connector_meta listed the request among the step's scheduled ones."""

    request_id: str
    machine: ClassVar[str] = MACHINE


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class EnginePreempted(Event):
    """The engine preempted the running request (vLLM 0.32.0 frees its blocks,
    sets its computed tokens to 0 and reschedules it; it does not call the
    connector: an adapter that sees it feeds this)."""

    request_id: str
    machine: ClassVar[str] = MACHINE


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class EngineFinished(Event):
    """request_finished: ``normal`` when it finished producing output
    (length-capped or stopped), not aborted or failed; ``hold_for_next_turn``
    when D keeps the blocks for a bidirectional turn 2; ``serve_remote_decode``
    when a reader (P's turn 2) now serves a remote decode of its blocks."""

    request_id: str
    normal: bool = True
    block_ids: tuple = attrs.field(converter=_ids, default=())
    hold_for_next_turn: bool = False
    serve_remote_decode: bool = False
    machine: ClassVar[str] = MACHINE


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class EngineLeaseAbort(Event):
    """The embedder frees blocks it keeps under a lease or hold now (the
    main job, once the other side is gone): the ranks end the lease and
    report it sent."""

    request_id: str
    machine: ClassVar[str] = MACHINE


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class RecvFinished(Event):
    """The workers' aggregated report: every rank reported the recv (vLLM's
    finished_recving), failed when any rank failed it (failed_recving)."""

    request_id: str
    ok: bool = True
    machine: ClassVar[str] = MACHINE
    releases: ClassVar[frozenset[str]] = frozenset({"recv_report"})


@attrs.define(slots=True, unsafe_hash=True, kw_only=True)
class SendingFinished(Event):
    """The workers' aggregated report: every rank ended the lease (vLLM's
    finished_sending): the engine frees the blocks."""

    request_id: str
    machine: ClassVar[str] = MACHINE
    releases: ClassVar[frozenset[str]] = frozenset({"lease", "delayed_free"})


# ----------------------------------------------------------------- answers
class AnswerMatched(Action, frozen=True):
    """get_num_new_matched_tokens returns (num_tokens, load_async)."""

    request_id: str
    num_tokens: int
    load_async: bool


class DeclineSmallRead(Action, frozen=True):
    """The read of ``num_tokens`` is below the request's recompute threshold
    (``kv_recompute_threshold``): the engine computes those tokens and the
    holder is told to free its blocks now, as for a full prefix hit."""

    request_id: str
    num_tokens: int
    threshold: int


class AnswerFinished(Action, frozen=True):
    """request_finished returns (False, None): the engine frees the blocks now."""

    request_id: str


class AnswerDelayFree(Action, frozen=True):
    """request_finished returns (True, kv_transfer_params): the engine keeps
    the blocks until finished_sending."""

    request_id: str
    block_ids: tuple
    acquires: ClassVar[frozenset[str]] = frozenset({"delayed_free"})


# ------------------------------------------------- the engine's get_finished
class TellRecvFinished(Action, frozen=True):
    """get_finished names the request's recv: finished_recving, or also
    failed_recving (``ok`` False)."""

    request_id: str
    ok: bool


class TellSendingFinished(Action, frozen=True):
    """get_finished names the request in finished_sending: the engine frees
    the blocks it kept."""

    request_id: str


# ------------------------------------------------------- records to the ranks
class SendNewRemote(Action, frozen=True):
    """NewRemoteRequest: every rank starts a decode request (and its heartbeats)."""

    request_id: str
    acquires: ClassVar[frozenset[str]] = frozenset({"rank_request"})


class SendLoad(Action, frozen=True):
    """Load (awaiting): every rank reads the remote blocks into ``block_ids``."""

    request_id: str
    block_ids: tuple
    num_remote_tokens: int


class SendNotifyOnly(Action, frozen=True):
    """Load (empty, not awaited): every rank tells the remote it may free its
    blocks now, and ends its request on its own."""

    request_id: str
    releases: ClassVar[frozenset[str]] = frozenset({"rank_request"})


class SendRunning(Action, frozen=True):
    """running: the request runs (its recv was reported)."""

    request_id: str


class SendFinish(Action, frozen=True):
    """Finish: every rank ends its decode request."""

    request_id: str
    block_ids: tuple
    releases: ClassVar[frozenset[str]] = frozenset({"rank_request"})


class SendAbort(Action, frozen=True):
    """aborts: every rank aborts its decode request; an awaited recv is still
    reported (failed) by every rank."""

    request_id: str
    releases: ClassVar[frozenset[str]] = frozenset({"rank_request"})


class GrantLease(Action, frozen=True):
    """LeaseGrant (P), or Finish with a hold (D's turn 2): every rank puts the
    blocks under a lease."""

    request_id: str
    block_ids: tuple
    hold: bool = False
    acquires: ClassVar[frozenset[str]] = frozenset({"lease"})


class SendLeaseAbort(Action, frozen=True):
    """lease_aborts: every rank frees the lease now (and reports it sent)."""

    request_id: str


class FlagOverdue(Action, frozen=True):
    """An obligation the workers should have ended is past its bound: count
    and log it (the engine cannot be told but by the workers)."""

    request_id: str
    what: str


# The alphabet's classes by name (the event log reads the scheduler side's
# lines with these, beside the plane's).
ENGINE_EVENTS: dict[str, type[Event]] = declared(Event, __name__)
ENGINE_ACTIONS: dict[str, type[Action]] = declared(Action, __name__)
