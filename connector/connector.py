"""vLLM-shaped facades for an engine that runs both halves in one process.

``KVPlaneScheduler`` has the scheduler-side methods of vLLM's
``KVConnectorBase_V1`` and ``KVPlaneWorker`` the worker-side ones.  They are
the split (``scheduler.ConnectorScheduler`` and ``worker.ConnectorWorker``)
with one rank over one ``PlaneDriver``: the scheduler half's
``engine_request`` machines keep every request's lifecycle, and each
``start_load_kv`` steps the rank and hands its report back to the scheduler
half, as a serving engine's output would.  Two differences from the split,
both of one process: the records a call makes reach the rank at once (an
embedder sees the lease right after ``request_finished``) except a load,
which starts with ``start_load_kv`` as in vLLM (it and every record after
it wait in the metadata, in order); and peers see the driver's own engine
id (no ``/tp0`` rank suffix), TP 1.

Every method takes the engine's step loop as it is: no thread is added,
heartbeats ride ``start_load_kv`` (the driver fires due timers).
"""
from __future__ import annotations

import weakref
from typing import Any

import attrs

from .driver import PlaneDriver
from .records import StepMeta
from .scheduler import ConnectorScheduler
from .worker import ConnectorWorker

# The one rank of each driver the facades were built over: both facades of a
# driver share it (the scheduler's records in, the rank's report back).
_SPLITS: "weakref.WeakKeyDictionary[PlaneDriver, _OneRank]" = weakref.WeakKeyDictionary()


class _OneRank:
    def __init__(self, driver: PlaneDriver):
        host = driver.side_channel_url[len("tcp://"):].rsplit(":", 1)[0]
        self.sched = ConnectorScheduler(driver.engine_id, config=driver.config, clock=driver.clock, host=host)
        self.worker = ConnectorWorker(driver, rank_names=False)
        self.sched.add_rank(self.worker.rank_info())


def _one_rank(driver: PlaneDriver) -> _OneRank:
    split = _SPLITS.get(driver)
    if split is None:
        split = _SPLITS[driver] = _OneRank(driver)
    return split


@attrs.frozen
class ConnectorMeta:
    """What build_connector_meta hands the worker: the records held back
    since a load (applied in order by start_load_kv)."""

    steps: tuple[StepMeta, ...] = ()


class KVPlaneScheduler:
    def __init__(self, driver: PlaneDriver):
        self.driver = driver
        self.split = _one_rank(driver)
        self.sched = self.split.sched
        self._held: list[StepMeta] = []  # records from a load on, for start_load_kv

    def _to_rank(self) -> None:
        """The records the call made, to the rank now (one process), unless
        a load is among them or waits already."""
        meta = self.sched.build_connector_meta()
        if meta.empty:
            return
        if self._held or meta.loads:
            self._held.append(meta)
        else:
            self.split.worker.bind(meta)

    # ---- decode side (the consumer) -------------------------------------
    def on_new_request(self, request_id: str, kv_transfer_params: dict | None) -> None:
        """Register a request; heartbeats for its remote blocks start now."""
        self.sched.on_new_request(request_id, kv_transfer_params)
        self._to_rank()

    def get_num_new_matched_tokens(self, request_id: str, num_prompt_tokens: int,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens to load from the remote, whether the load is asynchronous)."""
        return self.sched.get_num_new_matched_tokens(request_id, num_prompt_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request_id: str, block_ids, num_external_tokens: int,
                                 awaiting: bool | None = None) -> None:
        """Blocks are allocated.  ``awaiting`` defaults to "tokens to load";
        a scheduler that also awaits a full-prefix hit passes True."""
        self.sched.update_state_after_alloc(request_id, block_ids, num_external_tokens, awaiting=awaiting)
        self._to_rank()

    def build_connector_meta(self) -> ConnectorMeta:
        self._to_rank()
        meta, self._held = ConnectorMeta(tuple(self._held)), []
        return meta

    def request_running(self, request_id: str) -> None:
        self.sched.request_running(request_id)
        self._to_rank()

    # ---- both sides -------------------------------------------------------
    def request_finished(self, request_id: str, block_ids, *, expected_consumers: int = 1,
                         hold_for_next_turn: bool = False) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params for the other side).

        P serving a remote decode: the blocks go under a lease and the params
        tell D where to read.  D with ``hold_for_next_turn``: the blocks stay
        under a fixed-TTL lease and the params carry its expiry (our clock).
        A D request never allocated tells P to free now (the machine's
        notify-only row).
        """
        out = self.sched.request_finished(request_id, block_ids, expected_consumers=expected_consumers,
                                          hold_for_next_turn=hold_for_next_turn)
        self._to_rank()
        return out

    def abort(self, request_id: str) -> None:
        self.sched.abort(request_id)
        self._to_rank()


class KVPlaneWorker:
    def __init__(self, driver: PlaneDriver):
        self.driver = driver
        self.split = _one_rank(driver)
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()  # the last get_finished's (vLLM asks right after it)

    def register_kv_caches(self, kv_cache) -> None:
        """``kv_cache``: one tensor [num_blocks, ...] or a dict of them (one per layer)."""
        self.split.worker.register_kv_caches(kv_cache)

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Apply the step's records, step the plane, and hand the rank's
        report to the scheduler half (a serving engine's output)."""
        worker = self.split.worker
        for step in meta.steps:
            worker.bind(step)
        worker.step()
        freed = self.driver.freed  # the embedder's record of freed leases (a rank's report drops it)
        self.split.sched.update_from_worker(worker.report())
        self.driver.freed = freed

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving).  A failed recv is finished
        too (its blocks may be reused); what happens to its request is the
        ``kv_load_failure_policy``: "recompute" names its blocks in
        get_block_ids_with_load_errors, "fail" names the request in
        get_failed_requests."""
        report = self.split.sched.get_finished()
        failed = set(report.failed_ids)
        self._load_errors |= set(report.load_error_blocks)
        if self.driver.config.kv_load_failure_policy == "fail":
            self._failed |= failed
        return set(report.finished_sending), set(report.finished_recving) | failed

    def get_failed_requests(self) -> set[str]:
        """Requests to finish with an error (policy "fail"); empty under "recompute"."""
        failed, self._failed = self._failed, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks, self._load_errors = self._load_errors, set()
        # Under "fail" the whole request fails: no block is worth recomputing.
        return blocks if self.driver.config.kv_load_failure_policy == "recompute" else set()

    def shutdown(self) -> None:
        self.split.worker.shutdown()
