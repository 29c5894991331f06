"""vLLM-shaped facades for an engine that runs both halves in one process.

``KVPlaneScheduler`` has the scheduler-side methods of vLLM's
``KVConnectorBase_V1`` and ``KVPlaneWorker`` the worker-side ones.  They are
the split (``scheduler.ConnectorScheduler`` and ``worker.ConnectorWorker``)
with one rank over one ``PlaneDriver``: the scheduler half's
``engine_request`` machines keep every request's lifecycle, the metadata
``build_connector_meta`` returns is the split's ``StepMeta``, and each
``start_load_kv`` applies it to the rank and hands the rank's report back to
the scheduler half, as a serving engine's output would.  The one difference
from the split: peers see the driver's own engine id (no ``/tp0`` rank
suffix), TP 1.

Every method takes the engine's step loop as it is: no thread is added,
heartbeats ride ``start_load_kv`` (the driver fires due timers).
"""
from __future__ import annotations

import weakref
from typing import Any

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


class KVPlaneScheduler:
    def __init__(self, driver: PlaneDriver):
        self.driver = driver
        self.split = _one_rank(driver)
        self.sched = self.split.sched

    # ---- decode side (the consumer) -------------------------------------
    def on_new_request(self, request_id: str, kv_transfer_params: dict | None) -> None:
        """Register a request; heartbeats for its remote blocks start with the next step."""
        self.sched.on_new_request(request_id, kv_transfer_params)

    def get_num_new_matched_tokens(self, request_id: str, num_prompt_tokens: int,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens to load from the remote, whether the load is asynchronous)."""
        return self.sched.get_num_new_matched_tokens(request_id, num_prompt_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request_id: str, block_ids, num_external_tokens: int,
                                 awaiting: bool | None = None) -> None:
        """Blocks are allocated.  ``awaiting`` defaults to "tokens to load";
        a scheduler that also awaits a full-prefix hit passes True."""
        self.sched.update_state_after_alloc(request_id, block_ids, num_external_tokens, awaiting=awaiting)

    def build_connector_meta(self) -> StepMeta:
        return self.sched.build_connector_meta()

    def request_running(self, request_id: str) -> None:
        self.sched.request_running(request_id)

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
        return self.sched.request_finished(request_id, block_ids, expected_consumers=expected_consumers,
                                           hold_for_next_turn=hold_for_next_turn)

    def abort(self, request_id: str) -> None:
        self.sched.abort(request_id)


class KVPlaneWorker:
    def __init__(self, driver: PlaneDriver):
        self.driver = driver
        self.split = _one_rank(driver)
        self._failed: set[str] = set()

    def register_kv_caches(self, kv_cache) -> None:
        """``kv_cache``: one tensor [num_blocks, ...] or a dict of them (one per layer)."""
        self.split.worker.register_kv_caches(kv_cache)

    def start_load_kv(self, meta: StepMeta) -> None:
        """Apply the step's records, step the plane, and hand the rank's
        report to the scheduler half (a serving engine's output)."""
        worker = self.split.worker
        worker.bind(meta)
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
        sending, recving, failed = self.split.sched.get_finished()
        if self.driver.config.kv_load_failure_policy == "fail":
            self._failed |= failed
        return sending, recving | failed

    def get_failed_requests(self) -> set[str]:
        """Requests to finish with an error (policy "fail"); empty under "recompute"."""
        failed, self._failed = self._failed, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks = self.split.sched.take_load_error_blocks()
        # Under "fail" the whole request fails: no block is worth recomputing.
        return blocks if self.driver.config.kv_load_failure_policy == "recompute" else set()

    def shutdown(self) -> None:
        self.split.worker.shutdown()
