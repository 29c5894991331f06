"""A remote engine as seen by this instance.

Requests acquire a reference before they use the engine and release it on
every path out; the engine is never evicted while a reference (an in-flight
transfer, a pending push) exists.  Any activity refreshes liveness; silence
for ``engine_ttl`` makes it STALE and one more TTL evicts it.  The clock
offset is the one from the lowest-RTT handshake sample; a sample that is not
a pair of finite numbers is not taken, and an engine with samples but none
usable has an unknown (NaN) offset, which every expiry gate declines.
"""
from __future__ import annotations

import math
from typing import ClassVar

import attrs

from ..actions import FailRequesters, RemoveRemoteAgent, StartHandshake, WakeRequesters
from ..base import Instance, TimerFired, is_finite_number
from ..events import EngineAcquire, EngineActivity, EngineRelease, HandshakeFailed, HandshakeOk, PeerDisconnected
from ..spec import Spec, State
from ..table import error, ignore, on, rows


@attrs.define(slots=True)
class RemoteEngine(Instance):
    KIND: ClassVar[str] = "remote_engine"
    refs: set = attrs.Factory(set)
    waiters: list = attrs.Factory(list)
    woken: tuple = ()
    attempts: int = 0
    retry_at: float = 0.0
    clock_offset: float = 0.0
    best_rtt: float = float("inf")
    notify_only: bool = False
    last_activity: float = 0.0


def _requester(ev) -> tuple:
    return (ev.requester_kind, ev.requester_key)


def _first_acquire(e: RemoteEngine, ev: EngineAcquire, cfg, now) -> None:
    _add_waiter(e, ev, cfg, now)
    _attempt(e, ev, cfg, now)


def _add_waiter(e: RemoteEngine, ev: EngineAcquire, cfg, now) -> None:
    e.refs.add(_requester(ev))
    e.waiters.append(_requester(ev))


def _add_ref(e: RemoteEngine, ev: EngineAcquire, cfg, now) -> None:
    e.refs.add(_requester(ev))


def _drop_ref(e: RemoteEngine, ev: EngineRelease, cfg, now) -> None:
    r = _requester(ev)
    e.refs.discard(r)
    if r in e.waiters:
        e.waiters.remove(r)


def _attempt(e: RemoteEngine, ev, cfg, now) -> None:
    e.attempts += 1
    e.retry_at = now + cfg.handshake_timeout


def _backoff(e: RemoteEngine, ev, cfg, now) -> None:
    e.retry_at = now + cfg.handshake_backoff * (2 ** (e.attempts - 1))


def _connected(e: RemoteEngine, ev: HandshakeOk, cfg, now) -> None:
    _resampled(e, ev, cfg, now)
    e.notify_only = ev.notify_only
    e.woken, e.waiters = tuple(e.waiters), []


def _resampled(e: RemoteEngine, ev: HandshakeOk, cfg, now) -> None:
    usable = False
    for sample in ev.samples:
        offset, rtt = _sample(sample)
        if offset is None:
            continue
        usable = True
        if rtt < e.best_rtt:
            e.best_rtt, e.clock_offset = rtt, offset
    if ev.samples and not usable and e.best_rtt == math.inf:
        # Samples came, none a number: the offset is unknown, and an unknown
        # offset makes every expiry gate decline (NaN fails closed there).
        e.clock_offset = math.nan
    e.last_activity = now


def _sample(sample) -> tuple[float | None, float]:
    """(offset, rtt) of a clock sample, or (None, inf) unless both are
    finite numbers and the round trip is not negative."""
    try:
        offset, rtt = sample
    except (TypeError, ValueError):
        return None, math.inf
    for x in (offset, rtt):
        if not is_finite_number(x):
            return None, math.inf
    if rtt < 0:
        return None, math.inf
    return float(offset), float(rtt)


def _touch(e: RemoteEngine, ev, cfg, now) -> None:
    e.last_activity = now


def _recheck_later(e: RemoteEngine, ev, cfg, now) -> None:
    # Never evict a referenced engine: look again one TTL from now.
    e.last_activity = now - cfg.engine_ttl


def retries_left(e: RemoteEngine, ev, cfg, now) -> bool:
    """attempts < handshake_max_attempts"""
    return e.attempts < cfg.handshake_max_attempts


def referenced(e: RemoteEngine, ev, cfg, now) -> bool:
    """referenced by a request"""
    return bool(e.refs)


STATES = (
    State("UNKNOWN"),
    State("HANDSHAKING", waits_on_remote=True, deadline=lambda e, cfg, now: e.retry_at),
    State("HANDSHAKE_FAILED", deadline=lambda e, cfg, now: e.retry_at, doc="backing off before a retry"),
    State("CONNECTED", holds={"remote_agent"}, waits_on_remote=True,
          deadline=lambda e, cfg, now: e.last_activity + cfg.engine_ttl),
    State("STALE", holds={"remote_agent"}, waits_on_remote=True,
          deadline=lambda e, cfg, now: e.last_activity + 2 * cfg.engine_ttl,
          doc="silent for engine_ttl; evicted one more TTL later unless referenced"),
    State("EVICTED", terminal=True),
)
EVENTS = (EngineAcquire, EngineRelease, HandshakeOk, HandshakeFailed, EngineActivity, PeerDisconnected, TimerFired)
LIVE = ["HANDSHAKING", "HANDSHAKE_FAILED", "CONNECTED", "STALE"]
UP = ["CONNECTED", "STALE"]

TABLE = rows(
    on("UNKNOWN", EngineAcquire, "HANDSHAKING", StartHandshake, do=_first_acquire),
    error("UNKNOWN", EVENTS[1:-1], "no engine event precedes the first acquire"),

    # Acquire and release keep the state; only the reference set changes.
    *(on(s, EngineAcquire, s, do=_add_waiter) for s in ("HANDSHAKING", "HANDSHAKE_FAILED")),
    *(on(s, EngineAcquire, s, WakeRequesters, do=_add_ref) for s in UP),
    *(on(s, EngineRelease, s, do=_drop_ref) for s in LIVE),

    on(["HANDSHAKING", "HANDSHAKE_FAILED"], HandshakeOk, "CONNECTED", WakeRequesters, do=_connected),
    # NIXL names an agent after its peer, so a repeated add is the same agent:
    # keep it and take the new clock samples.
    *(on(s, HandshakeOk, s, do=_resampled) for s in UP),
    *(rows(on("HANDSHAKING", e, "HANDSHAKE_FAILED", when=retries_left, do=_backoff),
           on("HANDSHAKING", e, "EVICTED", FailRequesters)) for e in (HandshakeFailed, TimerFired)),
    ignore(["HANDSHAKE_FAILED"] + UP, HandshakeFailed, "late failure of a superseded attempt"),
    on("HANDSHAKE_FAILED", TimerFired, "HANDSHAKING", StartHandshake, when=referenced, do=_attempt),
    on("HANDSHAKE_FAILED", TimerFired, "EVICTED"),

    on(UP, EngineActivity, "CONNECTED", do=_touch),
    ignore(["HANDSHAKING", "HANDSHAKE_FAILED"], EngineActivity, "activity before the handshake completes"),
    on("CONNECTED", TimerFired, "STALE"),
    on("STALE", TimerFired, "STALE", when=referenced, do=_recheck_later),
    on("STALE", TimerFired, "EVICTED", RemoveRemoteAgent),

    on(["HANDSHAKING", "HANDSHAKE_FAILED"], PeerDisconnected, "EVICTED", FailRequesters),
    on(UP, PeerDisconnected, "EVICTED", RemoveRemoteAgent, FailRequesters),
)

SPEC = Spec(
    name="remote_engine",
    instance_type=RemoteEngine,
    initial="UNKNOWN",
    states=STATES,
    events=EVENTS,
    table=TABLE,
    fail_closed_event=PeerDisconnected,
    doc=__doc__,
)
