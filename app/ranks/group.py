"""The scheduler process's side of its worker ranks: spawn them, send them
the step metadata and jobs, fold their reports into the scheduler.

A rank that exits or whose pipe breaks is lost: ``ConnectorScheduler.
rank_lost`` fails every recv waiting on it and counts its leases as ended,
and nothing more is sent to it.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Callable

from kvplane.connector.scheduler import ConnectorScheduler

from .messages import RankCrashed, RankOptions, RankReady, RankStep, RankSummary, Step, Stop
from .worker import rank_main

STARTUP_TIMEOUT_S = 120.0  # NIXL agent creation, UCX, torch import on a busy machine
# A rank reports at least every 0.2 s; one silent this long hangs (SIGSTOP, a
# stuck call) and is killed and lost: its recvs fail, and nothing it may
# still write lands in blocks the scheduler hands out again.
SILENT_LIMIT_S = 5.0


class RankError(RuntimeError):
    """A rank failed to start, or crashed (its traceback is the message)."""


class RankGroup:
    def __init__(self, sched: ConnectorScheduler, make_options: Callable[[int], RankOptions], *,
                 on_verified: Callable[[int, int, bool], None] | None = None,
                 on_lease_event: Callable[[int, str, str, float, float], None] | None = None,
                 on_clock_offset: Callable[[int, str, float], None] | None = None):
        """Spawns ``sched.tp_size`` rank processes and waits for each one's RankInfo."""
        self.sched = sched
        self.tp = sched.tp_size
        self.on_verified = on_verified or (lambda rank, token, ok: None)
        self.on_lease_event = on_lease_event or (lambda rank, rid, what, t, expiry: None)
        self.on_clock_offset = on_clock_offset or (lambda rank, engine, offset: None)
        ctx = mp.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.pids: list[int] = []
        self.lost: set[int] = set()
        self.crashes: dict[int, str] = {}
        self.summaries: dict[int, RankSummary] = {}
        self.silent_limit = SILENT_LIMIT_S
        for r in range(self.tp):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(theirs, make_options(r)), name=f"{sched.engine_id}-tp{r}",
                               daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for r, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RankError(f"{sched.engine_id} rank {r} did not start in {STARTUP_TIMEOUT_S:.0f} s")
            msg = conn.recv()
            if isinstance(msg, RankCrashed):
                raise RankError(f"{sched.engine_id} rank {r} failed to start:\n{msg.traceback}")
            assert isinstance(msg, RankReady), msg
            sched.add_rank(msg.info)
            self.pids.append(msg.os_pid)
        self.last_heard = [time.monotonic()] * self.tp
        self._last_poll = time.monotonic()

    def live(self, rank: int) -> bool:
        return rank not in self.lost

    def send(self, rank: int, msg: Any) -> None:
        if rank in self.lost:
            return
        try:
            self.conns[rank].send(msg)
        except (BrokenPipeError, EOFError, OSError):
            self._lose(rank)

    def send_all(self, msg: Any) -> None:
        for r in range(self.tp):
            self.send(r, msg)

    def step(self) -> bool:
        """Send this step's metadata (if any) and fold in every report that
        arrived; True when anything moved."""
        meta = self.sched.build_connector_meta()
        busy = False
        if not meta.empty:
            self.send_all(Step(meta))
            busy = True
        return self.poll() or busy

    def poll(self) -> bool:
        busy = False
        now = time.monotonic()
        if now - self._last_poll > self.silent_limit / 2:
            # This process itself stalled (or the whole engine was stopped):
            # the ranks' silence says nothing about them.
            self.last_heard = [now] * self.tp
        self._last_poll = now
        for r, conn in enumerate(self.conns):
            if r in self.lost:
                continue
            try:
                while conn.poll(0):
                    busy = True
                    self.last_heard[r] = now
                    self._on(r, conn.recv())
            except (EOFError, OSError):
                self._lose(r)
                continue
            if not self.procs[r].is_alive() and not conn.poll(0):
                self._lose(r)
            elif now - self.last_heard[r] > self.silent_limit and r not in self.summaries:
                self.procs[r].kill()
                self._lose(r)
        return busy

    def _on(self, rank: int, msg: Any) -> None:
        if isinstance(msg, RankStep):
            self.sched.update_from_worker(msg.report)
            for token, ok in msg.verified:
                self.on_verified(rank, token, ok)
            for rid, what, t, expiry in msg.lease_events:
                self.on_lease_event(rank, rid, what, t, expiry)
            for engine, offset in msg.clock_offsets:
                self.on_clock_offset(rank, engine, offset)
        elif isinstance(msg, RankSummary):
            self.summaries[rank] = msg
        elif isinstance(msg, RankCrashed):
            self.crashes[rank] = msg.traceback
            self._lose(rank)

    def _lose(self, rank: int) -> None:
        if rank in self.summaries:  # it finished (Stop): exiting is what it should do
            self.lost.add(rank)
            return
        if rank not in self.lost:
            self.lost.add(rank)
            self.sched.rank_lost(rank)

    def stop(self, timeout: float = 30.0) -> dict[int, RankSummary]:
        """Ask every live rank for its summary and wait for it to exit."""
        self.send_all(Stop())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(r not in self.summaries for r in range(self.tp)
                                                  if r not in self.lost):
            self.poll()
            time.sleep(0.005)
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
        return self.summaries

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
