"""The protocol between ``kvplane run``'s parent (the orchestrator) and its
two engine processes (nodes), over a multiprocessing Pipe.

One attrs class per message, named by what it says; each side dispatches on
the class (``handlers`` checks that every message of its direction has a
handler).  ``lid`` is the parent's id of a synthetic request; ``request_id``
is the id the node's plane knows it by (``p-<lid>``, ``d-<lid>``,
``p2-<lid>``); ``os_pid`` is a process id.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import attrs

from .placement import Placement

if TYPE_CHECKING:
    from kvplane.statemachines.config import PlaneConfig


@attrs.frozen(kw_only=True)
class CurveKeys:
    """A node's side-channel credentials for this run."""

    keypair: tuple[bytes, bytes]  # (public, secret)
    peers: dict[str, bytes]  # engine id -> public key it may connect with


@attrs.frozen(kw_only=True)
class NodeOptions:
    """What the parent hands a node when it spawns it."""

    engine_ids: dict[str, str]  # role -> engine id
    plane: PlaneConfig
    out: str  # folder for the event logs (absolute)
    clock_skew: float  # added to D's plane clock
    drop_notifications: float
    seed: int
    num_blocks: int
    block_elems: int
    overload: float  # how long D queues a request before scheduling it
    stall_limit: float  # a loop gap this long is listed as a stall
    tp: dict  # role -> tensor-parallel size (worker rank processes)
    curve: CurveKeys
    placement: Placement = Placement()  # its network: UCX devices, side channel, namespace
    log_stem: str = ""  # its event log's name (default: prefill / decode)


# ------------------------------------------------------------ parent -> node


@attrs.frozen
class Prefill:
    """P: prefill a request and lease its blocks for D."""

    lid: str
    request_id: str
    nblocks: int
    push: bool


@attrs.frozen
class Decode:
    """D: read a prefilled request's blocks (``params``: P's kv_transfer_params)."""

    lid: str
    request_id: str
    nblocks: int
    prefix: int  # blocks D has cached locally
    await_full: bool  # a full prefix hit the scheduler still awaits (not notify-only)
    hold: bool  # keep the blocks for a turn 2
    params: dict
    granted_at: float


@attrs.frozen
class Turn2:
    """P: read D's held blocks (``params``: D's kv_transfer_params)."""

    lid: str
    request_id: str
    nblocks: int
    params: dict


@attrs.frozen
class StatusRequest:
    """Answer with a ``Status``."""


@attrs.frozen
class Abandon:
    """The job gave up: drop queued work, abort recvs in flight; answer ``Abandoned``."""


@attrs.frozen
class Release:
    """The other side stopped reading: free every lease / hold now; answer ``Released``."""


@attrs.frozen
class Finish:
    """Send the ``Summary`` and exit."""


TO_NODE = (Prefill, Decode, Turn2, StatusRequest, Abandon, Release, Finish)

# ------------------------------------------------------------ node -> parent


@attrs.frozen
class Ready:
    engine_id: str
    side_channel_url: str  # rank 0's
    os_pid: int  # the scheduler process
    rank_pids: tuple = ()  # the worker rank processes, by rank


@attrs.frozen
class Crashed:
    role: str
    traceback: str


@attrs.frozen
class Status:
    held_blocks: int
    lease_blocks: int  # P: blocks under a live lease
    waiting: int  # queued, no blocks yet
    loading: int  # recvs in flight
    holds: int  # D: turn-2 holds
    last_hb_at: float | None
    stalls: list
    max_loop_gap_s: float


@attrs.frozen
class Prefilled:
    lid: str
    params: dict  # P's kv_transfer_params, for D
    granted_at: float


@attrs.frozen
class Decoded:
    lid: str
    outcome: str  # ok | recomputed | corrupt
    detail: str
    hold: dict | None  # D's kv_transfer_params for turn 2, when it holds the blocks


@attrs.frozen
class Turn2Done:
    lid: str
    outcome: str  # ok | recomputed | corrupt
    detail: str


@attrs.frozen
class Abandoned:
    counts: dict  # what was given up, by kind
    xfers: int
    loading: int


@attrs.frozen
class Released:
    counts: dict
    held_blocks: int


@attrs.define
class LeaseRecord:
    """P's account of one lease, for the reclaim check (raw monotonic times,
    which every process on this machine shares)."""

    id: str  # the lease's request id
    lid: str
    granted: float
    expiry: float  # the plane's deadline (P's plane clock), raised by each extension
    blocks: int
    hb: float | None = None  # the last heartbeat that reached it
    freed: float | None = None
    reason: str | None = None  # why it was freed: expired | consumed | aborted


@attrs.frozen(kw_only=True)
class Summary:
    """A node's report when it finishes (report.py puts it in summary.json)."""

    role: str
    engine_id: str
    log: str
    outcomes: dict
    verified_bytes: int
    bytes_moved: int
    busy_s: float
    counters: dict
    engines_evicted: int
    engines_closed_at_shutdown: int
    heartbeats_sent: int
    heartbeats_received: int
    leases: dict  # granted / extended / expired / consumed / aborted / live
    lease_records: list[LeaseRecord]
    holds: dict
    last_hb_at: float | None
    held_blocks: int
    plane_held: list
    anomalies: dict
    stalls: list
    loop: dict  # LoopGaps.to_dict()
    clock_offsets: dict
    nixl_calls: dict
    recompute_reasons: dict
    abandoned: dict
    waited_for_blocks: dict
    # Per worker rank: what it held at the end, heartbeats, leases ended (RankSummary fields).
    ranks: list = attrs.Factory(list)
    # LifecycleCounts of every rank's plane, summed: what replay of the rank logs counts.
    lifecycle: dict = attrs.Factory(dict)
    lost_ranks: list = attrs.Factory(list)
    rank_crashes: dict = attrs.Factory(dict)  # rank -> the traceback of a rank that crashed
    # Every transfer the ranks posted (TransferSample: post -> done), and D rank 0's bare NIXL READs of
    # the same sizes, made beside them (report.py turns both into the data-path figures).
    transfers: list = attrs.Factory(list)
    bare_reads: list = attrs.Factory(list)
    bare_read_error: str | None = None
    plane_cpu_s: float = 0.0  # summed over the ranks: CPU inside the plane's handle / fire_due
    plane_gc_s: float = 0.0  # of plane_cpu_s: garbage collections inside those calls
    plane_apart_s: float = 0.0  # inside those calls, the job's own observers (not in plane_cpu_s)


TO_PARENT = (Ready, Crashed, Status, Prefilled, Decoded, Turn2Done, Abandoned, Released, Summary)


def handlers(direction: tuple[type, ...], table: dict[type, Callable[..., Any]]) -> dict[type, Callable[..., Any]]:
    """``table``, checked to handle exactly the messages of ``direction``."""
    missing = set(direction) - set(table)
    extra = set(table) - set(direction)
    assert not missing and not extra, f"handlers: missing {sorted(c.__name__ for c in missing)}, " \
                                      f"unexpected {sorted(c.__name__ for c in extra)}"
    return table
