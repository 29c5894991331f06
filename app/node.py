"""One engine process of ``kvplane run``: the prefill (P) or the decode (D) side.

Each node owns a small torch KV cache ([num_blocks, block_elems] float32,
DRAM) registered with NIXL through ``KVPlaneWorker``, a ``PlaneDriver``
(its ZMQ side channel included) and a ``KVPlaneScheduler``, and runs one
step loop: read the orchestrator's messages, schedule, step the driver,
collect what finished, and sleep ~1 ms when nothing happened.  No thread
is added beyond the driver's handshake pool.

P fills each request's blocks with a pattern derived from the request id
and the block index; whoever receives blocks (D on turn 1, P reading D's
held blocks on turn 2) checks every byte against it.  Freed blocks are
poisoned, as a reused block would be overwritten, so a read of reclaimed
blocks cannot pass verification by luck.

Messages are the attrs classes of ``messages.py`` over a multiprocessing Pipe.
"""
from __future__ import annotations

import math
import os
import time
import traceback
import zlib
from collections import Counter, deque

import attrs

from kvplane.statemachines.actions import ReportRecv
from kvplane.statemachines.events import LeaseHeartbeat
from kvplane.statemachines.stats import PROTOCOL_VIOLATION, UNKNOWN_ID, UNKNOWN_KIND, Anomaly, FailClosed

from .messages import (TO_NODE, Abandon, Abandoned, Crashed, Decode, Decoded, Finish, LeaseRecord, NodeOptions,
                       Prefill, Prefilled, Release, Released, Ready, Status, StatusRequest, Summary, Turn2, Turn2Done,
                       handlers)

# Tokens per KV block: prompt lengths are whole blocks in this synthetic job.
BLOCK_TOKENS = 16
POISON = -1.0
_MASK = (1 << 20) - 1  # pattern values stay exact in float32


# A gap between two loop ticks longer than this is listed in the summary
# (its end time and length): every timer due inside it fired that late.
LOOP_GAP_REPORT_S = 0.1
LOOP_GAPS_KEPT = 10_000
# Why a turn-2 read was not made although its hold was on time: P had no
# free blocks before the hold's validity, less the gate's margin, ran out.
NO_BLOCKS = "declined: no free blocks before the hold's expiry"


def pattern_seed(lid: str, block_index: int) -> int:
    return zlib.crc32(f"{lid}/{block_index}".encode()) & _MASK


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


def recv_failure_reason(event_name: str, label: str, before: str | None) -> str:
    """Why a recv was reported failed, from the stimulus whose effects
    reported it (the machine that took it, and its state before)."""
    kind = label.split(":", 1)[0]
    if kind == "decode_request":
        if event_name == "StartLoad":  # the engine was connected: the gate ran at once
            return "declined by the expiry gate"
        if event_name == "ReadFailed":
            return "transfer failed"
        if event_name == "Abort":
            return "aborted"
        if event_name == "TimerFired":
            return {"READING": "transfer deadline (timeout or the remote blocks' validity)",
                    "HANDSHAKING": "handshake did not complete in time",
                    "AWAITING_PUSH": "push did not arrive in time"}.get(before or "", "recv timed out")
    if kind == "remote_engine":
        if event_name == "HandshakeOk":  # connected now: the waiting requests' gate ran
            return "declined by the expiry gate"
        if event_name in ("HandshakeFailed", "TimerFired"):
            return "handshake failed"
    if event_name == "PeerDisconnected":
        return "engine lost"
    return f"{event_name} ({kind})"


@attrs.define
class QueuedDecode:
    """A Decode waiting in D's queue (heartbeating) until ``ready_at``."""

    msg: Decode
    ready_at: float


class Node:
    def __init__(self, role: str, conn, opts: NodeOptions):
        import torch

        from kvplane.statemachines.eventlog import EventLogWriter
        from kvplane.transport.faults import DropNotifications
        from kvplane.transport.nixl_agent import NixlEndpoint

        from kvplane.connector.connector import KVPlaneScheduler, KVPlaneWorker
        from kvplane.connector.driver import PlaneDriver

        self.torch = torch
        self.role = role
        self.conn = conn
        self.opts = opts
        self.engine_id = opts.engine_ids[role]
        skew = opts.clock_skew if role == "D" else 0.0
        # D's plane runs on a skewed clock; the handshake's offset estimate
        # must absorb it.  Fences and reports use the raw monotonic clock,
        # which all processes on this machine share.
        self.clock = (lambda: time.monotonic() + skew) if skew else time.monotonic
        self.cfg = opts.plane
        self.ep = NixlEndpoint(self.engine_id)
        self.faults = DropNotifications(self.ep, rate=opts.drop_notifications, seed=opts.seed * 2 + (role == "D"))
        self.driver = PlaneDriver(engine_id=self.engine_id, endpoint=self.faults if self.faults.rate else self.ep,
                                  config=self.cfg, clock=self.clock,
                                  # Authenticated side channel: this run's keys (orchestrator.run_keys).
                                  curve_keypair=tuple(opts.curve.keypair), trusted_peers=opts.curve.peers)
        self.sched = KVPlaneScheduler(self.driver)
        self.worker = KVPlaneWorker(self.driver)
        nb, be = opts.num_blocks, opts.block_elems
        self.kv = torch.full((nb, be), POISON, dtype=torch.float32)
        self.block_bytes = be * 4
        self.worker.register_kv_caches(self.kv)
        self._ramp = torch.arange(be, dtype=torch.int64) * 7
        self.free: deque[int] = deque(range(nb))
        self.owned: dict[str, list[int]] = {}  # request id -> blocks allocated to it
        self.log_path = os.path.join(opts.out, f"{'prefill' if role == 'P' else 'decode'}.events.jsonl")
        self._log_stream = open(self.log_path, "w", encoding="utf-8")
        self.log = EventLogWriter.attach(self.driver.plane, self._log_stream, flush_every=1 << 30)
        self._tally_chain = self.driver.plane.recorder
        self.driver.plane.recorder = self._tally
        self.lease_rec: dict[str, LeaseRecord] = {}  # P: by lease (request) id
        self.last_hb_at: float | None = None  # raw clock of the last heartbeat that reached a lease
        self.extended = 0
        self.outcomes: Counter = Counter()
        self.verified_bytes = 0
        self.busy_s = 0.0  # time with at least one posted transfer in flight
        self.gaps = LoopGaps(stall_limit=opts.stall_limit)
        self.stalls = self.gaps.stalls
        self.fail_reason: dict[str, str] = {}  # request id -> why its recv was reported failed
        self.recompute_reasons: Counter = Counter()
        self.abandoned: Counter = Counter()  # what the timeout made us give up
        self.aborting: set[str] = set()  # requests aborted by the timeout, their recv report pending
        self.waited_for_blocks: set[str] = set()  # requests that found the pool short at least once
        # P
        self.prefill_q: deque[Prefill] = deque()
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
    def pattern(self, lid: str, index: int):
        return ((self._ramp + pattern_seed(lid, index)) & _MASK).to(self.torch.float32)

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
            self.kv[blocks] = POISON  # as if reused: a late reader must not see the old bytes
            self.free.extend(blocks)

    def fill(self, lid: str, blocks: list[int], first_index: int) -> None:
        for i, b in enumerate(blocks):
            self.kv[b] = self.pattern(lid, first_index + i)

    def verify(self, lid: str, blocks: list[int], first_index: int) -> bool:
        return all(self.torch.equal(self.kv[b], self.pattern(lid, first_index + i)) for i, b in enumerate(blocks))

    # ------------------------------------------------------------ recorder tally
    def _tally(self, step) -> None:
        self._tally_chain(step)
        event, label, before, actions = step.event, step.machine, step.state_before, step.actions
        for a in actions:
            if isinstance(a, ReportRecv) and not a.ok:
                self.fail_reason[a.request_id] = recv_failure_reason(type(event).__name__, label, before)
        if isinstance(event, LeaseHeartbeat):
            rec = self.lease_rec.get(event.request_id)
            if rec is not None and rec.freed is None:
                t = time.monotonic()
                rec.hb = t
                self.last_hb_at = t
                lease = self.driver.plane.get("lease", event.request_id)
                if lease is not None and lease.expiry > rec.expiry:
                    rec.expiry = lease.expiry
                    self.extended += 1

    # ------------------------------------------------------------ loop
    def send(self, msg) -> None:
        self.conn.send(msg)

    def run(self) -> None:
        handle = handlers(TO_NODE, {Prefill: self.on_prefill, Turn2: self.on_turn2, Decode: self.on_decode,
                                    StatusRequest: self.on_status, Abandon: self.on_abandon,
                                    Release: self.on_release, Finish: self.on_finish})
        self.send(Ready(engine_id=self.engine_id, side_channel_url=self.driver.side_channel_url, os_pid=os.getpid()))
        last_flush = time.monotonic()
        last = time.monotonic()
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
            self._check_stall()
            meta = self.sched.build_connector_meta()
            if meta.load:
                self.worker.start_load_kv(meta)  # feeds StartLoad and steps the driver
                busy = True
            else:
                busy |= self.driver.step() > 0
            busy |= self.collect()
            now = time.monotonic()
            if self.driver.xfers:
                self.busy_s += now - last
            last = now
            if now - last_flush > 0.1:
                self.log.flush()  # a killed process keeps its log up to ~100 ms ago
                last_flush = now
            if not busy:
                # Sleep ~1 ms, woken early by a message.  While a transfer is
                # posted, or a peer may be reading our leased blocks (UCX over
                # TCP needs the target to progress too), poll every 0.2 ms.
                serving = self.driver.xfers or self.holds or self.lease_blocks_live
                self.conn.poll(0.0002 if serving else 0.001)

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
        d = self.driver
        failed = set(d.failed_recving)
        sending, recving = self.worker.get_finished()
        self.worker.get_block_ids_with_load_errors()
        freed, d.freed = d.freed, []
        for rid, _blocks, reason in freed:
            self._freed(rid, reason)
        for rid in recving:
            self._recv_finished(rid, rid in failed)
        return bool(sending or recving or freed)

    # ------------------------------------------------------------ P side
    def on_prefill(self, msg: Prefill) -> None:
        self.prefill_q.append(msg)

    def on_turn2(self, msg: Turn2) -> None:
        self.turn2_q.append(msg)

    def on_decode(self, msg: Decode) -> None:
        # Params that arrive after P's lease expired are declined by the READ
        # gate (they carry the lease's expiry); no age check is needed here.
        self.sched.on_new_request(msg.request_id, msg.params)  # heartbeats start now
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
        self.driver.step()
        self.collect()
        self.send(Abandoned(counts={k: v for k, v in a.items() if v}, xfers=len(self.driver.xfers),
                            loading=len(self.loading) + len(self.consuming)))

    def on_release(self, _msg: Release) -> None:
        """The other side has abandoned (or is dead): nobody reads our blocks
        any more, so free every lease (P) and hold (D) now instead of waiting
        out their terms (a hold's TTL is 480 s in production)."""
        live = [rid for rid, r in self.lease_rec.items() if r.freed is None] if self.role == "P" else list(self.holds)
        for rid in live:
            self.sched.abort(rid)  # LeaseAbort: FreeBlocks
        self.abandoned["leases_released" if self.role == "P" else "holds_released"] += len(live)
        self.driver.step()
        self.collect()
        self.send(Released(counts={k: v for k, v in self.abandoned.items() if v}, held_blocks=self.held_blocks()))

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
            self.sched.on_new_request(p2id, msg.params)
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
            self.fill(msg.lid, blocks, 0)  # the "prefill"
            self.sched.on_new_request(msg.request_id, {"do_remote_decode": True, "push": msg.push})
            _delay, params = self.sched.request_finished(msg.request_id, blocks)
            now = time.monotonic()
            lease = self.driver.plane.get("lease", msg.request_id)
            self.lease_rec[msg.request_id] = LeaseRecord(id=msg.request_id, lid=msg.lid, granted=now,
                                                         expiry=lease.expiry if lease else 0.0, blocks=len(blocks))
            self.send(Prefilled(lid=msg.lid, params=params, granted_at=now))
            did = True
        return did

    def _turn2_valid_until(self, params: dict) -> float | None:
        """Until when (our clock) D's held blocks are surely there, as the
        READ gate will compute it; None until a handshake measured D's clock
        offset (the gate then decides once the read is allocated)."""
        expiry = params.get("remote_expiry")
        engine = self.driver.plane.get("remote_engine", params.get("remote_engine_id"))
        if expiry is None or engine is None or not math.isfinite(engine.best_rtt):
            return None
        return float(expiry) - engine.clock_offset

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

    def _recv_finished(self, rid: str, failed: bool) -> None:
        reason = self.fail_reason.pop(rid, "unknown") if failed else None
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
            msg = self.consuming.pop(rid, None)
            if msg is None:
                return
            blocks = self.owned[rid]
            if failed:
                self.fill(msg.lid, blocks, 0)  # recompute turn 1's KV locally
                outcome, detail = "recomputed", f"turn-2 read: {reason}"
            elif self.verify(msg.lid, blocks, 0):
                outcome, detail = "ok", ""
                self.verified_bytes += len(blocks) * self.block_bytes
            else:
                outcome, detail = "corrupt", "turn-2 bytes differ from the pattern"
            self.outcomes[f"turn2_{outcome}"] += 1
            self.sched.request_running(rid)
            self.sched.request_finished(rid, blocks)
            self.release(rid)
            self.send(Turn2Done(lid=msg.lid, outcome=outcome, detail=detail))
            return
        req = self.loading.pop(rid, None)
        if req is None:
            return
        k, blocks = req.prefix, self.owned[rid]
        if failed:
            self.fill(req.lid, blocks[k:], k)
            outcome = "recomputed"
            detail = f"recv failed: {reason}"
        elif k == req.nblocks:
            outcome, detail = "ok", "full prefix hit, awaited"
        elif self.verify(req.lid, blocks[k:], k):
            outcome, detail = "ok", ""
            self.verified_bytes += (len(blocks) - k) * self.block_bytes
        else:
            outcome, detail = "corrupt", "bytes differ from the pattern"
        self._run_and_finish(req, outcome, detail)

    def _run_and_finish(self, req: Decode, outcome: str, detail: str) -> None:
        did = req.request_id
        self.sched.request_running(did)
        blocks = self.owned[did]
        delay, params = self.sched.request_finished(did, blocks, hold_for_next_turn=req.hold)
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
                      waiting=len(self.waiting) + len(self.prefill_q) + len(self.turn2_q),
                      loading=len(self.loading) + len(self.consuming), holds=len(self.holds),
                      last_hb_at=self.last_hb_at, stalls=list(self.stalls), max_loop_gap_s=self.gaps.max_gap_s)

    def _finish(self) -> None:
        d = self.driver
        evicted = d.counters["engines_evicted"]
        offsets = {k: e.clock_offset for k, e in d.plane.instances["remote_engine"].items()}
        closed = d.disconnect_idle_engines()
        self.collect()
        self.log.flush()
        stats = d.plane.stats
        leases = Counter(r.reason or "live" for r in self.lease_rec.values())
        summary = {
            "role": self.role, "engine_id": self.engine_id, "log": self.log_path,
            "outcomes": dict(self.outcomes), "verified_bytes": self.verified_bytes,
            "bytes_moved": d.counters["bytes_moved"], "busy_s": self.busy_s,
            "counters": {**d.counters, **({"notifs_dropped_injected": self.faults.dropped} if self.faults.dropped else {})},
            "engines_evicted": evicted, "engines_closed_at_shutdown": closed,
            "heartbeats_sent": stats.get("heartbeats_sent", 0),
            "heartbeats_received": d.counters.get("heartbeats_received", 0),
            "leases": {"granted": len(self.lease_rec), "extended": self.extended,
                       "expired": leases.get("expired", 0), "consumed": leases.get("consumed", 0),
                       "aborted": leases.get("aborted", 0), "live": leases.get("live", 0)},
            "lease_records": list(self.lease_rec.values()),
            "holds": dict(self.hold_stats), "last_hb_at": self.last_hb_at,
            "held_blocks": self.held_blocks(),
            "plane_held": [[k, str(key), s, list(h)] for k, key, s, h in d.plane.held()],
            "anomalies": {str(k): v for k, v in stats.items() if isinstance(k, FailClosed) or isinstance(k, Anomaly)
                          and k.what in (UNKNOWN_ID, UNKNOWN_KIND, PROTOCOL_VIOLATION)},
            "stalls": self.stalls, "loop": self.gaps.to_dict(), "clock_offsets": offsets,
            # Which NIXL call, if any, held the loop up (the slowest of each kind).
            "nixl_calls": self.ep.call_times.to_dict(),
            "recompute_reasons": dict(self.recompute_reasons), "abandoned": dict(self.abandoned),
            "waited_for_blocks": dict(Counter("turn2" if rid.startswith("p2-") else "prefill" if rid.startswith("p-")
                                              else "decode" for rid in self.waited_for_blocks)),
        }
        self.send(Summary(**summary))
        self.worker.shutdown()
        self._log_stream.close()


def node_main(role: str, conn, opts: NodeOptions) -> None:
    """Process entry point (multiprocessing 'spawn')."""
    node = None
    try:
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
            try:
                node.log.flush()
            except Exception:
                pass
