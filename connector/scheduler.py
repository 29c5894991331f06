"""The scheduler-side connector: what the engine's scheduler process runs.

It owns no NIXL agent and no transfer: those live in each worker rank
(``worker.ConnectorWorker``).  The request lifecycle as the scheduler sees
it is the ``engine_request`` machine, one instance per request with remote
KV, run in a plane of its own (``self.plane``: its instances are the one
table of requests, its timers the machine's deadlines, its recorder the
scheduler side's event log).  Each method is a thin translation: an engine
call becomes the machine's event, the machine's actions become the answer
and the records of ``records.StepMeta`` for every worker rank.  The ranks'
``WorkerReport``s are folded into one engine-level report (a request is
finished sending only when every rank ended its lease, finished receiving
only when every rank reported its recv, and failed when any rank failed or
died), which is fed back as the machine's ``RecvFinished`` /
``SendingFinished``: one the machine refuses (not awaited, or twice) is
counted and not reported.  What the machines tell the engine (their
Tell* actions) goes into one ``EngineReport``, the outbox each
``get_finished`` empties: beside the machines, the per-request tables here
are only the ranks' aggregation (``RankResults``: a request leaves it once
every rank answered) and that outbox.

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

from kvplane.statemachines import engine_calls as C
from kvplane.statemachines.base import Action
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.machines import LOGGED_MACHINES
from kvplane.statemachines.machines.engine_request import EngineRequest, EngineState
from kvplane.statemachines.plane import ControlPlane
from kvplane.statemachines.rank_results import Outcome, RankResults
from kvplane.statemachines.tp_mapping import TpMapping, TpMismatch, tp_mapping

from .engine_report import EngineReport
from .params import BadTransferParams, RemoteKV
from .records import (Finish, LeaseGrant, Load, NewRemoteRequest, RankInfo, RecvFailure, StepMeta, WorkerReport,
                      check)

KIND = "engine_request"
# Where an abort frees a lease or hold (EngineLeaseAbort) rather than ends the request.
LEASE_STATES = (EngineState.HELD, EngineState.LEASED, EngineState.FREEING)
# Where a producer's (P's) blocks are under a lease the ranks have not all ended.
PRODUCER_LEASE_STATES = (EngineState.LEASED, EngineState.FREEING)
# Where the engine's scheduling of the request tells the machine something
# (elsewhere the table ignores it: not fed, so a serving engine does not log
# every decode step of every request).
AWAITS_SCHEDULING = (EngineState.RECV_DONE, EngineState.RECV_FAILED)


@attrs.frozen
class RequestInputs:
    """What the records of one request need beyond the machine's events:
    the remote holding its KV (a reader), whether it is served by push, and
    how many tokens a turn-2 reader reads (the held prefix), and a hybrid
    model's remote block lists per KV cache group (as signed, less the null
    block: D pairs its own groups' blocks with them at allocation)."""

    remote: RemoteKV | None = None
    push: bool = False
    serve: bool = False
    read_tokens: int | None = None
    remote_groups: tuple[tuple[int, ...], ...] = ()


class ConnectorScheduler:
    def __init__(self, engine_id: str, *, tp_size: int = 1, config: PlaneConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, host: str = "127.0.0.1",
                 replicated_kv: bool = False, pp_size: int = 1):
        """``replicated_kv``: every rank holds the whole KV (MLA): a reader
        rank reads one holder rank's whole blocks (``TpMapping.replicated``).
        ``pp_size``: the engine runs pipeline parallel, its ranks stage x TP
        rank (``stage * tp_size + tp rank``), each stage a slice of the
        layers: it serves reads (every rank's lease and report counted) but
        reads nothing itself (NixlConnector's decode side runs PP 1 only)."""
        self.engine_id = engine_id
        self.replicated_kv = replicated_kv
        self.tp_size = TpMapping(tp_size, tp_size, holder_pp=pp_size).holder_tp  # validated like any TP size
        self.pp_size = pp_size
        self.num_ranks = tp_size * pp_size
        self.config = config or PlaneConfig()
        self.clock = clock
        self.host = host
        self.ranks: dict[int, RankInfo] = {}
        # The engine_request machines: the one table of requests.  The plane
        # knows every machine a log may name (its wiring is checked as a
        # whole, and replay builds the same one); only engine_request runs.
        self.plane = ControlPlane(self.config, machines=LOGGED_MACHINES)
        self._lease_ranks = RankResults(self.num_ranks)  # leases (and holds) until every rank ended them
        self._recv_ranks = RankResults(self.num_ranks)  # awaited recvs until every rank reported
        self._lost: set[int] = set()
        self._meta: dict[str, list] = _empty_meta()
        # What get_finished tells the engine next (built from the machines' Tell* actions).
        self._outbox = EngineReport()
        self.counters: Counter = Counter()
        # What request_finished's caller asked of a grant (readers, their TP).
        self._consumers = 1
        self._reader_tp: int | None = None
        self._granted: tuple[LeaseGrant | None, float] = (None, 0.0)  # the last grant, and when
        self._lease_done: list[str] = []  # granted with every rank lost: ended at once

    # ------------------------------------------------------------ start-up
    def add_rank(self, info: RankInfo) -> None:
        """What worker rank ``info.rank`` published (its side channel)."""
        info = check(info, RankInfo)
        if not 0 <= info.rank < self.num_ranks:
            raise ValueError(f"rank {info.rank} out of range for TP {self.tp_size} x PP {self.pp_size}")
        self.ranks[info.rank] = info

    # ------------------------------------------------------------ the machine
    def request(self, request_id: str) -> EngineRequest | None:
        """The request's machine, or None (no remote KV, or its lifecycle ended)."""
        inst: EngineRequest | None = self.plane.get(KIND, request_id)
        return inst

    def _feed(self, event: Any, inputs: RequestInputs | None = None) -> list[Action]:
        """Hand the machine one event (after the deadlines due now); apply
        what it sends the ranks; return all its actions (the answers)."""
        now = self.clock()
        self.tick(now)
        inst = self.request(event.request_id)
        context = inputs if inst is None else inst.context
        out = self.plane.handle(event, now)
        inst = self.request(event.request_id)
        if inst is not None and inst.context is None:
            inst.context = context
        self._apply(event.request_id, out, context, now)
        return out

    def tick(self, now: float | None = None) -> None:
        """Fire the machine's deadlines due now (every engine call does)."""
        now = self.clock() if now is None else now
        due = self.plane.fire_due(now)
        for a in due:
            rid = a.request_id  # type: ignore[attr-defined]  # every action of engine_calls names its request
            inst = self.request(rid)
            self._apply(rid, [a], None if inst is None else inst.context, now)

    def _apply(self, request_id: str, out: list[Action], context: RequestInputs | None, now: float) -> None:
        meta = self._meta
        finish = next((a for a in out if isinstance(a, C.SendFinish)), None)
        grant = next((a for a in out if isinstance(a, C.GrantLease)), None)
        lease = None if grant is None else self._grant(request_id, grant.block_ids, push=bool(
            context is not None and context.push and not grant.hold))
        for a in out:
            if isinstance(a, C.SendNewRemote):
                assert context is not None and context.remote is not None
                meta["new_requests"].append(NewRemoteRequest(request_id=request_id, remote=context.remote,
                                                             push=context.push))
            elif isinstance(a, C.SendLoad):
                self._recv_ranks.expect(request_id)
                for rank in self._lost:  # a dead rank reads nothing: the recv fails once the others reported
                    self._fold_recv(self._recv_ranks.report(rank, request_id, False, f"rank {rank} lost"))
                meta["loads"].append(Load(request_id=request_id, block_ids=a.block_ids,
                                          num_remote_tokens=a.num_remote_tokens, awaiting=True))
            elif isinstance(a, C.SendNotifyOnly):
                meta["loads"].append(Load(request_id=request_id, block_ids=(), num_remote_tokens=0, awaiting=False))
            elif isinstance(a, C.SendRunning):
                meta["running"].append(request_id)
            elif isinstance(a, C.SendAbort):
                meta["aborts"].append(request_id)
            elif isinstance(a, C.SendLeaseAbort):
                meta["lease_aborts"].append(request_id)
            elif isinstance(a, C.FlagOverdue):
                self.counters[f"overdue: {a.what}"] += 1
            elif isinstance(a, C.DeclineSmallRead):
                self.counters["below_recompute_threshold"] += 1
        if finish is not None:
            hold = lease if grant is not None and grant.hold else None
            meta["finished"].append(Finish(request_id=request_id, block_ids=finish.block_ids, hold=hold))
        if lease is not None and grant is not None and not grant.hold:
            meta["grants"].append(lease)
        if lease is not None:
            self._granted = (lease, now)

    # ------------------------------------------------------------ requests
    def on_new_request(self, request_id: str, kv_transfer_params: dict | None, *,
                       remote: RemoteKV | None = None, serve: bool = False,
                       remote_groups: tuple[tuple[int, ...], ...] = (), recompute_below: int = 0) -> None:
        """Register a request.  One with remote KV is sent to every rank in
        the next metadata, and its heartbeats start there.  ``remote``: the
        params as the embedder already parsed them (``RemoteKV.from_dict``, with
        the key the holder's side channel must prove); not parsed again.  ``serve``:
        it also serves a remote decode once finished (P's turn 2: it reads
        D's held prefix, then leases its blocks for D's read-back).
        ``recompute_below``: a read of fewer tokens is declined (computed
        here; the holder is told to free at once)."""
        params = kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            if params.get("do_remote_decode") or serve:
                self._feed(C.EngineNewRequest(request_id=request_id, remote_decode=True),
                           RequestInputs(push=bool(params.get("push"))))
            return
        rk = remote if remote is not None else RemoteKV.from_dict(params)
        if self.pp_size > 1:
            # Our ranks hold a layer slice each: a read needs the whole model on every rank.
            raise BadTransferParams(f"this engine runs pipeline parallel size {self.pp_size}: it serves reads "
                                    "but reads only at PP 1 (as NixlConnector)")
        try:
            mapping = tp_mapping(rk.tp_size, self.tp_size, replicated=self.replicated_kv, holder_pp=rk.pp_size)
        except TpMismatch as exc:
            raise BadTransferParams(f"kv_transfer_params: 'tp_size': {exc}") from None
        if rk.expected_consumers < mapping.consumers_per_holder_rank:
            # Each holder rank would free its blocks after its first reader
            # rank's completion while the others still read: refuse (recompute).
            raise BadTransferParams(
                f"kv_transfer_params: 'expected_consumers': {rk.expected_consumers} per holder rank, but "
                f"{mapping.consumers_per_holder_rank} of our ranks read each of the holder's {rk.tp_size}")
        push = bool(params.get("push"))
        if push and (rk.tp_size > 1 or self.tp_size > 1 or rk.pp_size > 1):
            raise BadTransferParams("kv_transfer_params: push mode needs TP 1 on both sides")
        tokens = params.get("remote_num_tokens")
        self._feed(C.EngineNewRequest(request_id=request_id, remote_prefill=True, recompute_below=recompute_below),
                   RequestInputs(remote=rk, push=push, serve=serve,
                                 read_tokens=tokens if serve and isinstance(tokens, int) else None,
                                 remote_groups=remote_groups))

    def remote_groups(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """A live hybrid-model request's remote block lists per group (empty
        when it has none or has ended): kept with its machine, not beside it."""
        inst = self.request(request_id)
        context = inst.context if inst is not None else None
        return context.remote_groups if isinstance(context, RequestInputs) else ()

    def get_num_new_matched_tokens(self, request_id: str, num_prompt_tokens: int,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens to load from the remote, whether the load is asynchronous)."""
        inst = self.request(request_id)
        if inst is None:
            return 0, False
        read = inst.context.read_tokens if inst.context is not None else None
        if read is not None:  # a next turn reads the held prefix only; the engine computes the rest
            num_prompt_tokens = min(read, num_prompt_tokens)
        out = self._feed(C.EngineMatched(request_id=request_id, num_prompt_tokens=num_prompt_tokens,
                                         num_computed_tokens=num_computed_tokens))
        answer = next((a for a in out if isinstance(a, C.AnswerMatched)), None)
        return (0, False) if answer is None else (answer.num_tokens, answer.load_async)

    def update_state_after_alloc(self, request_id: str, block_ids: Iterable[int], num_external_tokens: int,
                                 awaiting: bool | None = None) -> list[Action]:
        """Blocks are allocated.  ``awaiting`` defaults to "tokens to load";
        a scheduler that also awaits a full-prefix hit passes True.
        Returns the machine's actions (SendLoad: a read is awaited;
        SendNotifyOnly: nothing to load)."""
        if self.request(request_id) is None:
            return []
        return self._feed(C.EngineAllocated(
            request_id=request_id, block_ids=tuple(block_ids) if num_external_tokens > 0 else (),
            num_external_tokens=num_external_tokens, awaiting=bool(awaiting) and num_external_tokens == 0))

    def request_running(self, request_id: str) -> None:
        """The engine scheduled the request (fed only where the machine
        awaits it: after its recv was reported)."""
        inst = self.request(request_id)
        if inst is not None and inst.state in AWAITS_SCHEDULING:
            self._feed(C.EngineScheduled(request_id=request_id))

    def build_connector_meta(self) -> StepMeta:
        self.tick()
        m = self._meta
        if not any(m.values()):  # most engine steps: nothing for the ranks (one record for all of them)
            return NO_STEP_META
        self._meta = _empty_meta()
        return StepMeta(new_requests=m["new_requests"], loads=m["loads"], running=m["running"],
                        finished=m["finished"], grants=m["grants"], aborts=m["aborts"],
                        lease_aborts=m["lease_aborts"])

    def request_finished(self, request_id: str, block_ids: Iterable[int], *, expected_consumers: int = 1,
                         reader_tp: int | None = None, hold_for_next_turn: bool = False,
                         normal: bool = True) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params for the other side).

        P serving a remote decode: the blocks go under a lease on every rank
        and the params tell the reader where to read.  ``expected_consumers``
        counts reader engines, ``reader_tp`` their TP (default ours): each
        rank's lease then awaits every reader rank that reads it.  D with
        ``hold_for_next_turn``: an awaited recv's blocks stay under a
        fixed-TTL lease on every rank for the next turn's reader.
        ``normal``: it finished producing output (not aborted or failed).
        """
        inst = self.request(request_id)
        if inst is None:
            return False, None
        serve = inst.context is not None and inst.context.serve
        self._consumers, self._reader_tp, self._granted = expected_consumers, reader_tp, (None, 0.0)
        out = self._feed(C.EngineFinished(request_id=request_id, normal=normal, block_ids=tuple(block_ids),
                                          hold_for_next_turn=hold_for_next_turn,
                                          serve_remote_decode=normal and serve))
        lease, now = self._granted
        self._consumers, self._reader_tp = 1, None
        if lease is None or not any(type(a) is C.AnswerDelayFree for a in out):
            return False, None
        hold = any(isinstance(a, C.GrantLease) and a.hold for a in out)
        term = self.config.decoder_kv_blocks_ttl if hold else self.config.kv_lease_duration
        return True, self._params(lease, lease.block_ids, now + term, renewable=not hold)

    def abort(self, request_id: str) -> None:
        """The embedder gives the request up: finished not normally (an
        awaited recv is aborted on the ranks and still reported; one never
        allocated tells the remote to free now), or, once finished, its
        lease or hold freed now."""
        inst = self.request(request_id)
        if inst is None:
            return
        if inst.state in LEASE_STATES:
            self._feed(C.EngineLeaseAbort(request_id=request_id))
        else:
            self.request_finished(request_id, (), normal=False)

    def _grant(self, request_id: str, block_ids: tuple, push: bool) -> LeaseGrant:
        mapping = tp_mapping(self.tp_size, self._reader_tp or self.tp_size, replicated=self.replicated_kv,
                             holder_pp=self.pp_size)
        self._lease_ranks.expect(request_id)
        lost = [o for rank in self._lost if (o := self._lease_ranks.report(rank, request_id)) is not None]
        # The lease's unguessable name: only who is handed the params can act on it.
        grant = LeaseGrant(request_id=request_id, name=f"{request_id}-{secrets.token_hex(16)}",
                           block_ids=block_ids, consumers_per_rank=self._consumers * mapping.consumers_per_holder_rank,
                           push=push, unread_ranks=mapping.unread_holder_ranks)
        if lost:  # every rank is gone: nothing holds the blocks (reported after this call)
            self._lease_done.append(request_id)
        return grant

    def _params(self, grant: LeaseGrant, block_ids: tuple, expiry: float, renewable: bool) -> dict[str, Any]:
        ports = tuple(self.ranks[r].side_channel_port for r in range(self.num_ranks))
        incarnations = tuple(self.ranks[r].incarnation for r in range(self.num_ranks))
        return {
            "do_remote_prefill": True,
            **RemoteKV(remote_engine_id=self.engine_id, remote_host=self.host, remote_port=ports[0],
                       remote_request_id=grant.name, remote_block_ids=block_ids,
                       expected_consumers=grant.consumers_per_rank, remote_expiry=expiry,
                       remote_renewable=renewable, tp_size=self.tp_size, pp_size=self.pp_size,
                       remote_rank_ports=ports,
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
        for rid in sorted(report.finished_sending):
            if self._lease_ranks.report(report.rank, rid) is not None:
                self._sent(rid)
        for rid, ok in sorted([(r, True) for r in report.finished_recving] + [(r, False) for r in report.failed_recving]):
            reason: str | None = None
            if not ok:
                reason = reasons.get(rid, RecvFailure.UNEXPLAINED)
                reason = reason if self.num_ranks == 1 else f"{reason} (rank {report.rank})"
            self._fold_recv(self._recv_ranks.report(report.rank, rid, ok, reason))
        self._outbox = self._outbox.load_errors(report.load_error_blocks)
        self._flush_lease_done()

    def rank_lost(self, rank: int) -> None:
        """Worker rank ``rank`` died or hangs: nothing it holds is reachable
        any more.  Its leases count as ended (the process and its
        registered memory are gone; the other ranks end theirs on their own
        timers), and every recv waiting on it fails."""
        if rank in self._lost:
            return
        self._lost.add(rank)
        for outcome in self._lease_ranks.rank_lost(rank):
            self._sent(outcome.request_id)
        for outcome in self._recv_ranks.rank_lost(rank):
            self._fold_recv(outcome)
        self._flush_lease_done()

    def _sent(self, request_id: str) -> None:
        """Every rank ended the request's lease: the machine's SendingFinished."""
        for a in self._report(C.SendingFinished(request_id=request_id)):
            if isinstance(a, C.TellSendingFinished):
                self._outbox = self._outbox.sent(a.request_id)

    def _fold_recv(self, outcome: Outcome | None) -> None:
        if outcome is None:
            return
        for a in self._report(C.RecvFinished(request_id=outcome.request_id, ok=outcome.ok)):
            if isinstance(a, C.TellRecvFinished):
                self._outbox = (self._outbox.received(a.request_id) if a.ok else
                                self._outbox.failed(a.request_id, outcome.reason or RecvFailure.UNEXPLAINED))

    def _report(self, event: Any) -> list[Action]:
        """Feed a report; the machine's actions (one it refuses tells the
        engine nothing: counted here, and by the plane)."""
        if self.request(event.request_id) is None:
            self.counters[f"unawaited {type(event).__name__}"] += 1
            return []
        out = self._feed(event)
        if not any(isinstance(a, (C.TellRecvFinished, C.TellSendingFinished)) for a in out):
            self.counters[f"refused {type(event).__name__}"] += 1
        return out

    def _flush_lease_done(self) -> None:
        done, self._lease_done = self._lease_done, []
        for rid in done:
            self._sent(rid)

    def get_finished(self) -> EngineReport:
        """What the engine is told since the last call (the outbox, emptied)."""
        self._flush_lease_done()
        report, self._outbox = self._outbox, NO_REPORT  # immutable: each addition makes a new one
        return report

    # ------------------------------------------------------------ reports
    def pushes_pending(self) -> bool:
        """Whether a lease this engine serves by push (P) is not ended on
        every rank yet: its WRITE may still be to come (read from the
        machines: a producer's request in a lease state, granted for push)."""
        return any(inst.state in PRODUCER_LEASE_STATES and inst.context is not None and inst.context.push
                   and (inst.context.remote is None or inst.context.serve)
                   for inst in self.plane.instances[KIND].values())

    def tracked(self) -> dict[str, int]:
        """How many requests each per-request table holds: the machines,
        the ranks' aggregation (leases, recvs), what is still to be told
        the engine.  Each entry goes when its request ends, on every path,
        so an idle engine's are all 0."""
        return {"engine_request": len(self.plane.instances[KIND]), "lease_ranks": len(self._lease_ranks),
                "recv_ranks": len(self._recv_ranks), "lease_done": len(self._lease_done),
                "outbox": len(self._outbox.finished_sending) + len(self._outbox.finished_recving)
                + len(self._outbox.failed_recving)}

    def waiting_on(self, request_id: str) -> tuple[int, ...]:
        """The ranks that have not ended the request's lease yet."""
        return self._lease_ranks.waiting_on(request_id)


# What most engine steps carry: nothing (frozen records, shared).
NO_STEP_META = StepMeta()
NO_REPORT = EngineReport()


def _empty_meta() -> dict[str, list]:
    return {"new_requests": [], "loads": [], "running": [], "finished": [], "grants": [], "aborts": [],
            "lease_aborts": []}
