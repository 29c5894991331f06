"""The worker-side connector: what each tensor-parallel rank runs.

Each rank has its own ``PlaneDriver`` (NIXL agent, registered KV shard,
side channel answering for this rank, remote engines, leases, heartbeats
and their timers) and sees the scheduler only through the records of
``records``: it applies each ``StepMeta`` to its plane and answers with a
``WorkerReport``.  Peers see a rank as the engine ``"<engine>/tp<r>"``.

With tensor parallelism a rank reads the remote ranks that hold its heads
(``statemachines.tp_mapping``).  When that is several ranks (the holder's
TP is wider), each source is its own decode request on this rank's plane,
named ``"<request>@tp<holder rank>"``, reading into its part of every
local block; the rank reports the request once all of them reported, as
failed if any failed.  A holder running pipeline parallel has TP x PP
ranks, each stage a slice of the layers: a reader reads its heads from
every stage, each into the layers the stage holds (the stage's handshake
says which: ``transport.layer_slice``).  A rank of a PP > 1 engine is
``stage * tp_size + tp rank``; it serves reads and reads nothing.  A decoder's turn-2 hold is one lease per rank, for
every reader rank that will read it.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Sized

from kvplane.statemachines import events as E
from kvplane.statemachines.actions import ReportRecv
from kvplane.statemachines.observe import CaptureObserver
from kvplane.statemachines.tp_mapping import TpMapping, tp_mapping

from .driver import PlaneDriver
from .ranks import rank_engine_id
from .records import Finish, LeaseGrant, RankInfo, RecvFailure, StepMeta, WorkerReport, check

log = logging.getLogger("kvplane.worker")
# Holder ranks looked for when a new request's set-up raised half-way.
MAX_HOLDER_RANKS_SCANNED = 64


class ConnectorWorker:
    def __init__(self, driver: PlaneDriver, *, rank: int = 0, tp_size: int = 1, rank_names: bool = True,
                 replicated_kv: bool = False, pp_size: int = 1):
        """The worker observes the plane (``ControlPlane.observe``) to keep
        why each recv failed (the reason its ``ReportRecv`` names).  ``rank_names``: a remote engine's ranks are
        ``"<engine>/tp<r>"`` (the split's); False for the single-process
        facades, whose peers are plain engines (TP 1).  ``replicated_kv``:
        every rank holds the whole KV (MLA): this rank reads one holder rank's
        whole blocks (``TpMapping.replicated``)."""
        TpMapping(tp_size, tp_size, holder_pp=pp_size)  # valid TP and PP sizes
        if not 0 <= rank < tp_size * pp_size:
            raise ValueError(f"rank {rank} out of range for TP {tp_size} x PP {pp_size}")
        self.driver = driver
        self.rank = rank
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.rank_names = rank_names
        self.replicated_kv = replicated_kv
        self._subs: dict[str, tuple[str, ...]] = {}  # request -> its decode requests on this rank
        self._parent: dict[str, str] = {}  # decode request -> request
        self._results: dict[str, dict[str, bool]] = {}  # request -> reported decode requests -> ok
        self._awaited: set[str] = set()  # requests whose recv the scheduler awaits
        self._reported: set[str] = set()  # of those, the ones this rank reported (awaiting their Finish)
        self._aborted: set[str] = set()  # aborted, awaited, not reported yet: forgotten once reported
        self._notify_only: set[str] = set()  # requests nobody awaits: gone once their machines are
        self._fail_reason: dict[str, RecvFailure] = {}
        self._broken: set[str] = set()  # new requests that raised: their load fails, nothing is read
        self._broken_failed: set[str] = set()  # of those, awaited: failed in the next report
        self._out_sending: set[str] = set()
        self.counters: Counter = Counter()
        # Captures (no Step built per stimulus): a failed ReportRecv is external, so in ``out``.
        driver.plane.observe(CaptureObserver(self._capture, self._observe))

    # ------------------------------------------------------------ start-up
    def rank_info(self) -> RankInfo:
        d = self.driver
        return RankInfo(rank=self.rank, engine_id=d.engine_id, side_channel_port=d.side_channel_port,
                        public_key=d.public_key, incarnation=d.incarnation)

    def register_kv_caches(self, kv_cache: Any) -> None:
        """``kv_cache``: this rank's shard, one tensor [num_blocks, ...] or a
        dict of them (one per layer)."""
        tensors = kv_cache.values() if isinstance(kv_cache, dict) else [kv_cache]
        for t in tensors:
            self.driver.endpoint.register_kv_cache(t, t[0].numel() * t.element_size())

    # ------------------------------------------------------------ per step
    def bind(self, meta: StepMeta) -> None:
        """Apply one step's metadata to this rank's plane (vLLM:
        bind_connector_metadata + start_load_kv)."""
        meta = check(meta, StepMeta)
        feed = self.driver.feed
        for new in meta.new_requests:
            try:
                self._new_request(new.request_id, new.remote, new.push)
            except Exception as exc:  # the last line: one request's params never stop the engine
                self._unplanned(new.request_id, exc)
        for load in meta.loads:
            if load.request_id in self._broken:
                self._broken.discard(load.request_id)
                if load.awaiting:  # reported failed with the next report: vLLM recomputes it
                    self._broken_failed.add(load.request_id)
                continue
            subs = self._subs.get(load.request_id, ())
            if subs:
                (self._awaited if load.awaiting else self._notify_only).add(load.request_id)
            for sub in subs:
                feed(E.BlocksAllocated(request_id=sub, block_ids=load.block_ids,
                                       num_remote_tokens=load.num_remote_tokens, awaiting=load.awaiting))
                feed(E.StartLoad(request_id=sub))
        for rid in meta.running:
            for sub in self._subs.get(rid, ()):
                feed(E.RequestRunning(request_id=sub))
        for finish in meta.finished:
            self._finish(finish)
        for grant in meta.grants:
            self._grant(grant, duration=None, renewable=True)
            if grant.push:
                feed(E.PushReady(request_id=grant.request_id, block_ids=grant.block_ids))
        for rid in meta.aborts:
            for sub in self._subs.get(rid, ()):
                feed(E.Abort(request_id=sub))
            if rid in self._awaited and rid not in self._reported:
                self._aborted.add(rid)  # its (failed) report is still to come
            else:
                self._forget(rid)  # nothing more will be reported for it
        for rid in meta.lease_aborts:
            if self.driver.plane.get("lease", rid) is not None:
                feed(E.LeaseAbort(request_id=rid))

    def step(self) -> int:
        return self.driver.step()

    def report(self) -> WorkerReport:
        """What finished on this rank since the last report."""
        d = self.driver
        recving: set[str] = set()
        failed: dict[str, RecvFailure] = {}  # request -> why (read before _forget drops it)
        for sub, ok in [(s, True) for s in d.finished_recving] + [(s, False) for s in d.failed_recving]:
            rid = self._parent.get(sub, sub)
            results = self._results.setdefault(rid, {})
            results[sub] = ok
            d.parts.pop(sub, None)
            if len(results) >= len(self._subs.get(rid, (sub,))):
                del self._results[rid]
                if all(results.values()):
                    recving.add(rid)
                else:
                    failed[rid] = self._fail_reason.pop(rid, RecvFailure.UNEXPLAINED)
                if rid in self._aborted:
                    self._forget(rid)
                elif rid in self._subs:
                    self._reported.add(rid)
        d.finished_recving, d.failed_recving = set(), set()
        sending = self._out_sending | d.finished_sending
        self._out_sending, d.finished_sending = set(), set()
        blocks, d.load_error_blocks = d.load_error_blocks, set()
        d.freed = []
        self._end_notify_only()
        for rid in self._broken_failed:
            failed[rid] = RecvFailure.INTERNAL_ERROR
        self._broken_failed = set()
        return WorkerReport(rank=self.rank, finished_sending=sending, finished_recving=recving,
                            failed_recving=set(failed), load_error_blocks=blocks, fail_reasons=tuple(failed.items()))

    def tracked(self) -> dict[str, int]:
        """How many requests each of this rank's per-request tables holds
        (each entry goes when its request ends: an idle rank's are all 0)."""
        tables: dict[str, Sized] = {"subs": self._subs, "parent": self._parent, "results": self._results, "awaited": self._awaited,
                  "reported": self._reported, "aborted": self._aborted, "notify_only": self._notify_only,
                  "fail_reason": self._fail_reason, "broken": self._broken, "broken_failed": self._broken_failed,
                  "out_sending": self._out_sending}
        return {name: len(table) for name, table in tables.items()}

    def shutdown(self) -> None:
        self.driver.close()
        self.driver.endpoint.close()

    # ------------------------------------------------------------ internals
    def _new_request(self, rid: str, rk, push: bool) -> None:
        if rid in self._subs:
            self.counters["duplicate_new_request"] += 1
            return
        if self.pp_size > 1:  # the scheduler refuses these first; a rank holding a layer slice never reads
            raise ValueError(f"a rank of a pipeline-parallel engine (PP {self.pp_size}) reads nothing")
        sources = tp_mapping(rk.tp_size, self.tp_size, replicated=self.replicated_kv,
                             holder_pp=rk.pp_size).sources(self.rank)
        subs = []
        for src in sources:
            sub = rid if len(sources) == 1 else f"{rid}@tp{src.holder_rank}"
            engine = rank_engine_id(rk.remote_engine_id, src.holder_rank) if self.rank_names else rk.remote_engine_id
            self.driver.learn_engine(engine, rk.rank_side_channel(src.holder_rank), rk.remote_public_key)
            if not (src.remote.whole and src.local.whole):
                self.driver.parts[sub] = ((src.remote.index, src.remote.of), (src.local.index, src.local.of))
            self._parent[sub] = rid
            subs.append(sub)
            self.driver.feed(E.NewRequest(
                request_id=sub, engine_id=engine, remote_request_id=rk.remote_request_id,
                remote_block_ids=rk.remote_block_ids, remote_ranks=(src.holder_rank,),
                expected_consumers=rk.expected_consumers, remote_expiry=rk.remote_expiry,
                remote_renewable=rk.remote_renewable, push=push,
                remote_incarnation=rk.incarnation_of(src.holder_rank)))
        self._subs[rid] = tuple(subs)

    def _unplanned(self, rid: str, exc: Exception) -> None:
        """A new request whose set-up raised (a bug, or params no check
        foresaw): counted and logged; if no machine was made for it, its
        load fails without reading (else that machine reports as usual)."""
        self.counters["new_request_errors"] += 1
        if self.counters["new_request_errors"] <= 10:
            log.exception("rank %d: request %s: unexpected %s setting up its recv; it fails, the engine goes on",
                          self.rank, rid, type(exc).__name__)
        made = tuple(s for s in [rid] + [f"{rid}@tp{r}" for r in range(MAX_HOLDER_RANKS_SCANNED)]
                     if self.driver.plane.get("decode_request", s) is not None)
        if made:
            self._subs[rid] = made
            for sub in made:
                self._parent[sub] = rid
        else:
            self._broken.add(rid)

    def _finish(self, finish: Finish) -> None:
        rid = finish.request_id
        for sub in self._subs.get(rid, ()):
            self.driver.feed(E.RequestFinished(request_id=sub, block_ids=finish.block_ids))
        self._forget(rid)
        if finish.hold is not None:
            self._grant(finish.hold, duration=self.driver.config.decoder_kv_blocks_ttl, renewable=False)

    def _grant(self, grant: LeaseGrant, *, duration: float | None, renewable: bool) -> None:
        d = self.driver
        if self.rank in grant.unread_ranks:
            # No reader reads this rank's copy (replicated KV): nothing held here.
            self.counters["grants_unread_rank"] += 1
            self._out_sending.add(grant.request_id)
            return
        d.feed(E.LeaseGranted(request_id=grant.request_id, block_ids=grant.block_ids,
                              expected_consumers=grant.consumers_per_rank, duration=duration,
                              renewable=renewable))
        if not d.adopt_lease_name(grant.request_id, grant.name):
            # No lease here (or the name is taken): nothing of ours to end.
            self.counters["grants_without_lease"] += 1
            self._out_sending.add(grant.request_id)

    def _forget(self, rid: str) -> None:
        for sub in self._subs.pop(rid, ()):
            self._parent.pop(sub, None)
            self.driver.parts.pop(sub, None)
        self._results.pop(rid, None)
        self._fail_reason.pop(rid, None)  # a sub-read's failure whose request ends before its report
        for bookkeeping in (self._awaited, self._reported, self._aborted, self._notify_only, self._broken):
            bookkeeping.discard(rid)

    def _end_notify_only(self) -> None:
        plane = self.driver.plane
        for rid in [r for r in self._notify_only
                    if all(plane.get("decode_request", s) is None for s in self._subs.get(r, ()))]:
            self._forget(rid)

    def _capture(self, _stimulus, out) -> None:
        if out:
            self._note_failed_recvs(out)

    def _observe(self, step) -> None:
        self._note_failed_recvs(step.actions)

    def _note_failed_recvs(self, actions) -> None:
        for a in actions:
            if isinstance(a, ReportRecv) and not a.ok:
                # The first of a request's sub-reads to fail names why (the table
                # names a reason on every failed report).
                rid = self._parent.get(a.request_id, a.request_id)
                self._fail_reason.setdefault(rid, RecvFailure(a.reason or RecvFailure.UNEXPLAINED))
