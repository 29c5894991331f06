"""The worker half of kvplane's vLLM connector, without vLLM.

One per TP rank, in vLLM's worker process: a NIXL agent, a ``PlaneDriver``
(side channel, remote engines, leases, heartbeats, timers) and a
``ConnectorWorker`` over the rank's KV cache (vLLM's per-layer tensors,
each ``[num_blocks, ...]``, registered as regions of one layout).  A
``Ticker`` thread steps the driver between engine steps (heartbeats,
lease expiry, transfer progress during a long forward pass); every call
from vLLM takes the same lock.

Besides the plane's records, a step may ask for KV dumps (``DumpKV``):
the rank saves the tokens' KV of every layer to ``kv_dump_dir`` and reports
the request finished sending, which is when vLLM frees its blocks.  The
main job's KV check compares these files; nothing else uses them.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from kvplane.transport.block_sizes import BlockShape, cpu_rows
from kvplane.transport.layer_slice import LayerSlice

from .kv_dump import DumpKV, dump_kv, dump_path
from .rank_factory import RankSetup, build_rank
from .records import RankInfo, WorkerReport
from .ticker import Ticker
from .vllm_scheduler import SchedulerStep
from .vllm_settings import VllmSettings
from .vllm_stats import PlaneTally, snapshot

log = logging.getLogger("kvplane.vllm")
STATUS_EVERY_S = 0.5
LOG_FLUSH_EVERY_S = 0.2
# The engine polled within this: its ticker leaves the transfers' states to it.
ENGINE_POLLS_S = 0.05
# vLLM asks for stats every step; they are logged every few seconds.
STATS_EVERY_S = 0.1
# The ticker has not begun a step for this long (twice its longest sleep): it
# is not being scheduled (a busy-polling TP worker on a shared core), so the
# engine's results() does its work: the side channel, notifications, the
# status file and the log's flush.  Without it a starved ticker lost every read.
TICKER_LATE_S = 0.1


class VllmWorkerSide:
    def __init__(self, engine_id: str, settings: VllmSettings, *, rank: int = 0, tp_size: int = 1,
                 dp_index: int = 0, compat_hash: str = "kvplane-vllm-v1", replicated_kv: bool = False,
                 pp_size: int = 1, layer_slice: LayerSlice | None = None):
        """``replicated_kv``: every rank holds the whole KV (MLA's latent): a
        rank reads one remote rank's whole blocks, and its cache is not laid
        out as vLLM's CPU attention kernel writes K and V, so blocks of
        another number of tokens are never read slice by slice.
        ``pp_size`` > 1: ``rank`` is stage x TP + tp rank and the rank holds
        ``layer_slice`` of the model's layers (its handshake says so)."""
        self.layer_slice = layer_slice
        self.settings = settings
        self.replicated_kv = replicated_kv
        self.rank = rank
        self.engine_id = engine_id
        if settings.ucx_net_devices is not None:
            os.environ["UCX_NET_DEVICES"] = settings.ucx_net_devices  # read when the agent's UCX starts
        keypair = None
        deployment_keys: tuple[bytes, ...] = ()
        push_reg_mac_keys: tuple[bytes, ...] = ()
        if settings.keys is not None:
            # The deployment's keypair: every engine serves and connects with it.
            keypair = settings.keys.signing.curve_keypair
            deployment_keys = settings.keys.public_keys
            # Push mode: D signs its PUSH_REGs, P admits verified ones (push_auth).
            push_reg_mac_keys = tuple(k.mac_key for k in settings.keys.accepted)
        elif settings.keypair_path is not None:
            import zmq.auth

            public, secret = zmq.auth.load_certificate(settings.keypair_path)
            if secret is None:
                raise ValueError(f"kvplane_keypair {settings.keypair_path}: no secret key in it")
            keypair = (public, secret)
        else:
            log.warning("kvplane: kvplane_insecure: the side channel is plaintext and notifications are "
                        "accepted from any agent (as with NixlConnector)")
        port = settings.side_channel_port + dp_index * tp_size * pp_size + rank
        self.tally = PlaneTally()
        self.parts = build_rank(
            RankSetup(engine_id=engine_id, rank=rank, tp_size=tp_size, pp_size=pp_size,
                      drop_notifications=settings.drop_notifications,
                      fault_seed=settings.fault_seed + rank, log_path=settings.rank_path(settings.event_log, rank),
                      nixl_backends=settings.nixl_backends, nixl_num_threads=settings.nixl_num_threads,
                      replicated_kv=replicated_kv),
            observers=(self.tally,), config=settings.plane, compat_hash=compat_hash, host=settings.bind_host,
            port=port, curve_keypair=keypair, trusted_peers=dict(settings.trusted_peers) or None,
            insecure=settings.insecure, deployment_keys=deployment_keys,
            push_reg_mac_keys=push_reg_mac_keys)
        self.endpoint, self.faults = self.parts.endpoint, self.parts.faults
        self.driver, self.worker, self.log_writer = self.parts.driver, self.parts.worker, self.parts.log_writer
        self._log_flushed_at = 0.0
        self.lock = threading.RLock()
        # No short sleep while lending: vLLM keeps stepping an engine whose
        # finished requests await their blocks' free (has_finished_requests),
        # and results() progresses NIXL while this rank lends.  A 5 ms ticker
        # on each lending rank (h31) made 20-23k ticks a run and every TP read
        # was lost (tests/test_vllm_parity.py, 12:28-13:05 UTC).
        self.ticker = Ticker(self.driver, lock=self.lock, max_idle_wait=0.05, after_step=self._housekeeping,
                             step=self._ticker_step)
        self._results_at = float("-inf")  # when the engine last polled (results)
        self._kv: list[Any] = []
        self._dumped: set[str] = set()
        self._recv_dumps: dict[str, DumpKV] = {}
        self._last_counts: dict[str, int] = {}
        self._last_gauges: dict[str, int] = {}
        self._stats_at = float("-inf")
        self._status_path = settings.rank_path(settings.status_file, rank)
        self._status_at = 0.0
        self.report: WorkerReport | None = None
        self.closed = False

    # ------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        tensors = list(kv_caches.values())
        if not tensors:
            raise ValueError("no KV cache tensors to register")
        first = tensors[0]
        for name, t in kv_caches.items():
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype or not t.is_contiguous():
                raise ValueError(f"KV cache layer {name}: {tuple(t.shape)} {t.dtype} (contiguous: "
                                 f"{t.is_contiguous()}); kvplane needs every layer contiguous and shaped alike "
                                 f"({tuple(first.shape)} {first.dtype})")
        # vLLM's CPU layout (LBHNC) is [num_blocks, kv_heads, block_size, K and V of
        # a head]: a block is head-major as a whole, so a TP head shard is one
        # contiguous slice of it (one row).  MLA's is [num_blocks, 1, block_size, latent]
        # (one "head": the latent, whole on every TP rank: a D rank reads one P rank, TpMapping.replicated).
        # A hybrid model's KV cache groups overlay their layers on one allocation
        # (a block id names the same bytes in each group): each region once.
        regions = {t.data_ptr(): name for name, t in kv_caches.items()}
        distinct = {name: kv_caches[name] for name in dict.fromkeys(regions.values())}
        if self.layer_slice is not None and len(distinct) != self.layer_slice.count:
            raise ValueError(f"this pipeline stage holds layers {self.layer_slice.first}.."
                             f"{self.layer_slice.first + self.layer_slice.count - 1} but registers "
                             f"{len(distinct)} KV cache tensors")
        with self.lock:
            self.worker.register_kv_caches(distinct)
            self.driver.layer_slice = self.layer_slice
            if not self.replicated_kv and first.dim() == 4 and first.device.type == "cpu":
                # [blocks, kv heads, block tokens, 2 x head size]: a peer's blocks may hold
                # another number of tokens (transport.block_sizes; rows in bytes).  Only
                # vLLM's CPU attention kernel's layout is known: any other (MLA's latent,
                # a GPU's) keeps block_shape None and unlike blocks are never paired.
                self.driver.block_shape = BlockShape(first.shape[2], tuple(
                    w * first.element_size() for w in cpu_rows(first.shape[1], first.shape[3] // 2)))
        self._kv = list(distinct.values())
        self.ticker.start()

    def rank_info(self) -> RankInfo:
        return self.worker.rank_info()

    # ------------------------------------------------------------ per step
    def bind(self, step: SchedulerStep) -> None:
        """Apply the step's records: new requests, loads (their READs are
        posted here, before the forward pass), finishes, grants.  No poll:
        ``results`` polls what the engine waits for, the ticker the rest."""
        if step.meta.empty and not step.dumps:
            return  # most steps of a busy engine: nothing for the connector
        with self.lock:
            self.worker.bind(step.meta)
            for dump in step.dumps:
                if dump.when == "recv":
                    self._recv_dumps[dump.request_id] = dump  # taken when the recv is done
                else:
                    self._dump(dump)
            deadline = self.driver.plane.next_deadline()
        # The ticker is woken only for a deadline armed here before its own
        # wake-up: a woken ticker takes the GIL from this thread for its
        # step.  The READs posted here and the leases granted here are
        # progressed by ``results`` (every engine step) and the ticker's
        # steps (at most max_idle_wait apart).
        self.ticker.wake_for(deadline)

    def results(self) -> tuple[set[str], set[str], set[str], set[int]]:
        """(finished_sending, finished_recving, failed_recving, load-error
        blocks) since the last call; a failed recv is also finished (vLLM
        releases the request on finished_recving).

        Polls what finishes a recv or a lease (handshake results, transfer
        states, due timers; notifications while this rank receives or
        lends) so either is reported in this step, as NixlConnector's
        get_finished does.  The ticker does the rest: the side channel,
        the status file and the event log's flush (``_housekeeping``), and
        everything while the engine makes no step; while the ticker has not
        stepped for TICKER_LATE_S (its thread is not being scheduled), this
        call does all of it."""
        with self.lock:
            now = self._results_at = time.monotonic()
            ticker_late = now - self.ticker.stepped_at > TICKER_LATE_S
            # NIXL's notification call progresses UCX (tens of µs): made here
            # while this rank receives (its READs complete sooner with it; a
            # push's completion is a notification) or lends (a reader's READ
            # is served by this agent's progress: left to the ticker thread
            # alone, a lending P stalled its engine 36 s and every TP read
            # failed, tests/test_vllm_parity.py at 12:35 UTC), and when the
            # ticker is late; an idle rank's progress is the ticker's.
            receiving = bool(self.driver.xfers) or bool(self.driver.plane.instances.get("decode_request"))
            lending = bool(self.driver.plane.instances.get("lease"))
            self.driver.step(side_channel=ticker_late, notifications=receiving or lending or ticker_late)
            report = self.worker.report()
            for rid in report.finished_recving | report.failed_recving:
                dump = self._recv_dumps.pop(rid, None)
                if dump is not None and rid in report.finished_recving:
                    self._dump(dump)  # before the request runs: the blocks hold just what was read
            if self._dumped:
                report = WorkerReport(rank=report.rank, finished_sending=report.finished_sending | self._dumped,
                                      finished_recving=report.finished_recving,
                                      failed_recving=report.failed_recving,
                                      load_error_blocks=report.load_error_blocks, fail_reasons=report.fail_reasons)
                self._dumped = set()
            self.report = report
        if ticker_late:
            self._housekeeping()  # each at its own pace, as the ticker would
        return (set(report.finished_sending), set(report.finished_recving | report.failed_recving),
                set(report.failed_recving), set(report.load_error_blocks))

    def _ticker_step(self) -> int:
        """The ticker's step: everything, but our transfers' states while
        the engine is stepping (its ``results`` polls them each step; with
        hundreds in flight a tick would hold the lock for milliseconds)."""
        engine_polls = time.monotonic() - self._results_at < ENGINE_POLLS_S
        return self.driver.step(transfers=not engine_polls)

    def _housekeeping(self) -> None:
        """The ticker's, after each of its steps: the event log's flush and
        the status file, each at its own pace."""
        now = time.monotonic()
        if self.log_writer is not None and now - self._log_flushed_at >= LOG_FLUSH_EVERY_S:
            # vLLM may kill a worker at shutdown: what is flushed survives.
            with self.lock:
                if self.closed:
                    return
                self._log_flushed_at = now
                self.log_writer.flush()
        if self._status_path is not None and now - self._status_at >= STATUS_EVERY_S:
            self._write_status()

    def take_report(self) -> WorkerReport | None:
        report, self.report = self.report, None
        return report

    def stats(self) -> tuple[dict[str, int], dict[str, int]]:
        """(counts since the last snapshot, gauges then).  vLLM asks every
        step; a snapshot is taken at most every STATS_EVERY_S (counts in
        between come with the next one, none is lost)."""
        now = time.monotonic()
        if now - self._stats_at < STATS_EVERY_S:
            return {}, self._last_gauges
        self._stats_at = now
        with self.lock:
            counts, gauges = snapshot(self.driver, self.tally)
        delta = {k: v - self._last_counts.get(k, 0) for k, v in counts.items()}
        self._last_counts, self._last_gauges = counts, gauges
        return {k: v for k, v in delta.items() if v}, gauges

    # ------------------------------------------------------------ dumps
    def _dump(self, dump: DumpKV) -> None:
        directory = self.settings.kv_dump_dir
        try:
            if directory is None:
                raise ValueError("no kvplane_kv_dump_dir")
            dump_kv(self._kv, dump, dump_path(directory, dump.tag, self.rank), engine_id=self.engine_id)
        except (OSError, ValueError, RuntimeError) as exc:  # a dump is a check's input, never the plane's
            log.warning("kvplane: KV dump of %s failed: %s", dump.request_id, exc)
        if dump.holds_blocks:
            self._dumped.add(dump.request_id)

    # ------------------------------------------------------------ status
    def _write_status(self, force: bool = False) -> None:
        """Every STATUS_EVERY_S (the ticker), and at shutdown (``force``)."""
        if self._status_path is None:
            return
        with self.lock:
            if self.closed and not force:
                return
            counts, gauges = snapshot(self.driver, self.tally)
            self._status_at = time.monotonic()
            status = {"engine_id": self.engine_id, "rank": self.rank, "pid": os.getpid(), "time": time.time(),
                      "counts": counts, "gauges": gauges, "closed": self.closed,
                      # longest_late_ms / longest_step_ms: the longest this rank's plane went
                      # unstepped past a deadline, or inside a step (a starved process: its
                      # heartbeats were that late too).
                      "ticker": self.ticker.stats(),
                      "plane_held": [[k, str(key), s, list(h)] for k, key, s, h in self.driver.plane.held()]}
        # The file outside the lock: the engine's calls do not wait for the disk.
        tmp = f"{self._status_path}.{threading.get_ident()}.tmp"  # the ticker's and shutdown's never mix
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(status, f)
        os.replace(tmp, self._status_path)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.ticker.stop(timeout=2.0)
        with self.lock:
            self.closed = True
            # Graceful: engines no request uses are closed, so the plane (and
            # its event log) ends holding nothing.
            self.driver.disconnect_idle_engines("shutdown")
            self.driver.step()
            # The log first: vLLM may kill a worker soon after asking it to stop.
            self.parts.close_log()
            try:
                self._write_status(force=True)
            except OSError as exc:
                log.warning("kvplane: status file: %s", exc)
            self.worker.shutdown()
