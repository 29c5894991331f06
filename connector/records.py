"""Everything the scheduler side and the worker ranks tell each other.

In a serving engine the scheduler-role connector and each worker-role
connector live in different processes and share nothing but what the
engine passes between them: the per-step metadata (scheduler -> every
worker, pickled), the per-step results (each worker -> scheduler) and, at
start-up, what each worker rank publishes about itself.  These records are
that traffic, and nothing else crosses: plain, frozen, picklable attrs
classes of builtins, each carrying ``version`` so that two sides built from
different kvplane versions fail with ``RecordVersionMismatch`` instead of
misreading each other.
"""
from __future__ import annotations

from typing import Any

import attrs

from kvplane.statemachines.recv_failure import RecvFailure

from .params import RemoteKV

RECORD_VERSION = 1


class RecordVersionMismatch(ValueError):
    """A record from a side built from another kvplane version."""


class BadRecord(ValueError):
    """Not a record of the expected kind (the engine passed something else)."""


def _tuple(value: Any) -> tuple:
    return tuple(value)


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _id_set(value: Any) -> frozenset[str]:
    return frozenset(value)


def _int_set(value: Any) -> frozenset[int]:
    return frozenset(value)


def _reasons(value: Any) -> tuple[tuple[str, RecvFailure], ...]:
    return tuple((str(rid), RecvFailure(reason)) for rid, reason in value)


@attrs.frozen(kw_only=True)
class RankInfo:
    """What a worker rank publishes at start-up (vLLM: the handshake metadata
    the engine collects from every worker)."""

    rank: int
    engine_id: str  # the rank's own engine id (ranks.rank_engine_id)
    side_channel_port: int
    public_key: bytes | None  # the engine's CURVE public key (z85); None when insecure
    version: int = RECORD_VERSION
    # The rank's incarnation (its driver's token, named in its handshake
    # replies): the params the scheduler hands out name it.
    incarnation: str | None = None


@attrs.frozen(kw_only=True)
class NewRemoteRequest:
    """A request whose KV a remote engine holds (decode side, or turn 2)."""

    request_id: str
    remote: RemoteKV
    push: bool = False


@attrs.frozen(kw_only=True)
class Load:
    """Blocks are allocated: what to read into them, and whether the
    scheduler awaits the recv (a full-prefix hit may be awaited with no
    tokens to load)."""

    request_id: str
    block_ids: tuple[int, ...] = attrs.field(converter=_ints)
    num_remote_tokens: int
    awaiting: bool


@attrs.frozen(kw_only=True)
class Finish:
    """A request with a remote source finished; ``hold`` names the lease
    that keeps its blocks for a next turn (None: free them)."""

    request_id: str
    block_ids: tuple[int, ...] = attrs.field(converter=_ints)
    hold: "LeaseGrant | None" = None


@attrs.frozen(kw_only=True)
class LeaseGrant:
    """Put blocks under a lease, named ``name`` (the capability the scheduler
    handed the consumer), for ``consumers_per_rank`` readers on each rank
    but ``unread_ranks`` (replicated KV read from fewer ranks: no reader
    there, so no lease; the rank reports its sending done at once)."""

    request_id: str
    name: str
    block_ids: tuple[int, ...] = attrs.field(converter=_ints)
    consumers_per_rank: int = 1
    push: bool = False
    unread_ranks: tuple[int, ...] = attrs.field(default=(), converter=_ints)


@attrs.frozen(kw_only=True)
class StepMeta:
    """Scheduler -> every worker rank, once per engine step (vLLM: the
    KVConnectorMetadata built by build_connector_meta).  Applied in field
    order: new requests, loads, running, finished, grants, aborts."""

    new_requests: tuple[NewRemoteRequest, ...] = attrs.field(default=(), converter=_tuple)
    loads: tuple[Load, ...] = attrs.field(default=(), converter=_tuple)
    running: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    finished: tuple[Finish, ...] = attrs.field(default=(), converter=_tuple)
    grants: tuple[LeaseGrant, ...] = attrs.field(default=(), converter=_tuple)
    aborts: tuple[str, ...] = attrs.field(default=(), converter=_tuple)  # requests with a remote source
    lease_aborts: tuple[str, ...] = attrs.field(default=(), converter=_tuple)  # leases to free now
    version: int = RECORD_VERSION

    @property
    def empty(self) -> bool:
        return not (self.new_requests or self.loads or self.running or self.finished or self.grants
                    or self.aborts or self.lease_aborts)


@attrs.frozen(kw_only=True)
class WorkerReport:
    """One worker rank -> scheduler, once per step (vLLM: the worker's
    KVConnectorOutput).  Every id is the scheduler's request id; each rank
    reports a request once."""

    rank: int
    finished_sending: frozenset[str] = attrs.field(default=frozenset(), converter=_id_set)
    finished_recving: frozenset[str] = attrs.field(default=frozenset(), converter=_id_set)
    failed_recving: frozenset[str] = attrs.field(default=frozenset(), converter=_id_set)
    load_error_blocks: frozenset[int] = attrs.field(default=frozenset(), converter=_int_set)
    # Why each failed recv failed (for reports and summaries).
    fail_reasons: tuple[tuple[str, RecvFailure], ...] = attrs.field(default=(), converter=_reasons)
    version: int = RECORD_VERSION

    @property
    def empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


def check(record: Any, kind: type) -> Any:
    """``record`` if it is a ``kind`` of this kvplane version; else a typed error."""
    if not isinstance(record, kind):
        raise BadRecord(f"expected a {kind.__name__}, got {type(record).__name__}")
    version = getattr(record, "version", None)
    if version != RECORD_VERSION:
        raise RecordVersionMismatch(
            f"{kind.__name__} version {version!r}; this side speaks version {RECORD_VERSION}")
    return record
