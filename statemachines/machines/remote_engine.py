"""A remote engine as seen by this instance.

Requests acquire a reference before they use the engine and release it on
every path out; the engine is never evicted while a reference (an in-flight
transfer, a pending push) exists.  Any activity refreshes liveness; silence
for ``stale_after`` (half of ``engine_ttl``) makes it STALE and twice that
evicts it: an idle engine is gone one TTL after its last activity, as vLLM's
engine_ttl means.

A failed handshake attempt (refused, or no answer in handshake_timeout)
fails every requester at once (their recvs are reported failed: vLLM
recomputes) and backs the engine off: handshake_backoff doubled per
consecutive failure, at most handshake_max_attempts - 1 doublings.  While it
backs off, a new requester is failed at once instead of waiting; the first
one after it starts the next attempt.  So a dead or silent peer costs its own
requests at most one handshake_timeout, never anyone else's, and is tried at
most once per backoff however many requests name it; a failed engine nobody
asks for is forgotten stale_after past its backoff.  The clock
offset is the one from the lowest-RTT handshake sample; a sample that is not
a pair of finite numbers is not taken, and an engine with samples but none
usable has an unknown (NaN) offset, which every expiry gate declines.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Set
from enum import StrEnum
from typing import Any, ClassVar

import attrs

from ..actions import FailRequesters, RemoveRemoteAgent, StartHandshake, WakeRequesters
from ..base import Instance, TimerFired, is_finite_number
from ..emit import emits
from ..events import EngineAcquire, EngineActivity, EngineRelease, HandshakeFailed, HandshakeOk, PeerDisconnected
from ..spec import Spec, State
from ..table import error, ignore, on, rows


class Requesters(Set):
    """The (kind, key) requesters referencing an engine, as a set of pairs,
    kept as one set of keys per kind (``by_kind``): no tuple per reference
    (an engine holds one reference per request in flight on it: ~140 bytes
    as a pair in a set, 35-85 as a key, as full as the set happens to be).  The effects add and drop through
    ``by_kind`` itself, in C, as they did with a set of pairs; a kind whose
    keys are all gone keeps its empty set (there are three kinds)."""

    __slots__ = ("by_kind",)

    def __init__(self, pairs: Iterable[tuple[str, Any]] = ()):
        self.by_kind: defaultdict[str, set] = defaultdict(set)
        for kind, key in pairs:
            self.by_kind[kind].add(key)

    def copy(self) -> "Requesters":
        """An independent copy (the explorer copies every engine per explored move)."""
        c = object.__new__(Requesters)
        by_kind = c.by_kind = defaultdict(set)
        for kind, keys in self.by_kind.items():
            by_kind[kind] = keys.copy()
        return c

    def __contains__(self, pair: object) -> bool:
        if not isinstance(pair, tuple) or len(pair) != 2:
            return False
        keys = self.by_kind.get(pair[0]) if isinstance(pair[0], str) else None
        try:
            return keys is not None and pair[1] in keys
        except TypeError:  # an unhashable key: never added
            return False

    def pairs(self) -> list[tuple[str, Any]]:
        """The (kind, key) pairs, as a list (the explorer reads every
        engine's references per explored state: a list is the cheapest)."""
        return [(kind, key) for kind, keys in self.by_kind.items() for key in keys]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.pairs())

    def __len__(self) -> int:
        return sum(map(len, self.by_kind.values()))

    def __bool__(self) -> bool:
        return any(self.by_kind.values())

    def __repr__(self) -> str:
        return f"Requesters({sorted(self)!r})"


@attrs.define(slots=True)
class RemoteEngine(Instance):
    KIND: ClassVar[str] = "remote_engine"
    refs: Requesters = attrs.Factory(Requesters)
    waiters: list = attrs.Factory(list)
    woken: tuple = ()
    attempts: int = 0
    retry_at: float = 0.0
    clock_offset: float = 0.0
    best_rtt: float = float("inf")
    notify_only: bool = False
    last_activity: float = 0.0
    incarnation: str | None = None  # the one its last handshake named


def _requester(ev) -> tuple:
    return (ev.requester_kind, ev.requester_key)


def _wait_and_attempt(e: RemoteEngine, ev: EngineAcquire, cfg, now) -> None:
    """Add the requester as a waiter and start a handshake attempt."""
    _add_waiter(e, ev, cfg, now)
    _attempt(e, ev, cfg, now)


def _add_waiter(e: RemoteEngine, ev: EngineAcquire, cfg, now) -> None:
    """Add the requester as a reference that waits for the handshake."""
    e.refs.by_kind[ev.requester_kind].add(ev.requester_key)
    e.waiters.append(_requester(ev))


def _add_ref(e: RemoteEngine, ev: EngineAcquire, cfg, now) -> None:
    """Add the requester as a reference (it is woken at once)."""
    e.refs.by_kind[ev.requester_kind].add(ev.requester_key)


def _drop_ref(e: RemoteEngine, ev: EngineRelease, cfg, now) -> None:
    """Drop the requester's reference (and its wait, if any)."""
    e.refs.by_kind[ev.requester_kind].discard(ev.requester_key)
    if e.waiters:
        r = _requester(ev)
        if r in e.waiters:
            e.waiters.remove(r)


def _attempt(e: RemoteEngine, ev, cfg, now) -> None:
    """Count an attempt; it times out at now + handshake_timeout."""
    e.attempts += 1
    e.retry_at = now + cfg.handshake_timeout


def _backoff(e: RemoteEngine, ev, cfg, now) -> None:
    """No waiters (all failed); no retry before now + handshake_backoff *
    2**(k-1), k = consecutive failures, at most handshake_max_attempts."""
    e.waiters = []
    e.retry_at = now + cfg.handshake_backoff * (2 ** (min(e.attempts, cfg.handshake_max_attempts) - 1))


def _connected(e: RemoteEngine, ev: HandshakeOk, cfg, now) -> None:
    """Take the clock samples, the notify-only flag, and wake the waiters."""
    _resampled(e, ev, cfg, now)
    e.notify_only = ev.notify_only
    e.woken, e.waiters = tuple(e.waiters), []


def _resampled(e: RemoteEngine, ev: HandshakeOk, cfg, now) -> None:
    """Keep the offset of the lowest-RTT usable clock sample and the
    incarnation named; last activity = now."""
    # The agent just added is this incarnation's (a restarted peer's
    # metadata replaces its predecessor's under the same name).
    e.incarnation = ev.incarnation
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
    """Last activity = now: the STALE timer restarts."""
    e.last_activity = now


def _recheck_later(e: RemoteEngine, ev, cfg, now) -> None:
    """Referenced: last activity = now - stale_after, so STALE looks again stale_after later."""
    # Never evict a referenced engine: look again later.
    e.last_activity = now - cfg.stale_after


def backing_off(e: RemoteEngine, ev, cfg, now) -> bool:
    """now < retry_at"""
    return now < e.retry_at


def referenced(e: RemoteEngine, ev, cfg, now) -> bool:
    """referenced by a request"""
    return bool(e.refs)


# ----------------------------------------------------------------- actions
@emits(StartHandshake)
def start_handshake(e: RemoteEngine, ev, cfg, now) -> StartHandshake:
    return StartHandshake(e.key, e.attempts)


@emits(RemoveRemoteAgent)
def remove_remote_agent(e: RemoteEngine, ev, cfg, now) -> RemoveRemoteAgent:
    return RemoveRemoteAgent(e.key)


@emits(WakeRequesters)
def wake_waiters(e: RemoteEngine, ev, cfg, now) -> WakeRequesters:
    """Connected: wake every requester that waited for the handshake."""
    return WakeRequesters(e.key, e.woken, e.clock_offset)


@emits(WakeRequesters)
def wake_acquirer(e: RemoteEngine, ev: EngineAcquire, cfg, now) -> WakeRequesters:
    """Already connected: wake only the new requester."""
    return WakeRequesters(e.key, (_requester(ev),), e.clock_offset)


@emits(FailRequesters)
def fail_requesters(e: RemoteEngine, ev: HandshakeFailed | PeerDisconnected, cfg, now) -> FailRequesters:
    """Fail every referencing requester with the event's reason (else the state left)."""
    return FailRequesters(e.key, tuple(sorted(e.refs)), ev.reason or e.state.lower())


@emits(FailRequesters)
def fail_acquirer(e: RemoteEngine, ev: EngineAcquire, cfg, now) -> FailRequesters:
    """Backing off after a failed handshake: fail only the new requester, at once."""
    return FailRequesters(e.key, (_requester(ev),), "backing off after a failed handshake")


@emits(FailRequesters)
def fail_requesters_timed_out(e: RemoteEngine, ev: TimerFired, cfg, now) -> FailRequesters:
    """The handshake timed out: the reason is the state it timed out in."""
    return FailRequesters(e.key, tuple(sorted(e.refs)), e.state.lower())


class EngineState(StrEnum):
    """The states of a remote engine: the names its table uses."""

    UNKNOWN = "UNKNOWN"
    HANDSHAKING = "HANDSHAKING"
    HANDSHAKE_FAILED = "HANDSHAKE_FAILED"
    CONNECTED = "CONNECTED"
    STALE = "STALE"
    EVICTED = "EVICTED"


S = EngineState  # the short name the table rows use

STATES = (
    State(S.UNKNOWN),
    State(S.HANDSHAKING, waits_on_remote=True, deadline=lambda e, cfg, now: e.retry_at),
    State(S.HANDSHAKE_FAILED, deadline=lambda e, cfg, now: e.retry_at + cfg.stale_after,
          doc="backing off until retry_at (requesters fail at once); forgotten stale_after later"),
    State(S.CONNECTED, holds={"remote_agent"}, waits_on_remote=True,
          deadline=lambda e, cfg, now: e.last_activity + cfg.stale_after),
    State(S.STALE, holds={"remote_agent"}, waits_on_remote=True,
          deadline=lambda e, cfg, now: e.last_activity + 2 * cfg.stale_after,
          doc="silent for stale_after (engine_ttl / 2); evicted at twice that unless referenced"),
    State(S.EVICTED, terminal=True),
)
EVENTS = (EngineAcquire, EngineRelease, HandshakeOk, HandshakeFailed, EngineActivity, PeerDisconnected, TimerFired)
LIVE = [S.HANDSHAKING, S.HANDSHAKE_FAILED, S.CONNECTED, S.STALE]
UP = [S.CONNECTED, S.STALE]

TABLE = rows(
    on(S.UNKNOWN, EngineAcquire, S.HANDSHAKING, start_handshake, do=_wait_and_attempt),
    error(S.UNKNOWN, EVENTS[1:-1], "no engine event precedes the first acquire"),

    # Acquire and release keep the state; only the reference set changes.
    on(S.HANDSHAKING, EngineAcquire, S.HANDSHAKING, do=_add_waiter),
    # Backing off: the requester fails at once (recomputes), nothing queues
    # behind a dead peer; once the backoff is over it starts the next attempt.
    on(S.HANDSHAKE_FAILED, EngineAcquire, S.HANDSHAKE_FAILED, fail_acquirer, when=backing_off),
    on(S.HANDSHAKE_FAILED, EngineAcquire, S.HANDSHAKING, start_handshake, do=_wait_and_attempt),
    *(on(s, EngineAcquire, s, wake_acquirer, do=_add_ref) for s in UP),
    *(on(s, EngineRelease, s, do=_drop_ref) for s in LIVE),

    # A late success (after the attempt timed out) connects all the same.
    on([S.HANDSHAKING, S.HANDSHAKE_FAILED], HandshakeOk, S.CONNECTED, wake_waiters, do=_connected),
    # NIXL names an agent after its peer, so a repeated add is the same agent:
    # keep it and take the new clock samples.
    *(on(s, HandshakeOk, s, do=_resampled) for s in UP),
    on(S.HANDSHAKING, HandshakeFailed, S.HANDSHAKE_FAILED, fail_requesters, do=_backoff),
    on(S.HANDSHAKING, TimerFired, S.HANDSHAKE_FAILED, fail_requesters_timed_out, do=_backoff),
    ignore([S.HANDSHAKE_FAILED] + UP, HandshakeFailed, "late failure of a superseded attempt"),
    on(S.HANDSHAKE_FAILED, TimerFired, S.EVICTED),

    on(UP, EngineActivity, S.CONNECTED, do=_touch),
    ignore([S.HANDSHAKING, S.HANDSHAKE_FAILED], EngineActivity, "activity before the handshake completes"),
    on(S.CONNECTED, TimerFired, S.STALE),
    on(S.STALE, TimerFired, S.STALE, when=referenced, do=_recheck_later),
    on(S.STALE, TimerFired, S.EVICTED, remove_remote_agent),

    on([S.HANDSHAKING, S.HANDSHAKE_FAILED], PeerDisconnected, S.EVICTED, fail_requesters),
    on(UP, PeerDisconnected, S.EVICTED, remove_remote_agent, fail_requesters),
)

SPEC = Spec(
    name="remote_engine",
    instance_type=RemoteEngine,
    initial=S.UNKNOWN,
    states=STATES,
    events=EVENTS,
    created_by=(EngineAcquire,),
    table=TABLE,
    fail_closed_event=PeerDisconnected,
    doc=__doc__,
)
