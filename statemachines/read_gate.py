"""The READ gate: may a reader trust the remote blocks it is about to READ?

One place for the rule, taking plain values (no machine, no plane):

- ``valid_until``: until when (our clock) the remote blocks are surely still
  held, from the remote expiry, the clock offset and, for a renewable lease,
  our unbroken heartbeat chain;
- ``declines``: the gate's verdict at ``now`` (with its safety margin);
- ``max_gap`` and ``chain_start_after_send``: when two heartbeat batches
  still chain (the batcher keeps the chain with them);
- ``signature``: what the verdict reads, relative to ``now``, so that two
  states with equal signatures are judged alike now and after any common
  future (the explorer hashes it instead of re-deriving the gate).

Times are seconds, local clock unless said otherwise.  ``cfg`` is anything
with ``heartbeat_interval``, ``lease_extension`` and ``expiry_safety_margin``
(a PlaneConfig).
"""
from __future__ import annotations

import math

import attrs

from .base import is_finite_number

# Validity of blocks whose expiry cannot be judged (an input is not a finite
# number): never valid, so the gate declines and a READ deadline is now.
NOT_VALID = -math.inf


@attrs.frozen(slots=True)
class GateInputs:
    """Everything the gate reads besides the config and ``now``."""

    expiry: float | None  # the remote's expiry, in the remote clock; None: it sent none
    renewable: bool  # a prefill lease our heartbeats extend (else a fixed-TTL hold)
    clock_offset: float  # remote clock - local clock
    arrived: float  # when the request arrived, i.e. joined the heartbeat batches
    chain_since: float | None  # first send of the engine's current unbroken heartbeat chain
    chain_last: float | None  # last send of that chain


def max_gap(cfg) -> float:
    """Two batches further apart than this may not chain: the lease the first
    one extended can have expired before the second arrives."""
    return cfg.lease_extension - cfg.heartbeat_interval


def chain_start_after_send(since: float | None, last: float | None, now: float, cfg) -> float:
    """The chain's first send once a batch goes out at ``now``: a new chain
    after a gap over ``max_gap`` (e.g. a stall: leases may be gone)."""
    if last is None or now - last > max_gap(cfg):
        return now
    return now if since is None else since


def margin(renewable: bool, cfg) -> float:
    """How far beyond ``now`` the blocks must stay valid.  Heartbeats keep a
    live lease at least extension - interval ahead, so a renewable lease is
    held to at most one interval."""
    return min(cfg.expiry_safety_margin, cfg.heartbeat_interval) if renewable else cfg.expiry_safety_margin


def valid_until(g: GateInputs, cfg) -> float | None:
    """Until when the remote blocks are surely still held; None when the
    remote sent no expiry; NOT_VALID when an input (the expiry, the clock
    offset, our heartbeat times) is NaN or infinite."""
    if g.expiry is None:
        return None
    if not (is_finite_number(g.expiry) and is_finite_number(g.clock_offset)):
        return NOT_VALID
    until = g.expiry - g.clock_offset
    if not math.isfinite(until):  # two huge finite values
        return NOT_VALID
    if g.renewable:
        # Each heartbeat P received extended the lease to at least its send
        # time + extension (our clock; receipt is later still), provided the
        # lease was still alive then: the grant covered the first batch that
        # carried this request and no gap broke the chain since.  A decoder
        # that stalled (SIGSTOP, overload) must not read blocks P reclaimed.
        last, since = g.chain_last, g.chain_since
        if last is not None:
            if not (is_finite_number(last) and is_finite_number(since) and is_finite_number(g.arrived)):
                return NOT_VALID
            if last > g.arrived and until > max(g.arrived + cfg.heartbeat_interval, since):
                until = max(until, last + cfg.lease_extension)
    return until


def declines(g: GateInputs, cfg, now: float) -> bool:
    """True when the blocks are not valid beyond ``now`` + margin.  A remote
    that sent no expiry is not gated."""
    until = valid_until(g, cfg)
    if until is None:
        return False
    # Written so that a comparison with NaN declines; a ``now`` of -inf would
    # make any expiry look far ahead.
    return not (until > now + margin(g.renewable, cfg) and math.isfinite(now))


def signature(g: GateInputs, cfg, now: float) -> tuple | None:
    """What ``declines`` and ``valid_until`` read, relative to ``now``.

    Two inputs with equal signatures at their ``now`` get the same verdict,
    and when admitted the same validity relative to ``now``, at ``now`` and
    after any common future: time passing and further heartbeat sends (each
    at or after ``now``, the chain kept by ``chain_start_after_send``).
    Assumes what holds in a plane: the request arrived and every send so far
    happened at or before ``now``.

    Renewable: the expiry E (our clock) is extended to the last send L +
    extension iff L > arrived A and E > max(A + interval, first send S).
    A and S enter only as those comparisons: a later L (> now >= A) always
    passes the first, ``E > A + interval`` never changes, and a later S
    (>= now) compares with E's relative value.  L enters relative, clamped
    where it no longer counts (L + extension <= now: it extends nothing,
    and the next send breaks the chain).  None: the gate never declines.
    """
    until = valid_until(g, cfg)
    if until is None:
        return None
    if until == NOT_VALID or not math.isfinite(now):
        return ("not_valid",)
    assert g.expiry is not None  # valid_until is None without an expiry
    e = g.expiry - g.clock_offset
    # An expiry already past only ever loses a comparison (the margin is
    # >= 0, later first sends are >= now): all alike.
    rel_e = max(e - now, 0.0)
    if not g.renewable:
        return ("fixed_ttl", rel_e)
    last = g.chain_last
    rel_last = None if last is None else max(last - now, -cfg.lease_extension)
    sent = last is not None and last > g.arrived
    fixed = e > g.arrived + cfg.heartbeat_interval
    chained = g.chain_since is None or e > g.chain_since
    if sent and fixed and chained and last is not None and e <= last + max_gap(cfg):
        # The chain dominates E for good: while it lasts the gate reads
        # L' + extension > E, and a send that breaks it comes more than
        # max_gap after L, past E, so E no longer counts and is already
        # <= now when the gate next reads it: declined.
        return ("chained", rel_last)
    return ("renewable", rel_e, rel_last, sent, fixed, chained)
