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

from typing import ClassVar

import attrs

from ..actions import FreeBlocks, RefuseForeignSender, RefuseWrongCount
from ..base import Instance, TimerFired
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
    lease.block_ids = ev.block_ids
    lease.expected_consumers = ev.expected_consumers
    lease.renewable = ev.renewable
    lease.expiry = now + (ev.duration if ev.duration is not None else cfg.kv_lease_duration)


def _regrant(lease: Lease, ev: LeaseGranted, cfg, now) -> None:
    # A second grant for the same request adds its blocks (a retransmitted
    # grant adds nothing): one lease then frees every block exactly once.
    lease.block_ids = lease.block_ids + tuple(b for b in ev.block_ids if b not in lease.block_ids)
    lease.expiry = max(lease.expiry, now + (ev.duration if ev.duration is not None else cfg.kv_lease_duration))


def _bind(lease: Lease, ev, cfg, now) -> None:
    if ev.sender is not None and ev.sender not in lease.bound:
        lease.bound = lease.bound | {ev.sender}


def _extend(lease: Lease, ev, cfg, now) -> None:
    _bind(lease, ev, cfg, now)
    new = now + cfg.lease_extension
    if new > lease.expiry:
        lease.expiry = new
        lease.extensions += 1


def _consumed(lease: Lease, ev: ConsumerDone, cfg, now) -> None:
    _bind(lease, ev, cfg, now)
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


_expiry = lambda lease, cfg, now: lease.expiry  # noqa: E731  (a deadline is data on the instance)

STATES = (
    State("PREFILLING", doc="blocks still owned by the running prefill"),
    State("LEASED", holds={"blocks"}, waits_on_remote=True, deadline=_expiry),
    State("PARTIALLY_READ", holds={"blocks"}, waits_on_remote=True, deadline=_expiry,
          doc="some, not all, expected consumers have read"),
    State("EXPIRED", terminal=True, doc="blocks reclaimed at the deadline: the consumers went silent"),
    State("RELEASED", terminal=True),
)
EVENTS = (LeaseGranted, LeaseHeartbeat, ConsumerDone, LeaseAbort, TimerFired)
HELD = ["LEASED", "PARTIALLY_READ"]

TABLE = rows(
    on("PREFILLING", LeaseGranted, "LEASED", do=_grant),
    *(on(s, LeaseGranted, s, do=_regrant) for s in HELD),
    ignore("PREFILLING", LeaseHeartbeat, "not leased yet; the grant starts a full lease"),
    error("PREFILLING", ConsumerDone, "consumer finished before the blocks were leased"),
    on("PREFILLING", LeaseAbort, "RELEASED"),

    on(HELD, TimerFired, "EXPIRED", FreeBlocks),
    on(HELD, LeaseAbort, "RELEASED", FreeBlocks),
    *(
        rows(
            on(s, LeaseHeartbeat, s, RefuseForeignSender, when=foreign_sender),
            on(s, LeaseHeartbeat, s, when=renewable, do=_extend),
            on(s, LeaseHeartbeat, s, do=_bind),  # fixed TTL: a decoder's hold is not extended
        )
        for s in HELD
    ),
    # Guards are tried in order.  Refusals first: a stranger's message or a
    # count that disagrees with the plan changes nothing (counted by the
    # embedder), and a duplicate never counts as the last consumer.
    on("LEASED", ConsumerDone, "LEASED", RefuseForeignSender, when=foreign_sender),
    on("LEASED", ConsumerDone, "LEASED", RefuseWrongCount, when=wrong_consumer_count),
    on("LEASED", ConsumerDone, "RELEASED", FreeBlocks, when=last_consumer, do=_consumed),
    on("LEASED", ConsumerDone, "PARTIALLY_READ", do=_consumed),
    on("PARTIALLY_READ", ConsumerDone, "PARTIALLY_READ", RefuseForeignSender, when=foreign_sender),
    on("PARTIALLY_READ", ConsumerDone, "PARTIALLY_READ", RefuseWrongCount, when=wrong_consumer_count),
    on("PARTIALLY_READ", ConsumerDone, "PARTIALLY_READ", when=duplicate_consumer),
    on("PARTIALLY_READ", ConsumerDone, "RELEASED", FreeBlocks, when=last_consumer, do=_consumed),
    on("PARTIALLY_READ", ConsumerDone, "PARTIALLY_READ", do=_consumed),
)

SPEC = Spec(
    name="lease",
    instance_type=Lease,
    initial="PREFILLING",
    states=STATES,
    events=EVENTS,
    table=TABLE,
    fail_closed_event=LeaseAbort,
    doc=__doc__,
)
