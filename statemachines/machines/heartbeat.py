"""Heartbeat batching on the decode side: one machine per remote engine.

One ``HB:`` message per remote engine per interval, carrying every peer
request id registered for that engine, sent to every rank of that engine
(heterogeneous TP: each P rank holds its own lease records).  Registration
starts at request arrival, so a request queued for long on D keeps its
prefill lease alive.  Work per interval is O(engines + ids sent), never
O(all in-flight requests).

The batch holds a reference to its engine from the first registration
(heartbeats start at arrival, so the engine must be connected from then on,
and must not be evicted while heartbeats for it still flow).  An engine
evicted under it (peer disconnect, failed handshake) takes the reference
with it; the next batch with ids left takes a new one, or the heartbeats
of requests still queued would go to an engine that is not connected (the
transport skips them) or is evicted for silence, and the leases expire.
A batch with no id left ends, dropping its reference.

The batch also keeps the heartbeat chain the READ gate reads (read_gate:
when the chain started, when it last sent).
"""
from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

import attrs

from .. import heartbeat_phase, read_gate
from ..actions import SendHeartbeat
from ..base import Instance, TimerFired
from ..emit import emits
from ..events import EngineLost, EngineReady, HeartbeatRegister, HeartbeatUnregister
from ..spec import Spec, State
from ..table import error, ignore, on, rows
from .engine_refs import acquire_engine, release_engine

KIND = "heartbeat"


@attrs.define(slots=True)
class HeartbeatBatch(Instance):
    KIND: ClassVar[str] = KIND
    engine_id: str = ""
    ids: dict = attrs.Factory(dict)  # peer request id -> registrations
    ranks: set = attrs.Factory(set)
    next_at: float = 0.0
    # When the last batch went out: every id registered before then had its
    # lease extended to at least that time + extension.
    last_sent: float | None = None
    # First send of the current unbroken chain (no gap over max_gap).
    chain_start: float | None = None


# ----------------------------------------------------------------- effects
def _first(b: HeartbeatBatch, ev: HeartbeatRegister, cfg, now) -> None:
    """The first batch goes out at the engine's next phase slot, at most one interval on."""
    b.engine_id = ev.engine_id
    b.next_at = heartbeat_phase.next_slot(ev.engine_id, now, cfg)
    _register(b, ev, cfg, now)


def _register(b: HeartbeatBatch, ev: HeartbeatRegister, cfg, now) -> None:
    b.ids[ev.request_id] = b.ids.get(ev.request_id, 0) + 1
    b.ranks.update(ev.ranks)


def _unregister(b: HeartbeatBatch, ev: HeartbeatUnregister, cfg, now) -> None:
    n = b.ids.get(ev.request_id)
    if n is not None:
        if n > 1:
            b.ids[ev.request_id] = n - 1
        else:
            b.ids.pop(ev.request_id)


def _sent(b: HeartbeatBatch, ev, cfg, now) -> None:
    """Keep the chain; the next batch at the engine's next phase slot, at most one interval on."""
    b.chain_start = read_gate.chain_start_after_send(b.chain_start, b.last_sent, now, cfg)
    b.last_sent = now
    b.next_at = heartbeat_phase.next_slot(b.engine_id, now, cfg)


# ------------------------------------------------------------------ guards
def ids_left(b: HeartbeatBatch, ev, cfg, now) -> bool:
    """ids left to keep alive"""
    return bool(b.ids)


# ---------------------------------------------------------------- builders
@emits(SendHeartbeat)
def send_batch(b: HeartbeatBatch, ev, cfg, now) -> SendHeartbeat:
    """One HB: to every rank of the engine, naming every registered id."""
    return SendHeartbeat(b.engine_id, tuple(sorted(b.ranks)), tuple(b.ids))


# --------------------------------------------------------------- states
class HeartbeatState(StrEnum):
    """The states of an engine's heartbeat batch: the names its table uses."""

    NEW = "NEW"
    SENDING = "SENDING"
    UNREFERENCED = "UNREFERENCED"
    DONE = "DONE"


S = HeartbeatState  # the short name the table rows use

STATES = (
    State(S.NEW),
    State(S.SENDING, holds={"engine_ref"}, deadline=lambda b, cfg, now: b.next_at,
          doc="sends a batch every interval; holds the engine"),
    State(S.UNREFERENCED, deadline=lambda b, cfg, now: b.next_at,
          doc="the engine was evicted under the batch; the next batch with ids takes a new reference"),
    State(S.DONE, terminal=True),
)
EVENTS = (HeartbeatRegister, HeartbeatUnregister, EngineReady, EngineLost, TimerFired)
LIVE = [S.SENDING, S.UNREFERENCED]

TABLE = rows(
    on(S.NEW, HeartbeatRegister, S.SENDING, acquire_engine, do=_first),
    error(S.NEW, EVENTS[1:-1], "no heartbeat event precedes the first registration"),
    *(on(s, HeartbeatRegister, s, do=_register) for s in LIVE),
    *(on(s, HeartbeatUnregister, s, do=_unregister) for s in LIVE),

    on(S.SENDING, TimerFired, S.SENDING, send_batch, when=ids_left, do=_sent),
    on(S.SENDING, TimerFired, S.DONE, release_engine),
    on(S.UNREFERENCED, TimerFired, S.SENDING, send_batch, acquire_engine, when=ids_left, do=_sent),
    on(S.UNREFERENCED, TimerFired, S.DONE),

    # Woken like any requester; it sends on its timer regardless (the
    # transport skips an engine that is not connected yet).
    *(on(s, EngineReady, s) for s in LIVE),
    on(S.SENDING, EngineLost, S.UNREFERENCED, release_engine),
    ignore(S.UNREFERENCED, EngineLost, "the batch holds no reference to the engine"),
)

SPEC = Spec(
    name=KIND,
    instance_type=HeartbeatBatch,
    initial=S.NEW,
    states=STATES,
    events=EVENTS,
    table=TABLE,
    created_by=(HeartbeatRegister,),
    doc=__doc__,
)
