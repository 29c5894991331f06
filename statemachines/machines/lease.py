"""Lease on blocks that remote consumers will read.

On the prefill side the lease starts when prefill finishes, lasts
``kv_lease_duration`` and is extended by heartbeats to
max(old deadline, now + extension).  On the decode side the same machine
holds a finished request's blocks for a bidirectional turn 2, with a fixed
TTL (``decoder_kv_blocks_ttl``) that heartbeats do not extend.

Consumers are counted by sender, so a duplicated completion notification
cannot free blocks another consumer is still reading.

A lease is bound to its consumers: the first ``expected_consumers``
distinct senders of a heartbeat or completion bind it, and a heartbeat or
completion from any other sender is refused (``RefuseForeignSender``), as
is a completion whose consumer count disagrees with the plan
(``RefuseWrongCount``): neither frees, extends or changes the lease.  A
stimulus without a sender (an internal one) binds nothing and is not
refused for it.  Which senders may reach the lease at all is the
embedder's part (authenticated agents, an unguessable lease name).
"""
from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

import attrs

from ..actions import FreeBlocks, RefuseForeignSender, RefuseWrongCount
from ..base import Instance, TimerFired
from ..emit import emits
from ..events import ConsumerDone, LeaseAbort, LeaseGranted, LeaseHeartbeat
from ..spec import Spec, State
from ..table import error, ignore, on, rows


@attrs.define(slots=True)
class Lease(Instance):
    KIND: ClassVar[str] = "lease"
    block_ids: tuple = ()
    expected_consumers: int = 1
    consumers: frozenset = frozenset()
    # Senders (consumer engines) the lease accepts heartbeats and completions from.
    bound: frozenset = frozenset()
    renewable: bool = True
    expiry: float = 0.0
    extensions: int = 0


def _grant(lease: Lease, ev: LeaseGranted, cfg, now) -> None:
    """Lease the blocks until now + the grant's duration (default kv_lease_duration)."""
    lease.block_ids = ev.block_ids
    lease.expected_consumers = ev.expected_consumers
    lease.renewable = ev.renewable
    lease.expiry = now + (ev.duration if ev.duration is not None else cfg.kv_lease_duration)


def _regrant(lease: Lease, ev: LeaseGranted, cfg, now) -> None:
    """Add the new grant's blocks; expiry = max(old, now + duration)."""
    # A second grant for the same request adds its blocks (a retransmitted
    # grant adds nothing): one lease then frees every block exactly once.
    lease.block_ids = lease.block_ids + tuple(b for b in ev.block_ids if b not in lease.block_ids)
    lease.expiry = max(lease.expiry, now + (ev.duration if ev.duration is not None else cfg.kv_lease_duration))


def _bind(lease: Lease, ev, cfg, now) -> None:
    """Bind the sender as a consumer (a free slot admitted it); the expiry stays."""
    if ev.sender is not None and ev.sender not in lease.bound:
        lease.bound = lease.bound | {ev.sender}


def _extend(lease: Lease, ev, cfg, now) -> None:
    """Bind the sender; expiry = max(old, now + lease_extension)."""
    _bind(lease, ev, cfg, now)
    new = now + cfg.lease_extension
    if new > lease.expiry:
        lease.expiry = new
        lease.extensions += 1


def _consumed(lease: Lease, ev: ConsumerDone, cfg, now) -> None:
    """Bind the sender and count it as a consumer that has read."""
    _bind(lease, ev, cfg, now)
    _count(lease, ev, cfg, now)


def _count(lease: Lease, ev: ConsumerDone, cfg, now) -> None:
    """Count the sender as a consumer that has read (the last one binds
    nothing: the lease is released, no message can act on it again)."""
    lease.consumers = lease.consumers | {ev.consumer}


def admits(lease: Lease, sender: str | None) -> bool:
    """Whether ``sender`` may act on the lease: unnamed (internal), already
    bound, or a consumer slot is still free for it to bind."""
    return sender is None or sender in lease.bound or len(lease.bound) < lease.expected_consumers


def foreign_sender(lease: Lease, ev, cfg, now) -> bool:
    """sender not bound to the lease"""
    return not admits(lease, ev.sender)


def renewable(lease: Lease, ev, cfg, now) -> bool:
    """renewable lease"""
    return lease.renewable


def duplicate_consumer(lease: Lease, ev: ConsumerDone, cfg, now) -> bool:
    """consumer already counted"""
    return ev.consumer in lease.consumers


def wrong_consumer_count(lease: Lease, ev: ConsumerDone, cfg, now) -> bool:
    """notif disagrees with planned consumers"""
    return ev.expected_consumers != lease.expected_consumers


def last_consumer(lease: Lease, ev: ConsumerDone, cfg, now) -> bool:
    """last expected consumer"""
    return len(lease.consumers) + 1 >= lease.expected_consumers


# ----------------------------------------------------------------- actions
@emits(FreeBlocks)
def free_expired(lease: Lease, ev, cfg, now) -> FreeBlocks:
    return FreeBlocks(lease.key, lease.block_ids, "expired")


@emits(FreeBlocks)
def free_aborted(lease: Lease, ev, cfg, now) -> FreeBlocks:
    return FreeBlocks(lease.key, lease.block_ids, "aborted")


@emits(FreeBlocks)
def free_consumed(lease: Lease, ev, cfg, now) -> FreeBlocks:
    return FreeBlocks(lease.key, lease.block_ids, "consumed")


@emits(RefuseForeignSender)
def refuse_foreign_sender(lease: Lease, ev, cfg, now) -> RefuseForeignSender:
    return RefuseForeignSender(lease.key, ev.sender, "foreign_sender")


@emits(RefuseWrongCount)
def refuse_wrong_count(lease: Lease, ev: ConsumerDone, cfg, now) -> RefuseWrongCount:
    return RefuseWrongCount(lease.key, ev.sender, "wrong_consumer_count")


_expiry = lambda lease, cfg, now: lease.expiry  # noqa: E731  (a deadline is data on the instance)


class LeaseState(StrEnum):
    """The states of a lease: the names its table uses."""

    PREFILLING = "PREFILLING"
    LEASED = "LEASED"
    PARTIALLY_READ = "PARTIALLY_READ"
    EXPIRED = "EXPIRED"
    RELEASED = "RELEASED"


S = LeaseState  # the short name the table rows use

STATES = (
    State(S.PREFILLING, doc="blocks still owned by the running prefill"),
    State(S.LEASED, holds={"blocks"}, waits_on_remote=True, deadline=_expiry),
    State(S.PARTIALLY_READ, holds={"blocks"}, waits_on_remote=True, deadline=_expiry,
          doc="some, not all, expected consumers have read"),
    State(S.EXPIRED, terminal=True, doc="blocks reclaimed at the deadline: the consumers went silent"),
    State(S.RELEASED, terminal=True),
)
EVENTS = (LeaseGranted, LeaseHeartbeat, ConsumerDone, LeaseAbort, TimerFired)
HELD = [S.LEASED, S.PARTIALLY_READ]

TABLE = rows(
    on(S.PREFILLING, LeaseGranted, S.LEASED, do=_grant),
    *(on(s, LeaseGranted, s, do=_regrant) for s in HELD),
    ignore(S.PREFILLING, LeaseHeartbeat, "not leased yet; the grant starts a full lease"),
    error(S.PREFILLING, ConsumerDone, "consumer finished before the blocks were leased"),
    on(S.PREFILLING, LeaseAbort, S.RELEASED),

    on(HELD, TimerFired, S.EXPIRED, free_expired),
    on(HELD, LeaseAbort, S.RELEASED, free_aborted),
    # Guards are tried in order.  Refusals first: a stranger's message or a
    # count that disagrees with the plan changes nothing (counted by the
    # embedder), and a duplicate never counts as the last consumer.
    *(
        rows(
            on(s, LeaseHeartbeat, s, refuse_foreign_sender, when=foreign_sender),
            on(s, LeaseHeartbeat, s, when=renewable, do=_extend),
            on(s, LeaseHeartbeat, s, do=_bind),  # fixed TTL: a decoder's hold is not extended
            on(s, ConsumerDone, s, refuse_foreign_sender, when=foreign_sender),
            on(s, ConsumerDone, s, refuse_wrong_count, when=wrong_consumer_count),
            on(s, ConsumerDone, s, when=duplicate_consumer) if s == S.PARTIALLY_READ else [],
            on(s, ConsumerDone, S.RELEASED, free_consumed, when=last_consumer, do=_count),
            on(s, ConsumerDone, S.PARTIALLY_READ, do=_consumed),
        )
        for s in HELD
    ),
)

SPEC = Spec(
    name="lease",
    instance_type=Lease,
    initial=S.PREFILLING,
    states=STATES,
    events=EVENTS,
    created_by=(LeaseGranted,),
    table=TABLE,
    fail_closed_event=LeaseAbort,
    doc=__doc__,
)
