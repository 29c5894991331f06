"""The protocol between an engine's scheduler process and its worker rank
processes in ``kvplane run`` (over a multiprocessing Pipe).

The connector's own traffic is ``kvplane.connector.records`` (StepMeta,
WorkerReport, RankInfo); these messages wrap it with what the synthetic
job needs besides: filling and verifying the rank's shard of blocks (a
rank's KV lives in its process only), and its end-of-run summary.
"""
from __future__ import annotations

import attrs

from kvplane.connector.records import RankInfo, StepMeta, WorkerReport
from kvplane.transport.transfer_times import TransferSample


@attrs.frozen(kw_only=True)
class RankOptions:
    """What the scheduler process hands a rank process when it spawns it."""

    engine_id: str  # the engine's (not the rank's) id
    rank: int
    tp_size: int
    plane_fields: dict  # PlaneConfig fields (the scheduler's config, rebuilt in the rank)
    num_blocks: int
    block_elems: int  # elements of a whole (unsharded) block; the rank holds block_elems // tp_size
    keypair: tuple[bytes, bytes]  # the engine's CURVE keypair (shared by its ranks)
    peers: dict  # engine id -> public key
    log_path: str | None = None  # the rank's event log
    clock_skew: float = 0.0  # added to the plane's clock (the engine's, shared by its ranks)
    drop_notifications: float = 0.0  # fault injection: drop this fraction of received notifications
    seed: int = 0
    # Make a bare NIXL READ of each READ's size beside the job's (``bare_read``).
    measure_bare_read: bool = False
    side_channel_host: str = "127.0.0.1"  # the address the rank's side channel binds


# ------------------------------------------------------------ scheduler -> rank
@attrs.frozen
class Step:
    meta: StepMeta


@attrs.frozen
class Fill:
    """Write the pattern of ``lid`` into blocks (the prefill, or a recompute);
    a non-zero ``token`` is acknowledged in the next RankStep (as verified)."""

    lid: str
    block_ids: tuple[int, ...]
    first_index: int
    token: int = 0


@attrs.frozen
class Verify:
    """Check blocks against ``lid``'s pattern; answer in the next RankStep."""

    token: int
    lid: str
    block_ids: tuple[int, ...]
    first_index: int


@attrs.frozen
class Poison:
    """Blocks returned to the pool: overwrite them as a reuse would."""

    block_ids: tuple[int, ...]


@attrs.frozen
class Stop:
    """Send the RankSummary and exit."""


TO_RANK = (Step, Fill, Verify, Poison, Stop)


# ------------------------------------------------------------ rank -> scheduler
@attrs.frozen
class RankReady:
    info: RankInfo
    os_pid: int


@attrs.frozen
class RankStep:
    report: WorkerReport
    verified: tuple[tuple[int, bool], ...] = ()  # (token, every byte matched)
    # (request id, "heartbeat" | why the lease ended, raw monotonic time, the lease's expiry then)
    lease_events: tuple[tuple[str, str, float, float], ...] = ()
    # (remote engine, its clock offset) measured by a handshake since the last RankStep
    clock_offsets: tuple[tuple[str, float], ...] = ()


@attrs.frozen
class RankCrashed:
    rank: int
    traceback: str


@attrs.frozen(kw_only=True)
class RankSummary:
    rank: int
    engine_id: str
    counters: dict
    heartbeats_received: int
    heartbeats_sent: int
    leases_ended: dict  # reason -> count
    plane_held: list
    held_lease_blocks: int
    bytes_moved: int
    busy_s: float  # time with a transfer of this rank posted
    engines_evicted: int  # remote engines the plane evicted during the run
    engines_closed_at_shutdown: int
    anomalies: dict  # the plane's fail-closed and anomaly counts, by name
    nixl_calls: dict  # the slowest NIXL call of each kind
    transfers: tuple[TransferSample, ...] = ()  # each transfer this rank posted: post -> done
    # Bare NIXL READs of the sizes this rank read, made beside them (RankOptions.measure_bare_read).
    bare_reads: tuple[TransferSample, ...] = ()
    bare_read_error: str | None = None
    cpu_s: float = 0.0  # the process's CPU time over its life
    plane_cpu_s: float = 0.0  # CPU time inside the plane's handle and fire_due (app.job.plane_cpu)
    plane_gc_s: float = 0.0  # of plane_cpu_s: garbage collections that ran inside those calls
    plane_apart_s: float = 0.0  # inside those calls, the job's own observers (not in plane_cpu_s)
    waits: dict = attrs.Factory(dict)  # loop passes that found nothing to do, by how they waited
    # LifecycleCounts.to_dict() of the rank's plane: what replay of its log counts.
    lifecycle: dict = attrs.Factory(dict)


FROM_RANK = (RankReady, RankStep, RankCrashed, RankSummary)
