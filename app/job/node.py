"""The scheduler process of one engine of ``kvplane run``: prefill (P) or decode (D).

As in a serving engine, the engine is a scheduler process and one worker
process per tensor-parallel rank (``rank_worker``).  This process runs the
``ConnectorScheduler`` and the job's block allocator; each rank owns its
NIXL agent, its side channel, its plane (leases, decode requests,
heartbeats, timers) and its shard of the KV cache ([num_blocks,
block_elems // tp] float32), and talks to this process only through the
records of ``kvplane.connector.records`` (``rank_group``).  One step loop:
read the orchestrator's messages, schedule, send the step's metadata to
the ranks, fold in their reports, collect what finished, and wait ~1 ms
(woken by any pipe) when nothing happened.

P fills each request's blocks with a pattern derived from the request id
and the block index (each rank its slice); whoever receives blocks (D on
turn 1, P reading D's held blocks on turn 2) has every rank check every
byte of its slice.  Freed blocks are poisoned, as a reused block would be
overwritten, so a read of reclaimed blocks cannot pass verification by luck.

Messages are the attrs classes of ``messages.py`` over a multiprocessing Pipe.
"""
from __future__ import annotations

import itertools
import os
import time
import traceback
from collections import Counter, deque
from multiprocessing.connection import wait
from typing import Callable

import attrs

from .messages import (TO_NODE, Abandon, Abandoned, Crashed, Decode, Decoded, Finish, LeaseRecord, NodeOptions,
                       Prefill, Prefilled, Release, Released, Ready, Status, StatusRequest, Summary, Turn2, Turn2Done,
                       handlers)

from kvplane.connector.params import BadTransferParams
from kvplane.connector.ranks import base_engine_id
from kvplane.statemachines.lifecycle_counts import LifecycleCounts

from .placement import enter as enter_placement
from ..ranks.messages import Fill, Poison, RankOptions, Verify

# Tokens per KV block: prompt lengths are whole blocks in this synthetic job.
BLOCK_TOKENS = 16


# A gap between two loop ticks longer than this is listed in the summary
# (its end time and length): every timer due inside it fired that late.
LOOP_GAP_REPORT_S = 0.1
LOOP_GAPS_KEPT = 10_000
# Why a turn-2 read was not made although its hold was on time: P had no
# free blocks before the hold's validity, less the gate's margin, ran out.
NO_BLOCKS = "declined: no free blocks before the hold's expiry"


@attrs.define
class LoopGaps:
    """How long the step loop went without a tick (a stall: SIGSTOP, a busy
    machine, a blocking call).  A timer fires at the first tick after it is
    due, so a gap is also how late it can fire."""

    stall_limit: float  # a gap this long is a stall (listed apart, as D's always were)
    max_gap_s: float = 0.0
    gaps_over_report: int = 0
    long_gaps: list = attrs.Factory(list)  # [end (monotonic), length] of each gap > LOOP_GAP_REPORT_S, capped
    stalls: list = attrs.Factory(list)  # lengths of the gaps > stall_limit

    def note(self, now: float, gap: float) -> None:
        if gap > self.max_gap_s:
            self.max_gap_s = gap
        if gap > LOOP_GAP_REPORT_S:
            self.gaps_over_report += 1
            if len(self.long_gaps) < LOOP_GAPS_KEPT:
                self.long_gaps.append([round(now, 4), round(gap, 4)])
        if gap > self.stall_limit:
            self.stalls.append(round(gap, 3))

    def to_dict(self) -> dict:
        return {"max_gap_s": round(self.max_gap_s, 4), "report_over_s": LOOP_GAP_REPORT_S,
                "gaps_over_report": self.gaps_over_report, "long_gaps": self.long_gaps,
                "stall_limit_s": self.stall_limit, "stalls": list(self.stalls)}


@attrs.define
class PendingVerify:
    """A verification every live rank must answer before ``then`` runs."""

    then: Callable[[bool], None]
    results: dict = attrs.Factory(dict)  # rank -> every byte of its slice matched


@attrs.define
class QueuedDecode:
    """A Decode waiting in D's queue (heartbeating) until ``ready_at``."""

    msg: Decode
    ready_at: float


class Node:
    def __init__(self, role: str, conn, opts: NodeOptions):
        from kvplane.connector.scheduler import ConnectorScheduler

        from ..ranks.group import RankGroup

        self.role = role
        self.conn = conn
        self.opts = opts
        self.engine_id = opts.engine_ids[role]
        self.tp = opts.tp[role]
        skew = opts.clock_skew if role == "D" else 0.0
        # D's plane runs on a skewed clock (its ranks' too); the handshake's
        # offset estimate must absorb it.  Fences and reports use the raw
        # monotonic clock, which all processes on this machine share.
        self.clock = (lambda: time.monotonic() + skew) if skew else time.monotonic
        self.cfg = opts.plane
        # The side channel's address the peer is told (kv_transfer_params' remote_host).
        self.sched = ConnectorScheduler(self.engine_id, tp_size=self.tp, config=self.cfg, clock=self.clock,
                                        host=opts.placement.advertise_host)
        nb, be = opts.num_blocks, opts.block_elems
        self.block_bytes = be * 4
        self.free: deque[int] = deque(range(nb))
        self.owned: dict[str, list[int]] = {}  # request id -> blocks allocated to it
        name = opts.log_stem or ("prefill" if role == "P" else "decode")
        # Rank 0's log keeps the single-rank name (replay, sequence diagrams); the others add their rank.
        self.log_paths = [os.path.join(opts.out, f"{name}.events.jsonl" if r == 0 else f"{name}.tp{r}.events.jsonl")
                          for r in range(self.tp)]
        self.log_path = self.log_paths[0]
        fields = attrs.asdict(self.cfg)

        def rank_options(rank: int) -> RankOptions:
            return RankOptions(engine_id=self.engine_id, rank=rank, tp_size=self.tp, plane_fields=fields,
                               num_blocks=nb, block_elems=be, keypair=tuple(opts.curve.keypair),
                               peers=dict(opts.curve.peers), log_path=self.log_paths[rank], clock_skew=skew,
                               drop_notifications=opts.drop_notifications,
                               seed=(opts.seed * 2 + (role == "D")) * 1024 + rank,
                               measure_bare_read=role == "D" and rank == 0,
                               side_channel_host=opts.placement.side_channel_host)

        self.ranks = RankGroup(self.sched, rank_options, on_verified=self._on_verified,
                               on_lease_event=self._on_lease_event, on_clock_offset=self._on_clock_offset)
        self.offsets: dict[str, float] = {}  # remote engine -> the largest offset any rank measured
        self.lease_rec: dict[str, LeaseRecord] = {}  # P: by lease (request) id
        self.lease_reasons: dict[str, set[str]] = {}  # lease id -> why each rank ended it
        self.last_hb_at: float | None = None  # raw clock of the last heartbeat that reached a lease
        self.hb_by_rank: Counter = Counter()  # lease heartbeats accepted, per rank
        self.outcomes: Counter = Counter()
        self.verified_bytes = 0
        self._tokens = itertools.count(1)
        self._verifying: dict[int, PendingVerify] = {}
        self.gaps = LoopGaps(stall_limit=opts.stall_limit)
        self.stalls = self.gaps.stalls
        self.recompute_reasons: Counter = Counter()
        self.abandoned: Counter = Counter()  # what the timeout made us give up
        self.aborting: set[str] = set()  # requests aborted by the timeout, their recv report pending
        self.waited_for_blocks: set[str] = set()  # requests that found the pool short at least once
        # P
        self.prefill_q: deque[Prefill] = deque()
        self.prefilling = 0  # prefills whose KV the ranks are still writing
        self.turn2_q: deque[Turn2] = deque()
        self.consuming: dict[str, Turn2] = {}  # P turn-2 reads in flight, by request id
        # D
        self.waiting: deque[QueuedDecode] = deque()  # arrived, heartbeating, not yet allocated
        self.loading: dict[str, Decode] = {}  # allocated, awaiting the recv
        self.holds: dict[str, dict] = {}  # did -> hold record (turn-2 blocks)
        self.hold_stats: Counter = Counter()
        self._last_tick = time.monotonic()
        self.finished = False

    # ------------------------------------------------------------ blocks
    def alloc(self, rid: str, n: int) -> list[int] | None:
        if len(self.free) < n:
            self.waited_for_blocks.add(rid)
            return None
        blocks = [self.free.popleft() for _ in range(n)]
        self.owned[rid] = blocks
        return blocks

    def release(self, rid: str) -> None:
        blocks = self.owned.pop(rid, None)
        if blocks:
            # As if reused: a late reader must not see the old bytes.
            self.ranks.send_all(Poison(tuple(blocks)))
            self.free.extend(blocks)

    def fill(self, lid: str, blocks: list[int], first_index: int, then: Callable[[bool], None] | None = None) -> None:
        """Have every rank write its slice.  ``then(done)`` runs once every
        live rank has: a consumer may only be told where the blocks are
        after they hold the KV (in an engine, the forward pass is over
        before request_finished)."""
        token = 0
        if then is not None:
            token = next(self._tokens)
            self._verifying[token] = PendingVerify(then)
        self.ranks.send_all(Fill(lid, tuple(blocks), first_index, token))

    def verify(self, lid: str, blocks: list[int], first_index: int, then: Callable[[bool], None]) -> None:
        """Have every rank check its slice of ``blocks``; ``then(ok)`` once all
        live ranks answered (a rank lost meanwhile could not vouch: not ok)."""
        token = next(self._tokens)
        self._verifying[token] = PendingVerify(then)
        self.ranks.send_all(Verify(token, lid, tuple(blocks), first_index))

    def _on_verified(self, rank: int, token: int, ok: bool) -> None:
        pending = self._verifying.get(token)
        if pending is not None:
            pending.results[rank] = ok

    def _settle_verifies(self) -> bool:
        done = [t for t, v in self._verifying.items()
                if all(r in v.results or not self.ranks.live(r) for r in range(self.tp))]
        for token in done:
            v = self._verifying.pop(token)
            v.then(len(v.results) == self.tp and all(v.results.values()))
        return bool(done)

    # ------------------------------------------------------------ what the ranks saw
    def _on_lease_event(self, rank: int, rid: str, what: str, t: float, expiry: float) -> None:
        rec = self.lease_rec.get(rid)
        if what == "heartbeat":
            self.hb_by_rank[rank] += 1
            if rec is not None and rec.freed is None:
                rec.hb = t
                self.last_hb_at = t
                if rank == 0 and expiry > rec.expiry:
                    rec.expiry = expiry
        else:
            self.lease_reasons.setdefault(rid, set()).add(what)

    def _on_clock_offset(self, rank: int, engine: str, offset: float) -> None:
        base = base_engine_id(engine)
        self.offsets[base] = max(offset, self.offsets.get(base, offset))

    # ------------------------------------------------------------ loop
    def send(self, msg) -> None:
        self.conn.send(msg)

    def run(self) -> None:
        handle = handlers(TO_NODE, {Prefill: self.on_prefill, Turn2: self.on_turn2, Decode: self.on_decode,
                                    StatusRequest: self.on_status, Abandon: self.on_abandon,
                                    Release: self.on_release, Finish: self.on_finish})
        url = f"tcp://{self.sched.host}:{self.sched.ranks[0].side_channel_port}"
        self.send(Ready(engine_id=self.engine_id, side_channel_url=url, os_pid=os.getpid(),
                        rank_pids=tuple(self.ranks.pids)))
        while True:
            self._check_stall()
            busy = False
            while self.conn.poll(0):
                msg = self.conn.recv()
                handle[type(msg)](msg)
                if self.finished:
                    return
                busy = True
            self._check_stall()
            busy |= self.schedule()
            busy |= self.ranks.step()
            busy |= self.collect()
            busy |= self._settle_verifies()
            if not busy:
                # Wait ~1 ms, woken early by the orchestrator or any rank.
                wait([self.conn, *[c for r, c in enumerate(self.ranks.conns) if self.ranks.live(r)]], 0.001)

    def _check_stall(self) -> None:
        """Record the loop's gaps and stalls (SIGSTOP, a long pause, a call
        that blocked) for the summary, on both sides.  Nothing
        to fence here: the decode_request machine declines a READ whose lease
        the stall may have let expire, and cuts a READ in flight at the time
        its blocks are surely held (the driver fires that deadline before it
        polls the completion)."""
        now = time.monotonic()
        gap, self._last_tick = now - self._last_tick, now
        self.gaps.note(now, gap)

    def collect(self) -> bool:
        # Its load-error blocks are not read: the job recomputes by refilling the request's blocks itself.
        report = self.sched.get_finished()
        for rid in report.finished_sending:
            self._freed(rid, _lease_end_reason(self.lease_reasons.pop(rid, set())))
        for rid in report.finished_recving:
            self._recv_finished(rid, None)
        for failed in report.failed_recving:
            self._recv_finished(failed.request_id, failed.reason)
        return bool(report.finished_sending or report.finished_recving or report.failed_recving)

    # ------------------------------------------------------------ P side
    def on_prefill(self, msg: Prefill) -> None:
        self.prefill_q.append(msg)

    def on_turn2(self, msg: Turn2) -> None:
        self.turn2_q.append(msg)

    def on_decode(self, msg: Decode) -> None:
        # Params that arrive after P's lease expired are declined by the READ
        # gate (they carry the lease's expiry); no age check is needed here.
        try:
            self.sched.on_new_request(msg.request_id, msg.params)  # heartbeats start now
        except BadTransferParams as exc:  # nothing registered: compute it here instead
            self.recompute_reasons["params refused"] += 1
            self._decoded(msg, "recomputed", f"params refused: {exc}")
            return
        self.waiting.append(QueuedDecode(msg, ready_at=time.monotonic() + self.opts.overload))

    def on_finish(self, _msg: Finish) -> None:
        """Report and stop: the loop returns after this message."""
        self._finish()
        self.finished = True

    def on_status(self, _msg: StatusRequest) -> None:
        self.send(self.status())

    # ------------------------------------------------------------ timeout
    def on_abandon(self, _msg: Abandon) -> None:
        """The job timed out: give up all work through the machines.  Queued
        work is dropped; every request with a recv in flight is aborted (its
        READ cancelled; the report comes back and frees its blocks).  Leases
        and holds stay: the other side may still be reading them until it has
        abandoned too (``on_release``)."""
        a = self.abandoned
        a["queued_prefills"] += len(self.prefill_q)
        a["queued_turn2_reads"] += len(self.turn2_q)
        self.prefill_q.clear()
        self.turn2_q.clear()
        for queued in self.waiting:  # heartbeating, no blocks yet
            self.sched.abort(queued.msg.request_id)
        a["queued_decodes"] += len(self.waiting)
        self.waiting.clear()
        inflight = list(self.consuming) + list(self.loading)
        a["recvs_aborted"] += len(inflight)
        for rid in inflight:
            self.aborting.add(rid)
            self.sched.abort(rid)
        self._settle(lambda: not (self.loading or self.consuming or self.prefilling))
        loading = len(self.loading) + len(self.consuming)
        self.send(Abandoned(counts={k: v for k, v in a.items() if v}, xfers=loading, loading=loading))

    def on_release(self, _msg: Release) -> None:
        """The other side has abandoned (or is dead): nobody reads our blocks
        any more, so free every lease (P) and hold (D) now instead of waiting
        out their terms (a hold's TTL is 480 s in production)."""
        live = [rid for rid, r in self.lease_rec.items() if r.freed is None] if self.role == "P" else list(self.holds)
        holds_aborted = self.hold_stats["aborted"]
        for rid in live:
            self.sched.abort(rid)  # LeaseAbort: FreeBlocks
        self._settle(lambda: not self.lease_blocks_live and not self.holds)
        # Counted once they ended, by how: a completion already on its way when the abort went out (the
        # ranks report asynchronously) ends its lease consumed, and the abort released nothing there.
        if self.role == "P":
            self.abandoned["leases_released"] += sum(self.lease_rec[rid].reason == "aborted" for rid in live)
        else:
            self.abandoned["holds_released"] += self.hold_stats["aborted"] - holds_aborted
        self.send(Released(counts={k: v for k, v in self.abandoned.items() if v}, held_blocks=self.held_blocks()))

    def _settle(self, done: Callable[[], bool], timeout: float = 2.0) -> None:
        """Step with the ranks until ``done()`` (their answers are asynchronous)."""
        end = time.monotonic() + timeout
        while True:
            self.ranks.step()
            self.collect()
            self._settle_verifies()
            if done() or time.monotonic() > end:
                return
            time.sleep(0.001)

    def schedule(self) -> bool:
        return self._schedule_p() if self.role == "P" else self._schedule_d()

    def _schedule_p(self) -> bool:
        did = False
        # Turn-2 reads first, and while one waits for blocks no prefill takes
        # them: its source is D's hold, which ends on a fixed TTL, where a
        # prefill's lease simply waits (heartbeats) for its reader.  Under
        # sustained load new prefills took every freed block and nearly every
        # turn 2 waited out its hold and recomputed.
        while self.turn2_q:
            msg = self.turn2_q[0]
            blocks = self.alloc(msg.request_id, msg.nblocks)
            if blocks is None:
                did |= self._decline_turn2_without_blocks()
                return did
            self.turn2_q.popleft()
            p2id = msg.request_id
            try:
                self.sched.on_new_request(p2id, msg.params)
            except BadTransferParams as exc:  # nothing registered: recompute turn 1's KV here
                self.release(p2id)
                self.outcomes["turn2_recomputed"] += 1
                self.recompute_reasons["params refused"] += 1
                self.send(Turn2Done(lid=msg.lid, outcome="recomputed", detail=f"params refused: {exc}"))
                did = True
                continue
            n_ext, _ = self.sched.get_num_new_matched_tokens(p2id, msg.nblocks * BLOCK_TOKENS, 0)
            self.sched.update_state_after_alloc(p2id, blocks, n_ext)
            self.consuming[p2id] = msg
            did = True
        while self.prefill_q:
            msg = self.prefill_q[0]
            blocks = self.alloc(msg.request_id, msg.nblocks)
            if blocks is None:
                break  # wait for leases to be freed
            self.prefill_q.popleft()
            self.sched.on_new_request(msg.request_id, {"do_remote_decode": True, "push": msg.push})
            self.prefilling += 1
            self.fill(msg.lid, blocks, 0, then=lambda _ok, msg=msg, blocks=blocks: self._prefilled(msg, blocks))
            did = True
        return did

    def _prefilled(self, msg: Prefill, blocks: list[int]) -> None:
        """The prefill's KV is in every rank's blocks: lease them, tell D."""
        self.prefilling -= 1
        _delay, params = self.sched.request_finished(msg.request_id, blocks, reader_tp=self.opts.tp["D"])
        now = time.monotonic()
        # The stated expiry (plane clock); each rank's own is a little later.
        expiry = float(params["remote_expiry"]) if params else 0.0
        self.lease_rec[msg.request_id] = LeaseRecord(id=msg.request_id, lid=msg.lid, granted=now,
                                                     expiry=expiry, blocks=len(blocks))
        self.send(Prefilled(lid=msg.lid, params=params, granted_at=now))

    def _turn2_valid_until(self, params: dict) -> float | None:
        """Until when (our clock) D's held blocks are surely there, as the
        READ gate will compute it; None until a rank's handshake measured D's
        clock offset (the gate then decides once the read is allocated).  Of
        the ranks' estimates the largest, which declines soonest."""
        expiry = params.get("remote_expiry")
        offset = self.offsets.get(params.get("remote_engine_id"))
        if expiry is None or offset is None:
            return None
        return float(expiry) - offset

    def _decline_turn2_without_blocks(self) -> bool:
        """Decline, before allocating, every queued turn-2 read whose hold the
        gate would already refuse: it could not start in time anyway, and
        waiting on would hold up the prefills behind it for nothing.  Its
        turn 1 is recomputed (not modelled here: it needs no remote read)."""
        now, margin = self.clock(), self.cfg.expiry_safety_margin
        keep: deque[Turn2] = deque()
        declined = 0
        for msg in self.turn2_q:
            valid_until = self._turn2_valid_until(msg.params)
            if valid_until is not None and valid_until <= now + margin:
                declined += 1
                self.outcomes["turn2_recomputed"] += 1
                self.recompute_reasons[NO_BLOCKS] += 1
                self.send(Turn2Done(lid=msg.lid, outcome="recomputed", detail=NO_BLOCKS))
            else:
                keep.append(msg)
        self.turn2_q = keep
        return declined > 0

    # ------------------------------------------------------------ D side
    def _schedule_d(self) -> bool:
        did = False
        now = time.monotonic()
        while self.waiting and self.waiting[0].ready_at <= now:
            req = self.waiting[0].msg
            n, k = req.nblocks, req.prefix
            blocks = self.alloc(req.request_id, n)
            if blocks is None:
                break  # queue on: heartbeats keep P's lease alive meanwhile
            self.waiting.popleft()
            did = True
            self.fill(req.lid, blocks[:k], 0)  # the locally cached prefix
            n_ext, _ = self.sched.get_num_new_matched_tokens(req.request_id, n * BLOCK_TOKENS, k * BLOCK_TOKENS)
            if n_ext > 0:
                self.sched.update_state_after_alloc(req.request_id, blocks[k:], n_ext)
                self.loading[req.request_id] = req
            elif req.await_full:
                self.sched.update_state_after_alloc(req.request_id, [], 0, awaiting=True)
                self.loading[req.request_id] = req
            else:
                # Notify-only: nothing to load; the request runs now.
                self.sched.update_state_after_alloc(req.request_id, [], 0, awaiting=False)
                self._run_and_finish(req, "ok", "full prefix hit, notify-only")
        return did

    def _recv_finished(self, rid: str, reason: str | None) -> None:
        """The recv of ``rid`` ended: ``reason`` is why it failed (None: it did not)."""
        failed = reason is not None
        if rid in self.aborting:
            # Aborted by the timeout: its machine is gone, its blocks are ours.
            self.aborting.discard(rid)
            self.consuming.pop(rid, None)
            self.loading.pop(rid, None)
            self.release(rid)
            return
        if failed:
            self.recompute_reasons[reason] += 1
        if self.role == "P":
            msg = self.consuming.get(rid)
            if msg is None:
                return
            blocks = self.owned[rid]
            if failed:
                self.fill(msg.lid, blocks, 0)  # recompute turn 1's KV locally
                self._turn2_done(rid, msg, "recomputed", f"turn-2 read: {reason}")
                return

            def verified(ok: bool) -> None:
                if ok:
                    self.verified_bytes += len(blocks) * self.block_bytes
                    self._turn2_done(rid, msg, "ok", "")
                else:
                    self._turn2_done(rid, msg, "corrupt", "turn-2 bytes differ from the pattern")

            self.verify(msg.lid, blocks, 0, verified)
            return
        req = self.loading.get(rid)
        if req is None:
            return
        k, blocks = req.prefix, self.owned[rid]
        if failed:
            # Recompute locally; a hold must not be offered before the KV is in (turn 2 would read it).
            self.fill(req.lid, blocks[k:], k,
                      then=lambda _ok: self._loaded(req, "recomputed", f"recv failed: {reason}"))
        elif k == req.nblocks:
            self._loaded(req, "ok", "full prefix hit, awaited")
        else:
            def verified(ok: bool) -> None:
                if ok:
                    self.verified_bytes += (len(blocks) - k) * self.block_bytes
                    self._loaded(req, "ok", "")
                else:
                    self._loaded(req, "corrupt", "bytes differ from the pattern")

            self.verify(req.lid, blocks[k:], k, verified)

    def _turn2_done(self, rid: str, msg: Turn2, outcome: str, detail: str) -> None:
        if self.consuming.pop(rid, None) is None:
            return  # abandoned meanwhile
        self.outcomes[f"turn2_{outcome}"] += 1
        self.sched.request_running(rid)
        self.sched.request_finished(rid, self.owned[rid])
        self.release(rid)
        self.send(Turn2Done(lid=msg.lid, outcome=outcome, detail=detail))

    def _loaded(self, req: Decode, outcome: str, detail: str) -> None:
        if self.loading.pop(req.request_id, None) is None:
            return  # abandoned meanwhile
        self._run_and_finish(req, outcome, detail)

    def _run_and_finish(self, req: Decode, outcome: str, detail: str) -> None:
        did = req.request_id
        self.sched.request_running(did)
        blocks = self.owned[did]
        # The hold awaits every P rank that reads each D rank (the TP mapping, reversed).
        delay, params = self.sched.request_finished(did, blocks, hold_for_next_turn=req.hold,
                                                    reader_tp=self.opts.tp["P"])
        hold = None
        if delay and params is not None:
            self.holds[did] = {"lid": req.lid}
            self.hold_stats["granted"] += 1
            hold = params
        else:
            self.release(did)
        self._decoded(req, outcome, detail, hold)

    def _decoded(self, req: Decode, outcome: str, detail: str, hold: dict | None = None) -> None:
        self.outcomes[outcome] += 1
        self.send(Decoded(lid=req.lid, outcome=outcome, detail=detail, hold=hold))

    def _freed(self, rid: str, reason: str) -> None:
        now = time.monotonic()
        rec = self.lease_rec.get(rid)
        if rec is not None:
            rec.freed, rec.reason = now, reason
        if rid in self.holds:
            self.holds.pop(rid)
            self.hold_stats[reason] += 1
        self.release(rid)

    # ------------------------------------------------------------ reports
    @property
    def lease_blocks_live(self) -> bool:
        return any(r.freed is None for r in self.lease_rec.values())

    def held_blocks(self) -> int:
        return sum(len(b) for b in self.owned.values())

    def lease_blocks(self) -> int:
        return sum(len(self.owned.get(rid, ())) for rid, r in self.lease_rec.items() if r.freed is None)

    def status(self) -> Status:
        return Status(held_blocks=self.held_blocks(), lease_blocks=self.lease_blocks(),
                      waiting=len(self.waiting) + len(self.prefill_q) + len(self.turn2_q) + self.prefilling,
                      loading=len(self.loading) + len(self.consuming), holds=len(self.holds),
                      last_hb_at=self.last_hb_at, stalls=list(self.stalls), max_loop_gap_s=self.gaps.max_gap_s)

    def _finish(self) -> None:
        self._settle(lambda: not self._verifying, timeout=5.0)
        rank_summaries = self.ranks.stop()
        self.collect()
        ranks = [rank_summaries[r] for r in sorted(rank_summaries)]
        counters: Counter = Counter()
        anomalies: Counter = Counter()
        for rs in ranks:
            counters.update(rs.counters)
            anomalies.update(rs.anomalies)
        leases = Counter(r.reason or "live" for r in self.lease_rec.values())
        lifecycle = LifecycleCounts.total([rs.lifecycle for rs in ranks])
        summary = {
            "role": self.role, "engine_id": self.engine_id, "log": self.log_path,
            "outcomes": dict(self.outcomes), "verified_bytes": self.verified_bytes,
            "bytes_moved": sum(rs.bytes_moved for rs in ranks),
            # The ranks move in parallel: the engine was busy while any rank was.
            "busy_s": max((rs.busy_s for rs in ranks), default=0.0),
            "counters": dict(counters),
            # Counted from the planes' own transitions, as replay counts them.
            "lifecycle": lifecycle,
            "engines_evicted": lifecycle["engines_evicted"],
            "engines_closed_at_shutdown": sum(rs.engines_closed_at_shutdown for rs in ranks),
            "heartbeats_sent": sum(rs.heartbeats_sent for rs in ranks),
            "heartbeats_received": sum(rs.heartbeats_received for rs in ranks),
            "leases": {"granted": len(self.lease_rec), "extended": lifecycle["leases"]["extended"],
                       "expired": leases.get("expired", 0), "consumed": leases.get("consumed", 0),
                       "aborted": leases.get("aborted", 0), "live": leases.get("live", 0)},
            "lease_records": list(self.lease_rec.values()),
            "holds": dict(self.hold_stats), "last_hb_at": self.last_hb_at,
            "held_blocks": self.held_blocks() + sum(rs.held_lease_blocks for rs in ranks),
            "plane_held": [h for rs in ranks for h in rs.plane_held],
            "anomalies": dict(anomalies),
            "stalls": self.stalls, "loop": self.gaps.to_dict(), "clock_offsets": dict(self.offsets),
            # Which NIXL call, if any, held a rank's loop up (rank 0's slowest of each kind).
            "nixl_calls": ranks[0].nixl_calls if ranks else {},
            "recompute_reasons": dict(self.recompute_reasons), "abandoned": dict(self.abandoned),
            "waited_for_blocks": dict(Counter("turn2" if rid.startswith("p2-") else "prefill" if rid.startswith("p-")
                                              else "decode" for rid in self.waited_for_blocks)),
            "ranks": [{"rank": rs.rank, "engine_id": rs.engine_id, "lease_blocks_held": rs.held_lease_blocks,
                       "plane_held": len(rs.plane_held), "heartbeats_received": rs.heartbeats_received,
                       "lease_heartbeats": self.hb_by_rank.get(rs.rank, 0), "heartbeats_sent": rs.heartbeats_sent,
                       "leases_ended": rs.leases_ended, "bytes_moved": rs.bytes_moved,
                       "cpu_s": round(rs.cpu_s, 3), "waits": rs.waits, "log": self.log_paths[rs.rank]} for rs in ranks],
            "lost_ranks": sorted(self.ranks.lost - set(rank_summaries)),
            "rank_crashes": dict(self.ranks.crashes),
            "transfers": [t for rs in ranks for t in rs.transfers],
            "bare_reads": [t for rs in ranks for t in rs.bare_reads],
            "bare_read_error": next((rs.bare_read_error for rs in ranks if rs.bare_read_error), None),
            "plane_cpu_s": sum(rs.plane_cpu_s for rs in ranks), "plane_gc_s": sum(rs.plane_gc_s for rs in ranks),
            "plane_apart_s": sum(rs.plane_apart_s for rs in ranks),
        }
        self.send(Summary(**summary))


def _lease_end_reason(reasons: set[str]) -> str:
    """One word for a lease the ranks ended, each for its own reason: any
    rank's expiry makes it expired (a reader missed a rank), else aborted,
    else consumed (every rank's readers read)."""
    for reason in ("expired", "aborted", "consumed"):
        if reason in reasons:
            return reason
    return "lost" if not reasons else sorted(reasons)[0]


def node_main(role: str, conn, opts: NodeOptions) -> None:
    """Process entry point (multiprocessing 'spawn')."""
    node = None
    try:
        # Before NIXL and any socket: its namespace (--hosts netns) and UCX devices;
        # the worker ranks it spawns inherit both.
        enter_placement(opts.placement)
        node = Node(role, conn, opts)
        node.run()
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches the whole process group; the orchestrator cleans up
    except BaseException:
        try:
            conn.send(Crashed(role=role, traceback=traceback.format_exc()))
        except Exception:
            pass
        raise SystemExit(1) from None
    finally:
        if node is not None:
            node.ranks.kill()  # a rank outliving its scheduler would hold its agent and memory
