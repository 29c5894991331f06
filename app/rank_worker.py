"""One worker rank of an engine: its own process, NIXL agent, KV shard and plane.

The scheduler process spawns one per TP rank.  A rank owns a
[num_blocks, block_elems // tp] float32 tensor (its heads of every block),
registered with NIXL through its ``ConnectorWorker``, and runs a step
loop: apply what the scheduler sent (``StepMeta``, fill / verify / poison
jobs, in pipe order), step its driver, and send a ``RankStep`` whenever
something finished.  It polls without sleeping while a transfer is
posted and sleeps ~1 ms, woken by a message, when idle.

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
from collections import Counter

from kvplane.statemachines.actions import FreeBlocks
from kvplane.statemachines.events import HandshakeOk, LeaseHeartbeat
from kvplane.statemachines.stats import PROTOCOL_VIOLATION, UNKNOWN_ID, UNKNOWN_KIND, Anomaly, FailClosed

from .messages import handlers
from .rank_messages import (TO_RANK, Fill, Poison, RankCrashed, RankOptions, RankReady, RankStep, RankSummary, Step,
                            Stop, Verify)

POISON = -1.0
ALIVE_EVERY_S = 0.2
_MASK = (1 << 20) - 1  # pattern values stay exact in float32


def pattern_seed(lid: str, block_index: int) -> int:
    return zlib.crc32(f"{lid}/{block_index}".encode()) & _MASK


class RankWorker:
    def __init__(self, conn, opts: RankOptions):
        import torch

        from kvplane.connector.driver import PlaneDriver
        from kvplane.connector.ranks import rank_engine_id
        from kvplane.connector.worker import ConnectorWorker
        from kvplane.statemachines.config import PlaneConfig
        from kvplane.statemachines.eventlog import EventLogWriter
        from kvplane.transport.faults import DropNotifications
        from kvplane.transport.nixl_agent import NixlEndpoint

        self.torch = torch
        self.conn = conn
        self.opts = opts
        skew = opts.clock_skew
        clock = (lambda: time.monotonic() + skew) if skew else time.monotonic
        self.rank_id = rank_engine_id(opts.engine_id, opts.rank)
        self.ep = NixlEndpoint(self.rank_id)
        self.faults = DropNotifications(self.ep, rate=opts.drop_notifications, seed=opts.seed)
        self.driver = PlaneDriver(engine_id=self.rank_id, endpoint=self.faults if self.faults.rate else self.ep,
                                  config=PlaneConfig(**opts.plane_fields), clock=clock, tp_rank=opts.rank,
                                  curve_keypair=tuple(opts.keypair), trusted_peers=opts.peers)
        self._log_stream = None
        self.log = None
        if opts.log_path is not None:
            self._log_stream = open(opts.log_path, "w", encoding="utf-8")
            self.log = EventLogWriter.attach(self.driver.plane, self._log_stream, flush_every=1 << 30)
        self._lease_events: list[tuple[str, str, float, float]] = []
        self.busy_s = 0.0
        self._offsets: list[tuple[str, float]] = []
        self._last_sent = 0.0
        self._ended: Counter = Counter()  # leases (and holds) ended, by why
        self._chain = self.driver.plane.recorder
        self.driver.plane.recorder = self._tally
        self.worker = ConnectorWorker(self.driver, rank=opts.rank, tp_size=opts.tp_size)
        if opts.block_elems % opts.tp_size:
            raise ValueError(f"block_elems {opts.block_elems} is not divisible by TP {opts.tp_size}")
        self.shard = opts.block_elems // opts.tp_size
        lo = opts.rank * self.shard
        self.kv = torch.full((opts.num_blocks, self.shard), POISON, dtype=torch.float32)
        self.worker.register_kv_caches(self.kv)
        self._ramp = (torch.arange(lo, lo + self.shard, dtype=torch.int64) * 7)
        self._verified: list[tuple[int, bool]] = []
        self.stopped = False

    # ------------------------------------------------------------ blocks
    def pattern(self, lid: str, index: int):
        return ((self._ramp + pattern_seed(lid, index)) & _MASK).to(self.torch.float32)

    def on_fill(self, job: Fill) -> None:
        for i, b in enumerate(job.block_ids):
            self.kv[b] = self.pattern(job.lid, job.first_index + i)
        if job.token:
            self._verified.append((job.token, True))

    def on_verify(self, job: Verify) -> None:
        ok = all(self.torch.equal(self.kv[b], self.pattern(job.lid, job.first_index + i))
                 for i, b in enumerate(job.block_ids))
        self._verified.append((job.token, ok))

    def on_poison(self, job: Poison) -> None:
        if job.block_ids:
            self.kv[list(job.block_ids)] = POISON

    def on_step(self, msg: Step) -> None:
        self.worker.bind(msg.meta)

    def on_stop(self, _msg: Stop) -> None:
        self.stopped = True

    # ------------------------------------------------------------ tally
    def _tally(self, step) -> None:
        if self._chain is not None:
            self._chain(step)
        if isinstance(step.event, LeaseHeartbeat) and step.kind == "lease":
            lease = self.driver.plane.get("lease", step.event.request_id)
            if lease is not None:
                self._lease_events.append((step.event.request_id, "heartbeat", time.monotonic(), lease.expiry))
        if isinstance(step.event, HandshakeOk) and step.kind == "remote_engine":
            engine = self.driver.plane.get("remote_engine", step.key)
            if engine is not None and math.isfinite(engine.best_rtt):
                self._offsets.append((str(step.key), engine.clock_offset))
        for a in step.actions:
            if isinstance(a, FreeBlocks):
                self._ended[a.reason] += 1
                self._lease_events.append((a.request_id, a.reason, time.monotonic(), 0.0))

    # ------------------------------------------------------------ loop
    def run(self) -> None:
        handle = handlers(TO_RANK, {Step: self.on_step, Fill: self.on_fill, Verify: self.on_verify,
                                    Poison: self.on_poison, Stop: self.on_stop})
        self.conn.send(RankReady(info=self.worker.rank_info(), os_pid=os.getpid()))
        last_flush = last = time.monotonic()
        while not self.stopped:
            busy = False
            while self.conn.poll(0):
                msg = self.conn.recv()
                handle[type(msg)](msg)
                busy = True
                if self.stopped:
                    break
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
            if not busy and not self.driver.xfers:
                self.conn.poll(0.001)
        self._finish()

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
        if self.faults.dropped:
            counters["notifs_dropped_injected"] = self.faults.dropped
        lease_blocks = sum(len(lease.block_ids) for lease in d.plane.instances["lease"].values())
        self.conn.send(RankSummary(
            rank=self.opts.rank, engine_id=self.rank_id, counters=counters, busy_s=self.busy_s,
            engines_evicted=evicted, engines_closed_at_shutdown=closed,
            anomalies=anomalies, nixl_calls=self.ep.call_times.to_dict(),
            heartbeats_received=d.counters.get("heartbeats_received", 0),
            heartbeats_sent=d.plane.stats.get("heartbeats_sent", 0), leases_ended=ended, plane_held=held,
            held_lease_blocks=lease_blocks, bytes_moved=d.counters["bytes_moved"]))
        if self.log is not None:
            self.log.flush()
        self.worker.shutdown()
        if self._log_stream is not None:
            self._log_stream.close()


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
