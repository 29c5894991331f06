"""Push mode, prefill side: WRITE our leased blocks into a decoder's blocks.

D registers its blocks (``PUSH_REG``) and P's prefill finishes, in either
order; the WRITE starts when both have happened.  A registration waiting
for the prefill and a prefill waiting for the registration each have a
deadline.  WRITE activity refreshes the decoder engine's liveness, and the
engine reference held while writing keeps it from being evicted.  A
completed WRITE consumes the lease like a READ would.

D's registration carries when D gives up (its clock); after that D may
reuse the blocks, so a WRITE must be over before then.  Once the engine is
connected (and its clock offset known) the WRITE is declined when D's
deadline, less a safety margin, is already due, and otherwise gets that
as its deadline when it comes before the transfer timeout: a hung WRITE is
cancelled before D gives up.  A registration without a deadline writes
under the transfer timeout alone.

The WRITE reads P's leased blocks, so the push lives only while the lease
(same request id) holds them (``SOURCE``): from the moment it has the
blocks (AWAITING_REG, CONNECTING, WRITING), the plane fails it with
SourceEnded when the lease expires, is released or aborted, or is not held
when the push needs it; a WRITE in flight is cancelled with it.  D is not
told: it reports the recv failed when its wait for the push is over.
"""
from __future__ import annotations

import math
from enum import StrEnum
from typing import ClassVar

import attrs

from ..actions import ConsumeLease, PostWrite
from ..base import Instance, TimerFired
from ..emit import emits
from ..events import (
    EngineLost, EngineReady, PushAbort, PushReady, PushRegistered, SourceEnded, WriteDone, WriteFailed,
)
from ..spec import Source, Spec, State
from ..table import error, ignore, on, rows
from .engine_refs import acquire_engine, note_activity, release_engine
from .transfers import cancel_xfer, release_xfer
from .lease import HELD as LEASE_HELD


@attrs.define(slots=True)
class PushWrite(Instance):
    KIND: ClassVar[str] = "push_write"
    engine_id: str = ""
    remote_request_id: str = ""
    remote_block_ids: tuple = ()
    block_ids: tuple = ()
    remote_deadline: float | None = None
    wait_deadline: float = 0.0
    transfer_deadline: float = 0.0


def _registered(p: PushWrite, ev: PushRegistered, cfg, now) -> None:
    """Keep D's registration; wait for our prefill until now + push_registration_timeout."""
    p.engine_id = ev.engine_id
    p.remote_request_id = ev.remote_request_id
    p.remote_block_ids = ev.remote_block_ids
    p.remote_deadline = ev.remote_deadline
    p.wait_deadline = now + cfg.push_registration_timeout


def _ready(p: PushWrite, ev: PushReady, cfg, now) -> None:
    """Keep our leased blocks; wait for D's registration until now + push_registration_timeout."""
    p.block_ids = ev.block_ids
    p.wait_deadline = now + cfg.push_registration_timeout


def _writing(p: PushWrite, ev: EngineReady, cfg, now) -> None:
    """The WRITE must end by now + transfer_timeout, and before D gives up (less the margin)."""
    p.transfer_deadline = now + cfg.transfer_timeout
    write_until = remote_write_until(p, ev, cfg)
    if write_until is not None:
        p.transfer_deadline = min(p.transfer_deadline, write_until)


def push_margin(cfg) -> float:
    """How long before D gives up our WRITE must be over: the expiry safety
    margin (clock offset error, our step latency), but at most a quarter of
    the push window, so a short window is not consumed by the margin alone."""
    return min(cfg.expiry_safety_margin, cfg.push_registration_timeout / 4)


def remote_write_until(p: PushWrite, ev: EngineReady, cfg) -> float | None:
    """Until when (our clock) a WRITE into D's blocks may run: D's deadline
    less the margin; None when D sent no deadline; -inf (never) when D's
    deadline or the clock offset is NaN or infinite."""
    if p.remote_deadline is None:
        return None
    # D's deadline is in D's clock; offset = remote clock - local clock.
    until = _as_float(p.remote_deadline) - _as_float(ev.clock_offset) - push_margin(cfg)
    return until if math.isfinite(until) else -math.inf


def _as_float(x) -> float:
    """``x`` as a float, NaN when it is not a real number."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return math.nan
    return float(x)


# ------------------------------------------------------------------ guards
def decoder_gives_up_first(p: PushWrite, ev: EngineReady, cfg, now) -> bool:
    """D's deadline - margin not after now"""
    write_until = remote_write_until(p, ev, cfg)
    # Written so that a comparison with NaN declines; a ``now`` of -inf
    # would make any deadline look far ahead.
    return write_until is not None and not (write_until > now and math.isfinite(now))


# ----------------------------------------------------------------- actions
@emits(PostWrite)
def post_write(p: PushWrite, ev, cfg, now) -> PostWrite:
    # The transport attaches the completion notif "<remote_request_id>:1".
    return PostWrite(p.key, p.engine_id, p.remote_request_id, p.block_ids, p.remote_block_ids)


@emits(ConsumeLease)
def consume_lease(p: PushWrite, ev, cfg, now) -> ConsumeLease:
    """The decoder (our engine) consumed the lease, as a READ would."""
    return ConsumeLease(p.key, p.engine_id)


_wait = lambda p, cfg, now: p.wait_deadline  # noqa: E731


class PushState(StrEnum):
    """The states of a push WRITE: the names its table uses."""

    NEW = "NEW"
    REGISTERED = "REGISTERED"
    AWAITING_REG = "AWAITING_REG"
    CONNECTING = "CONNECTING"
    WRITING = "WRITING"
    DONE = "DONE"
    FAILED = "FAILED"


S = PushState  # the short name the table rows use

STATES = (
    State(S.NEW),
    State(S.REGISTERED, waits_on_remote=True, deadline=_wait, doc="D registered; our prefill still runs"),
    State(S.AWAITING_REG, waits_on_remote=True, deadline=_wait, doc="prefill done; deferred until D registers"),
    State(S.CONNECTING, holds={"engine_ref"}, waits_on_remote=True, deadline=_wait),
    State(S.WRITING, holds={"engine_ref", "xfer"}, waits_on_remote=True,
          deadline=lambda p, cfg, now: p.transfer_deadline),
    State(S.DONE, terminal=True),
    State(S.FAILED, terminal=True,
          doc="no WRITE completed (failed, cancelled or declined); the lease expires or is aborted on its own"),
)
EVENTS = (PushRegistered, PushReady, EngineReady, EngineLost, WriteDone, WriteFailed, PushAbort, SourceEnded,
          TimerFired)
LIVE = [S.REGISTERED, S.AWAITING_REG, S.CONNECTING, S.WRITING]
# The WRITE is from P's lease of the same request: the push may have the
# blocks (and WRITE from them) only while the lease holds them.
SOURCE = Source(kind="lease", held=LEASE_HELD, needs=(S.AWAITING_REG, S.CONNECTING, S.WRITING), ended=SourceEnded,
                uses=(PostWrite,))

TABLE = rows(
    on(S.NEW, PushRegistered, S.REGISTERED, do=_registered),
    on(S.NEW, PushReady, S.AWAITING_REG, do=_ready),
    error(S.NEW, [EngineReady, EngineLost, WriteDone, WriteFailed, PushAbort, SourceEnded],
          "no push was registered or readied"),
    on(S.REGISTERED, PushReady, S.CONNECTING, acquire_engine, do=_ready),
    on(S.AWAITING_REG, PushRegistered, S.CONNECTING, acquire_engine, do=_registered),
    ignore([S.REGISTERED, S.CONNECTING, S.WRITING], PushRegistered, "duplicate PUSH_REG"),
    error([S.AWAITING_REG, S.CONNECTING, S.WRITING], PushReady, "prefill finished twice"),

    # The WRITE could not be over before D gives up and may reuse its blocks.
    on(S.CONNECTING, EngineReady, S.FAILED, release_engine, when=decoder_gives_up_first),
    on(S.CONNECTING, EngineReady, S.WRITING, post_write, note_activity, do=_writing),
    ignore([S.REGISTERED, S.AWAITING_REG, S.WRITING], EngineReady, "stale wake-up"),
    on(S.CONNECTING, [EngineLost, TimerFired], S.FAILED, release_engine),
    on(S.WRITING, [EngineLost, TimerFired], S.FAILED, cancel_xfer, release_engine),
    ignore([S.REGISTERED, S.AWAITING_REG], EngineLost, "no engine reference held yet"),
    on([S.REGISTERED, S.AWAITING_REG], TimerFired, S.FAILED),

    on(S.WRITING, WriteDone, S.DONE, release_xfer, note_activity, consume_lease, release_engine),
    on(S.WRITING, WriteFailed, S.FAILED, release_xfer, release_engine),
    ignore([S.REGISTERED, S.AWAITING_REG, S.CONNECTING], [WriteDone, WriteFailed], "no WRITE in flight"),

    on([S.REGISTERED, S.AWAITING_REG], PushAbort, S.FAILED),
    on(S.CONNECTING, PushAbort, S.FAILED, release_engine),
    on(S.WRITING, PushAbort, S.FAILED, cancel_xfer, release_engine),

    # The lease no longer holds the blocks (expired, released, aborted):
    # nothing may be written from them; a WRITE in flight is cancelled.
    on([S.REGISTERED, S.AWAITING_REG], SourceEnded, S.FAILED),
    on(S.CONNECTING, SourceEnded, S.FAILED, release_engine),
    on(S.WRITING, SourceEnded, S.FAILED, cancel_xfer, release_engine),
)

SPEC = Spec(
    name="push_write",
    instance_type=PushWrite,
    initial=S.NEW,
    states=STATES,
    events=EVENTS,
    created_by=(PushRegistered, PushReady),
    table=TABLE,
    fail_closed_event=PushAbort,
    source=SOURCE,
    doc=__doc__,
)
