"""The scheduler-side connector: what the engine's scheduler process runs.

It owns no NIXL agent, no plane and no timer: those live in each worker
rank (``worker.ConnectorWorker``).  It keeps the request lifecycle as the
scheduler sees it (which requests have remote KV, what to load, whether
the recv is awaited, which blocks go under a lease), turns each engine
call into the records of ``records.StepMeta`` for every worker rank, and
folds the ranks' ``WorkerReport``s back into one engine-level answer: a
request is finished sending (its blocks may be freed) only when every rank
ended its lease, finished receiving only when every rank reported its
recv, and failed when any rank failed or died.

The lease names it hands out (the remote request id of
``kv_transfer_params``) are made here, so every rank names the same lease
the same way; the expiry it states is its clock at the grant plus the
lease term, never later than any rank's own lease (a rank creates its
lease when the metadata arrives, after the grant), so a consumer that
trusts the stated expiry can only err on the safe side.
"""
from __future__ import annotations

import secrets
import time
from collections import Counter
from typing import Any, Callable, Iterable

import attrs

from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.rank_results import Outcome, RankResults
from kvplane.statemachines.tp_mapping import TpMapping, TpMismatch

from .params import BadTransferParams, RemoteKV
from .records import (Finish, LeaseGrant, Load, NewRemoteRequest, RankInfo, StepMeta, WorkerReport, check)


class ConnectorScheduler:
    def __init__(self, engine_id: str, *, tp_size: int = 1, config: PlaneConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, host: str = "127.0.0.1"):
        self.engine_id = engine_id
        self.tp_size = TpMapping(tp_size, tp_size).holder_tp  # validated like any TP size
        self.config = config or PlaneConfig()
        self.clock = clock
        self.host = host
        self.ranks: dict[int, RankInfo] = {}
        self._remote: dict[str, RemoteKV] = {}  # requests whose KV a remote engine holds
        self._awaited: set[str] = set()  # of those, the ones whose recv the scheduler awaits
        self._serve: dict[str, bool] = {}  # requests a remote will read from us -> push mode
        self._lease_ranks = RankResults(self.tp_size)  # leases (and holds) until every rank ended them
        self._recv_ranks = RankResults(self.tp_size)  # awaited recvs until every rank reported
        self._lost: set[int] = set()
        self._meta: dict[str, list] = _empty_meta()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.load_error_blocks: set[int] = set()
        self.fail_reasons: dict[str, str] = {}
        self.counters: Counter = Counter()

    # ------------------------------------------------------------ start-up
    def add_rank(self, info: RankInfo) -> None:
        """What worker rank ``info.rank`` published (its side channel)."""
        info = check(info, RankInfo)
        if not 0 <= info.rank < self.tp_size:
            raise ValueError(f"rank {info.rank} out of range for TP {self.tp_size}")
        self.ranks[info.rank] = info

    # ------------------------------------------------------------ requests
    def on_new_request(self, request_id: str, kv_transfer_params: dict | None, *,
                       server_public_key: bytes | None = None, serve: bool = False) -> None:
        """Register a request.  One with remote KV is sent to every rank in
        the next metadata, and its heartbeats start there (at the side
        channel that proves ``server_public_key``, when given).  ``serve``:
        it also serves a remote decode once finished (P's turn 2: it reads
        D's held prefix, then leases its blocks for D's read-back)."""
        params = kv_transfer_params or {}
        if serve:
            self._serve[request_id] = False
        if not params.get("do_remote_prefill"):
            if params.get("do_remote_decode"):
                self._serve[request_id] = bool(params.get("push"))
            return
        rk = attrs.evolve(RemoteKV.from_dict(params), remote_public_key=server_public_key)
        try:
            mapping = TpMapping(rk.tp_size, self.tp_size)
        except TpMismatch as exc:
            raise BadTransferParams(f"kv_transfer_params: 'tp_size': {exc}") from None
        if rk.expected_consumers < mapping.consumers_per_holder_rank:
            # Each holder rank would free its blocks after its first reader
            # rank's completion while the others still read: refuse (recompute).
            raise BadTransferParams(
                f"kv_transfer_params: 'expected_consumers': {rk.expected_consumers} per holder rank, but "
                f"{mapping.consumers_per_holder_rank} of our ranks read each of the holder's {rk.tp_size}")
        push = bool(params.get("push"))
        if push and (rk.tp_size > 1 or self.tp_size > 1):
            raise BadTransferParams("kv_transfer_params: push mode needs TP 1 on both sides")
        self._remote[request_id] = rk
        self._meta["new_requests"].append(NewRemoteRequest(request_id=request_id, remote=rk, push=push))

    def get_num_new_matched_tokens(self, request_id: str, num_prompt_tokens: int,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens to load from the remote, whether the load is asynchronous)."""
        if request_id not in self._remote:
            return 0, False
        n = max(0, num_prompt_tokens - num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, request_id: str, block_ids: Iterable[int], num_external_tokens: int,
                                 awaiting: bool | None = None) -> None:
        """Blocks are allocated.  ``awaiting`` defaults to "tokens to load";
        a scheduler that also awaits a full-prefix hit passes True."""
        if request_id not in self._remote:
            return
        awaiting = num_external_tokens > 0 if awaiting is None else awaiting
        if awaiting:
            self._awaited.add(request_id)
            self._recv_ranks.expect(request_id)
            for rank in self._lost:  # a dead rank reads nothing: the recv fails once the others reported
                self._fold_recv(self._recv_ranks.report(rank, request_id, False))
        self._meta["loads"].append(Load(request_id=request_id, block_ids=tuple(block_ids),
                                        num_remote_tokens=num_external_tokens, awaiting=awaiting))

    def request_running(self, request_id: str) -> None:
        if request_id in self._awaited:
            self._meta["running"].append(request_id)

    def build_connector_meta(self) -> StepMeta:
        m, self._meta = self._meta, _empty_meta()
        return StepMeta(new_requests=m["new_requests"], loads=m["loads"], running=m["running"],
                        finished=m["finished"], grants=m["grants"], aborts=m["aborts"],
                        lease_aborts=m["lease_aborts"])

    def request_finished(self, request_id: str, block_ids: Iterable[int], *, expected_consumers: int = 1,
                         reader_tp: int | None = None,
                         hold_for_next_turn: bool = False) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params for the other side).

        P serving a remote decode: the blocks go under a lease on every rank
        and the params tell the reader where to read.  ``expected_consumers``
        counts reader engines, ``reader_tp`` their TP (default ours): each
        rank's lease then awaits every reader rank that reads it.  D with
        ``hold_for_next_turn``: an awaited recv's blocks stay under a
        fixed-TTL lease on every rank for the next turn's reader.
        """
        block_ids = tuple(block_ids)
        rk = self._remote.pop(request_id, None)
        if rk is not None:
            awaited = request_id in self._awaited
            self._awaited.discard(request_id)
            if awaited and hold_for_next_turn:
                self._serve.pop(request_id, None)
                grant = self._grant(request_id, block_ids, expected_consumers, reader_tp, push=False)
                self._meta["finished"].append(Finish(request_id=request_id, block_ids=block_ids, hold=grant))
                expiry = self.clock() + self.config.decoder_kv_blocks_ttl
                return True, self._params(grant, block_ids, expiry, renewable=False)
            if awaited:
                self._meta["finished"].append(Finish(request_id=request_id, block_ids=block_ids))
            # else notify-only: the rank's machine ends on its own after the notify.
            if request_id not in self._serve:
                return False, None
            # A turn 2 that read (or was declined) now serves its own reader.
        if request_id in self._serve:
            push = self._serve.pop(request_id)
            grant = self._grant(request_id, block_ids, expected_consumers, reader_tp, push=push)
            self._meta["grants"].append(grant)
            expiry = self.clock() + self.config.kv_lease_duration
            return True, self._params(grant, block_ids, expiry, renewable=True)
        return False, None

    def abort(self, request_id: str) -> None:
        self._serve.pop(request_id, None)
        if self._remote.pop(request_id, None) is not None:
            self._meta["aborts"].append(request_id)
            # An awaited recv is still reported by every rank (failed).
            self._awaited.discard(request_id)
        elif self._lease_ranks.expecting(request_id):
            self._meta["lease_aborts"].append(request_id)

    def _grant(self, request_id: str, block_ids: tuple, consumers: int, reader_tp: int | None,
               push: bool) -> LeaseGrant:
        mapping = TpMapping(self.tp_size, reader_tp or self.tp_size)
        self._lease_ranks.expect(request_id)
        for rank in self._lost:  # a dead rank holds nothing
            if self._lease_ranks.report(rank, request_id) is not None:
                self.finished_sending.add(request_id)
        # The lease's unguessable name: only who is handed the params can act on it.
        return LeaseGrant(request_id=request_id, name=f"{request_id}-{secrets.token_hex(16)}",
                          block_ids=block_ids, consumers_per_rank=consumers * mapping.consumers_per_holder_rank,
                          push=push)

    def _params(self, grant: LeaseGrant, block_ids: tuple, expiry: float, renewable: bool) -> dict[str, Any]:
        ports = tuple(self.ranks[r].side_channel_port for r in range(self.tp_size))
        incarnations = tuple(self.ranks[r].incarnation for r in range(self.tp_size))
        return {
            "do_remote_prefill": True,
            **RemoteKV(remote_engine_id=self.engine_id, remote_host=self.host, remote_port=ports[0],
                       remote_request_id=grant.name, remote_block_ids=block_ids,
                       expected_consumers=grant.consumers_per_rank, remote_expiry=expiry,
                       remote_renewable=renewable, tp_size=self.tp_size, remote_rank_ports=ports,
                       remote_rank_incarnations=incarnations if None not in incarnations else ()).to_dict(),
        }

    # ------------------------------------------------------------ worker results
    def update_from_worker(self, report: WorkerReport) -> None:
        """Fold in one rank's results of a step (vLLM: the per-worker
        KVConnectorOutput the scheduler aggregates)."""
        report = check(report, WorkerReport)
        if report.rank in self._lost:
            self.counters["reports_from_lost_rank"] += 1
            return
        reasons = dict(report.fail_reasons)
        for rid in report.finished_sending:
            if self._lease_ranks.report(report.rank, rid) is not None:
                self.finished_sending.add(rid)
        for rid, ok in [(r, True) for r in report.finished_recving] + [(r, False) for r in report.failed_recving]:
            if not ok:
                reason = reasons.get(rid, "failed")
                self.fail_reasons.setdefault(rid, reason if self.tp_size == 1 else f"{reason} (rank {report.rank})")
            self._fold_recv(self._recv_ranks.report(report.rank, rid, ok))
        self.load_error_blocks |= report.load_error_blocks

    def rank_lost(self, rank: int) -> None:
        """Worker rank ``rank`` died or hangs: nothing it holds is reachable
        any more.  Its leases count as ended (the process and its
        registered memory are gone; the other ranks end theirs on their own
        timers), and every recv waiting on it fails."""
        if rank in self._lost:
            return
        self._lost.add(rank)
        for outcome in self._lease_ranks.rank_lost(rank):
            self.finished_sending.add(outcome.request_id)
        for outcome in self._recv_ranks.rank_lost(rank):
            self._fold_recv(outcome)

    def _fold_recv(self, outcome: Outcome | None) -> None:
        if outcome is None:
            return
        if outcome.ok:
            self.finished_recving.add(outcome.request_id)
            return
        for rank in outcome.failed_ranks:
            if rank in self._lost:
                self.fail_reasons.setdefault(outcome.request_id, f"rank {rank} lost")
        self.failed_recving.add(outcome.request_id)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        out = self.finished_sending, self.finished_recving, self.failed_recving
        self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        return out

    def take_load_error_blocks(self) -> set[int]:
        blocks, self.load_error_blocks = self.load_error_blocks, set()
        return blocks

    # ------------------------------------------------------------ reports
    def waiting_on(self, request_id: str) -> tuple[int, ...]:
        """The ranks that have not ended the request's lease yet."""
        return self._lease_ranks.waiting_on(request_id)


def _empty_meta() -> dict[str, list]:
    return {"new_requests": [], "loads": [], "running": [], "finished": [], "grants": [], "aborts": [],
            "lease_aborts": []}
