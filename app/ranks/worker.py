"""One worker rank of an engine: its own process, NIXL agent, KV shard and plane.

The scheduler process spawns one per TP rank.  A rank owns a
[num_blocks, block_elems // tp] float32 tensor (its heads of every block),
registered with NIXL through its ``ConnectorWorker``, and runs a step
loop: apply what the scheduler sent (``StepMeta``, fill / verify / poison
jobs, in pipe order), step its driver, and send a ``RankStep`` whenever
something finished.

The data path (measured here with nixl 1.5.1 over UCX: a READ completes
only when its reader and its target both progress, and ``Connection.poll``
with a timeout sleeps at least ~1 ms) sets how the loop waits:

- a transfer of this rank posted less than ``SPIN_LIMIT_S`` ago: no sleep
  at all (an older one, say to a hung peer, is polled every ``NAP_S``);
- blocks a peer may READ (the plane holds a lease) and nothing else to do:
  progress UCX every ``NAP_S`` for up to ``IDLE_WAIT_S``, so a reader's
  READ is served within ~0.1 ms, not after a 1 ms sleep;
- nothing at all: sleep up to ``IDLE_WAIT_S``, woken by a message.

D's rank 0 also makes, when it has nothing else to do, one bare NIXL READ
(``bare_read``, two private agents) of the size of each READ it made: the
figure the summary compares the job's READs with, under the same load.

Fill and verify work is off the polling path: it waits while a transfer of
this rank is young and otherwise runs in slices of ``SLICE_ELEMS`` elements
with UCX progressed between slices, and the loop polls every
``JOB_BUDGET_S`` (a reader of this rank's blocks is not held up for a whole
request's worth of torch work).  Jobs and
step metadata stay in pipe order: a Step waits behind an unfinished job.

The pattern a block is filled with is the whole block's (``pattern``), of
which each rank writes and checks its own slice, so ranks of engines with
different TP agree on every byte.
"""
from __future__ import annotations

import math
import os
import time
import traceback
import zlib
from collections import Counter, deque
from typing import Any, Iterator

from kvplane.statemachines.actions import FreeBlocks
from kvplane.statemachines.events import HandshakeOk, LeaseHeartbeat
from kvplane.statemachines.lifecycle_counts import LifecycleCounts
from kvplane.statemachines.machines import MACHINES
from kvplane.statemachines.observe import CaptureObserver, observed
from kvplane.statemachines.stats import PROTOCOL_VIOLATION, UNKNOWN_ID, UNKNOWN_KIND, Anomaly, FailClosed

from ..job.messages import handlers
from ..job.plane_cpu import PlaneCpu
from .messages import (TO_RANK, Fill, Poison, RankCrashed, RankOptions, RankReady, RankStep, RankSummary, Step,
                            Stop, Verify)

POISON = -1.0
ALIVE_EVERY_S = 0.2
_MASK = (1 << 20) - 1  # pattern values stay exact in float32
# Spin (no sleep) while a transfer of this rank is younger than this; a
# 3 MiB READ takes ~1 ms here, one to a hung peer stays posted until its
# deadline (seconds), and must not burn a core all that time.
SPIN_LIMIT_S = 0.05
NAP_S = 0.0001  # time.sleep, not Connection.poll: the latter sleeps >= ~1 ms
IDLE_WAIT_S = 0.001
SLICE_ELEMS = 1 << 15  # fill / verify work between two progress calls (128 KiB of float32)
JOB_BUDGET_S = 0.001  # fill / verify work in one loop pass, at most (and one slice more)
BARE_MAX = 5000  # bare NIXL READs D rank 0 makes beside the job's, at most


def pattern_seed(lid: str, block_index: int) -> int:
    return zlib.crc32(f"{lid}/{block_index}".encode()) & _MASK


class RankWorker:
    def __init__(self, conn, opts: RankOptions):
        import torch

        from kvplane.connector.rank_factory import RankSetup, build_rank
        from kvplane.statemachines.config import PlaneConfig

        # One intra-op thread: two on this 2-core box made a 3 MiB compare ~4x
        # slower under load, and the rank's polling needs the other core.
        torch.set_num_threads(1)
        self.torch = torch
        self.conn = conn
        self.opts = opts
        skew = opts.clock_skew
        clock = (lambda: time.monotonic() + skew) if skew else time.monotonic
        # The summary's lease and engine counts: the machines' own
        # transitions, counted as replay counts them (LifecycleCounts).
        self.lifecycle = LifecycleCounts()
        self.plane_cpu = PlaneCpu()  # the plane's CPU, recorder on, for the summary
        # The job's own observers (these counts, ``_tally``) are summed apart: no engine runs them
        # (the counts' Steps too: ``observed``'s ``wrap``).
        counted = observed({k: MACHINES[k] for k in LifecycleCounts.KINDS}, self.lifecycle, wrap=self.plane_cpu.apart)
        self._lease_events: list[tuple[str, str, float, float]] = []
        self.busy_s = 0.0
        self._offsets: list[tuple[str, float]] = []
        self._last_sent = 0.0
        self._ended: Counter = Counter()  # leases (and holds) ended, by why
        self.parts = build_rank(
            RankSetup(engine_id=opts.engine_id, rank=opts.rank, tp_size=opts.tp_size,
                      drop_notifications=opts.drop_notifications, fault_seed=opts.seed, log_path=opts.log_path,
                      log_flush_every=1 << 30),  # flushed by the loop (and at the end)
            observers=(CaptureObserver(self.plane_cpu.apart(self._tally_capture), self.plane_cpu.apart(self._tally)),), config=PlaneConfig(**opts.plane_fields), clock=clock,
            curve_keypair=tuple(opts.keypair), trusted_peers=opts.peers, host=opts.side_channel_host,
            machines={**MACHINES, **counted})
        self.rank_id, self.ep, self.faults = self.parts.rank_id, self.parts.endpoint, self.parts.faults
        self.driver, self.worker, self.log = self.parts.driver, self.parts.worker, self.parts.log_writer
        self.plane_cpu.attach(self.driver.plane)
        if opts.block_elems % opts.tp_size:
            raise ValueError(f"block_elems {opts.block_elems} is not divisible by TP {opts.tp_size}")
        self.shard = opts.block_elems // opts.tp_size
        lo = opts.rank * self.shard
        self.kv = torch.full((opts.num_blocks, self.shard), POISON, dtype=torch.float32)
        self.worker.register_kv_caches(self.kv)
        self._ramp = (torch.arange(lo, lo + self.shard, dtype=torch.int64) * 7)
        self._verified: list[tuple[int, bool]] = []
        self._queue: deque[Any] = deque()  # messages not applied yet, in pipe order
        self._job: Iterator[None] | None = None  # the fill or verify job under way, by slices
        self._handle: dict[type, Any] = {}
        self.waits: Counter = Counter()  # how the loop waited, by kind (``_wait``)
        # The bare NIXL READ beside the job's (``_bare_read``): sized for the largest request.
        self._bare: Any = None
        self._bare_pending: deque[int] = deque()
        self._reads_seen = 0
        self._bare_done: tuple = ()
        self._bare_error: str | None = None
        if opts.measure_bare_read:
            from ..job.bare_read import BareReader

            try:
                self._bare = BareReader(self.shard * self.kv.element_size(), max(1, opts.num_blocks // 2),
                                        name=f"{self.rank_id}-bare")
            except Exception as exc:
                self._bare_error = f"{type(exc).__name__}: {exc}"
        self.stopped = False

    # ------------------------------------------------------------ blocks
    def patterns(self, lid: str, first_index: int, count: int):
        """The patterns of blocks ``first_index ..`` of ``lid``, this rank's slice, one row each."""
        torch = self.torch
        seeds = torch.tensor([pattern_seed(lid, first_index + i) for i in range(count)], dtype=torch.int64)
        return ((self._ramp.unsqueeze(0) + seeds.unsqueeze(1)) & _MASK).to(torch.float32)

    def _slices(self, block_ids: tuple[int, ...]) -> Iterator[tuple[int, list[int]]]:
        """(offset, block ids) of each slice of ``block_ids``: SLICE_ELEMS of work each."""
        per = max(1, SLICE_ELEMS // self.shard)
        for i in range(0, len(block_ids), per):
            yield i, list(block_ids[i:i + per])

    def fill_slices(self, job: Fill) -> Iterator[None]:
        for i, blocks in self._slices(job.block_ids):
            self.kv[blocks] = self.patterns(job.lid, job.first_index + i, len(blocks))
            yield
        if job.token:
            self._verified.append((job.token, True))

    def verify_slices(self, job: Verify) -> Iterator[None]:
        ok = True
        for i, blocks in self._slices(job.block_ids):
            ok = ok and self.torch.equal(self.kv[blocks], self.patterns(job.lid, job.first_index + i, len(blocks)))
            yield
        self._verified.append((job.token, ok))

    def on_poison(self, job: Poison) -> None:
        if job.block_ids:
            self.kv[list(job.block_ids)] = POISON

    def on_step(self, msg: Step) -> None:
        self.worker.bind(msg.meta)

    def on_stop(self, _msg: Stop) -> None:
        self.stopped = True

    # ------------------------------------------------------------ tally
    def _tally_capture(self, stimulus, out) -> None:
        # FreeBlocks is external: the stimulus's are in ``out`` (no Step is built for this observer).
        self._tally_parts(stimulus[0], stimulus[2], stimulus[3], out or ())

    def _tally(self, step) -> None:
        self._tally_parts(step.event, step.kind, step.key, step.actions)

    def _tally_parts(self, event, kind: str, key, actions) -> None:
        if isinstance(event, LeaseHeartbeat) and kind == "lease":
            lease = self.driver.plane.get("lease", event.request_id)
            if lease is not None:
                self._lease_events.append((event.request_id, "heartbeat", time.monotonic(), lease.expiry))
        if isinstance(event, HandshakeOk) and kind == "remote_engine":
            engine = self.driver.plane.get("remote_engine", key)
            if engine is not None and math.isfinite(engine.best_rtt):
                self._offsets.append((str(key), engine.clock_offset))
        for a in actions:
            if isinstance(a, FreeBlocks):
                self._ended[a.reason] += 1
                self._lease_events.append((a.request_id, a.reason, time.monotonic(), 0.0))

    # ------------------------------------------------------------ loop
    def run(self) -> None:
        self._handle = handlers(TO_RANK, {Step: self.on_step, Fill: self._start_job, Verify: self._start_job,
                                          Poison: self.on_poison, Stop: self.on_stop})
        self.conn.send(RankReady(info=self.worker.rank_info(), os_pid=os.getpid()))
        last_flush = last = time.monotonic()
        while not self.stopped:
            busy = False
            while self.conn.poll(0):
                self._queue.append(self.conn.recv())
                busy = True
            busy |= self._work_queue()
            busy |= self.worker.step() > 0
            report = self.worker.report()
            now = time.monotonic()
            # A report at least every ALIVE_EVERY_S, empty or not: silence is how the scheduler sees a hang.
            if (not report.empty or self._verified or self._lease_events or self._offsets or report.load_error_blocks
                    or now - self._last_sent > ALIVE_EVERY_S):
                self._last_sent = now
                self.conn.send(RankStep(report=report, verified=tuple(self._verified),
                                        lease_events=tuple(self._lease_events), clock_offsets=tuple(self._offsets)))
                self._verified, self._lease_events, self._offsets = [], [], []
                busy = True
            if self.driver.xfers:
                self.busy_s += now - last
            last = now
            if self.log is not None and now - last_flush > 0.1:
                self.log.flush()
                last_flush = now
            if not busy and not self.stopped:
                self._wait()
        self._finish()

    def _start_job(self, job: Fill | Verify) -> None:
        self._job = self.fill_slices(job) if isinstance(job, Fill) else self.verify_slices(job)

    def _work_queue(self) -> bool:
        """Apply queued messages in pipe order.  A fill or verify job runs
        slice by slice for up to JOB_BUDGET_S a pass, UCX progressed after
        each slice (a peer READing this rank's blocks waits on that), and not
        at all while a transfer of this rank is young."""
        did = False
        end = time.perf_counter() + JOB_BUDGET_S
        while self._queue or self._job is not None:
            if self._job is not None:
                if self._spinning():
                    return did
                done = next(self._job, StopIteration) is StopIteration
                self.ep.progress()
                did = True
                if done:
                    self._job = None
                elif time.perf_counter() > end:
                    return did  # the rest after a poll
                continue
            msg = self._queue.popleft()
            self._handle[type(msg)](msg)
            did = True
            if self.stopped:
                return did
        return did

    def _spinning(self) -> bool:
        """A transfer of this rank was posted less than SPIN_LIMIT_S ago."""
        xfers = self.driver.xfers
        if not xfers:
            return False
        newest = max(handle.posted_at for handle, _op, _engine in xfers.values())
        return time.perf_counter() - newest < SPIN_LIMIT_S

    def _serving(self) -> bool:
        """The plane holds blocks a peer may READ now (a lease or a hold)."""
        return bool(self.driver.plane.instances["lease"])

    def _wait(self) -> None:
        """Nothing moved this pass: spin, nap or sleep (see the module docstring)."""
        waits = self.waits
        if self._spinning():
            waits["spin"] += 1  # a young transfer
        elif self._job is not None or self._queue:
            waits["job"] += 1  # a job the transfer held back may run now
        elif self.driver.xfers:  # posted long ago: a slow or hung peer
            waits["nap"] += 1
            time.sleep(NAP_S)
        elif self._bare_read():
            waits["bare_read"] += 1
        elif self._serving():
            waits["serve"] += 1
            end = time.perf_counter() + IDLE_WAIT_S
            while not self.conn.poll(0) and self.ep.progress() == 0 and time.perf_counter() < end:
                time.sleep(NAP_S)
        else:
            waits["idle"] += 1
            self.conn.poll(IDLE_WAIT_S)

    def _finish(self) -> None:
        d = self.driver
        evicted = d.counters["engines_evicted"]
        closed = d.disconnect_idle_engines()
        report = self.worker.report()
        self.conn.send(RankStep(report=report, verified=tuple(self._verified), lease_events=tuple(self._lease_events)))
        ended = dict(self._ended)
        held = [[k, str(key), s, list(h)] for k, key, s, h in d.plane.held()]
        anomalies = {str(k): v for k, v in d.plane.stats.items() if isinstance(k, FailClosed)
                     or isinstance(k, Anomaly) and k.what in (UNKNOWN_ID, UNKNOWN_KIND, PROTOCOL_VIOLATION)}
        counters = dict(d.counters)
        if self.faults is not None and self.faults.dropped:
            counters["notifs_dropped_injected"] = self.faults.dropped
        lease_blocks = sum(len(lease.block_ids) for lease in d.plane.instances["lease"].values())
        transfers = tuple(self.ep.transfer_times.samples)
        if self._bare is not None:
            self._bare_done = tuple(self._bare.samples)
            self._bare.close()
        self.conn.send(RankSummary(
            rank=self.opts.rank, engine_id=self.rank_id, counters=counters, busy_s=self.busy_s,
            engines_evicted=evicted, engines_closed_at_shutdown=closed, lifecycle=self.lifecycle.to_dict(),
            anomalies=anomalies, nixl_calls=self.ep.call_times.to_dict(),
            heartbeats_received=d.counters.get("heartbeats_received", 0),
            heartbeats_sent=d.plane.stats.get("heartbeats_sent", 0), leases_ended=ended, plane_held=held,
            held_lease_blocks=lease_blocks, bytes_moved=d.counters["bytes_moved"], transfers=transfers,
            bare_reads=self._bare_done, bare_read_error=self._bare_error, cpu_s=time.process_time(), waits=dict(self.waits),
            plane_cpu_s=self.plane_cpu.seconds, plane_gc_s=self.plane_cpu.gc_seconds,
            plane_apart_s=self.plane_cpu.apart_seconds))
        self.parts.close_log()
        self.worker.shutdown()


    def _bare_read(self) -> bool:
        """D rank 0 (``measure_bare_read``): one bare NIXL READ of the size of
        a READ this rank made, when it has nothing else to do; True if one
        ran.  A failure stops the measurement, never the rank."""
        samples = self.ep.transfer_times.samples
        if self._bare is None:
            self._reads_seen = len(samples)
            return False
        self._bare_pending.extend(t.nbytes for t in samples[self._reads_seen:] if t.op == "READ")
        self._reads_seen = len(samples)
        if not self._bare_pending or len(self._bare.samples) >= BARE_MAX:
            return False
        try:
            self._bare.read(self._bare_pending.popleft())
        except Exception as exc:
            self._bare_error = f"{type(exc).__name__}: {exc}"
            self._bare_done = tuple(self._bare.samples)
            self._bare.close()
            self._bare = None
        return True


def rank_main(conn, opts: RankOptions) -> None:
    """Process entry point (multiprocessing 'spawn')."""
    try:
        RankWorker(conn, opts).run()
    except KeyboardInterrupt:
        pass
    except BaseException:
        try:
            conn.send(RankCrashed(rank=opts.rank, traceback=traceback.format_exc()))
        except Exception:
            pass
        raise SystemExit(1) from None
