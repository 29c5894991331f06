"""vLLM-shaped facades over one PlaneDriver.

``KVPlaneScheduler`` has the scheduler-side methods of vLLM's
``KVConnectorBase_V1`` and ``KVPlaneWorker`` the worker-side ones.  In vLLM
they live in different processes and talk through the connector metadata;
here both wrap the same driver (one engine process, TP=1), and the metadata
still carries what the worker must start, so the shapes line up.

Every method takes the engine's step loop as it is: no thread is added,
heartbeats ride ``start_load_kv`` / ``step`` (the driver fires due timers).
"""
from __future__ import annotations

from typing import Any

import attrs

from kvplane.statemachines import events as E
from kvplane.statemachines.machines.decode_request import DecodeState

from .driver import PlaneDriver
from .params import RemoteKV


@attrs.frozen
class ConnectorMeta:
    """What build_connector_meta hands the workers for one step."""

    load: tuple[str, ...] = ()


class KVPlaneScheduler:
    def __init__(self, driver: PlaneDriver):
        self.driver = driver
        self._remote: dict[str, RemoteKV] = {}  # requests whose KV comes from a remote engine
        self._serve_remote: set[str] = set()  # requests whose KV a remote engine will read
        self._push: set[str] = set()  # served requests a decoder will have us WRITE (push mode)
        self._to_load: list[str] = []

    # ---- decode side (the consumer) -------------------------------------
    def on_new_request(self, request_id: str, kv_transfer_params: dict | None) -> None:
        """Register a request; heartbeats for its remote blocks start now."""
        params = kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._serve_remote.add(request_id)
            if params.get("push"):
                self._push.add(request_id)
        if not params.get("do_remote_prefill"):
            return
        rk = RemoteKV.from_dict(params)
        self._remote[request_id] = rk
        self.driver.learn_engine(rk.remote_engine_id, rk.side_channel)
        self.driver.feed(E.NewRequest(
            request_id=request_id, engine_id=rk.remote_engine_id, remote_request_id=rk.remote_request_id,
            remote_block_ids=rk.remote_block_ids, remote_ranks=rk.remote_ranks,
            expected_consumers=rk.expected_consumers, remote_expiry=rk.remote_expiry,
            remote_renewable=rk.remote_renewable,
            push=bool(params.get("push")),
            remote_incarnation=rk.incarnation_of(rk.remote_ranks[0]) if len(rk.remote_ranks) == 1 else None,
        ))

    def get_num_new_matched_tokens(self, request_id: str, num_prompt_tokens: int,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens to load from the remote, whether the load is asynchronous)."""
        if request_id not in self._remote:
            return 0, False
        n = max(0, num_prompt_tokens - num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, request_id: str, block_ids, num_external_tokens: int,
                                 awaiting: bool | None = None) -> None:
        """Blocks are allocated.  ``awaiting`` defaults to "tokens to load";
        a scheduler that also awaits a full-prefix hit passes True."""
        if request_id not in self._remote:
            return
        awaiting = num_external_tokens > 0 if awaiting is None else awaiting
        self.driver.feed(E.BlocksAllocated(
            request_id=request_id, block_ids=block_ids, num_remote_tokens=num_external_tokens,
            awaiting=awaiting,
        ))
        self._to_load.append(request_id)

    def build_connector_meta(self) -> ConnectorMeta:
        meta, self._to_load = ConnectorMeta(tuple(self._to_load)), []
        return meta

    def request_running(self, request_id: str) -> None:
        # A notify-only request runs without waiting (its table ignores this);
        # once its notify is done it has no machine left to tell.
        if request_id in self._remote and self._decoding(request_id):
            self.driver.feed(E.RequestRunning(request_id=request_id))

    # ---- both sides -------------------------------------------------------
    def request_finished(self, request_id: str, block_ids, *, expected_consumers: int = 1,
                         hold_for_next_turn: bool = False) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params for the other side).

        P serving a remote decode: the blocks go under a lease and the params
        tell D where to read.  D with ``hold_for_next_turn``: the blocks stay
        under a fixed-TTL lease and the params carry its expiry (our clock).
        """
        block_ids = tuple(block_ids)
        if self._never_allocated(request_id):
            self._release_unallocated(request_id)
            return False, None
        rk = self._remote.pop(request_id, None)
        if rk is not None:
            if self._decoding(request_id):
                self.driver.feed(E.RequestFinished(request_id=request_id, block_ids=block_ids,
                                                   hold_for_next_turn=hold_for_next_turn))
            # The table decides whether the blocks are held (a notify-only
            # request's are not): delay the free only while a lease holds them.
            if hold_for_next_turn and self.driver.plane.get("lease", request_id) is not None:
                return True, self._params(request_id, block_ids, 1, self._lease_expiry(request_id))
            return False, None
        if request_id in self._serve_remote:
            self._serve_remote.discard(request_id)
            self.driver.feed(E.LeaseGranted(request_id=request_id, block_ids=block_ids,
                                            expected_consumers=expected_consumers))
            if request_id in self._push:
                # Push mode: the WRITE may start once the decoder's PUSH_REG
                # is here too (either order; the push_write machine waits).
                self._push.discard(request_id)
                self.driver.feed(E.PushReady(request_id=request_id, block_ids=block_ids))
            # The lease's expiry (our clock) lets a consumer that stalled see
            # that it may be gone; heartbeats make it renewable.
            return True, self._params(request_id, block_ids, expected_consumers, self._lease_expiry(request_id),
                                      renewable=True)
        return False, None

    def abort(self, request_id: str) -> None:
        self._push.discard(request_id)
        if self._never_allocated(request_id):
            self._release_unallocated(request_id)
        elif self._remote.pop(request_id, None) is not None:
            self.driver.feed(E.Abort(request_id=request_id))
        elif self.driver.plane.get("lease", request_id) is not None:
            self.driver.feed(E.LeaseAbort(request_id=request_id))

    def _never_allocated(self, request_id: str) -> bool:
        """A request with remote KV that never had blocks allocated (its
        machine still heartbeats, before any load)."""
        machine = self.driver.plane.get("decode_request", request_id)
        return request_id in self._remote and machine is not None and machine.state == DecodeState.HEARTBEATING

    def _release_unallocated(self, request_id: str) -> None:
        """Finished or aborted before its blocks were allocated: nothing is
        awaited and nothing was read, so the request becomes an empty,
        notify-only recv (as vLLM's scheduler half does): the next
        ``start_load_kv`` tells the remote it may free its blocks now,
        instead of holding them until its lease runs out."""
        self.update_state_after_alloc(request_id, (), 0, awaiting=False)
        self._remote.pop(request_id, None)

    def _decoding(self, request_id: str) -> bool:
        """Whether the request's decode machine is still live (a notify-only
        one ends on its own, possibly before the scheduler finishes it)."""
        return self.driver.plane.get("decode_request", request_id) is not None

    def _lease_expiry(self, request_id: str) -> float | None:
        lease = self.driver.plane.get("lease", request_id)
        return None if lease is None else lease.expiry

    def _params(self, request_id, block_ids, consumers, expiry, renewable=False) -> dict[str, Any]:
        host, port = self.driver.side_channel_url[len("tcp://"):].rsplit(":", 1)
        return {
            "do_remote_prefill": True,
            # The lease's unguessable name: only who is handed these params can act on it.
            **RemoteKV(remote_engine_id=self.driver.engine_id, remote_host=host, remote_port=int(port),
                       remote_request_id=self.driver.export_lease(request_id), remote_block_ids=block_ids,
                       expected_consumers=consumers, remote_expiry=expiry,
                       remote_renewable=renewable, remote_rank_incarnations=(self.driver.incarnation,)).to_dict(),
        }


class KVPlaneWorker:
    def __init__(self, driver: PlaneDriver):
        self.driver = driver
        self._failed: set[str] = set()

    def register_kv_caches(self, kv_cache) -> None:
        """``kv_cache``: one tensor [num_blocks, ...] or a dict of them (one per layer)."""
        tensors = kv_cache.values() if isinstance(kv_cache, dict) else [kv_cache]
        for t in tensors:
            self.driver.endpoint.register_kv_cache(t, t[0].numel() * t.element_size())

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for request_id in meta.load:
            self.driver.feed(E.StartLoad(request_id=request_id))
        self.driver.step()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving).  A failed recv is finished
        too (its blocks may be reused); what happens to its request is the
        ``kv_load_failure_policy``: "recompute" names its blocks in
        get_block_ids_with_load_errors, "fail" names the request in
        get_failed_requests."""
        d = self.driver
        sending, d.finished_sending = d.finished_sending, set()
        recving = d.finished_recving | d.failed_recving
        if d.config.kv_load_failure_policy == "fail":
            self._failed |= d.failed_recving
        d.finished_recving, d.failed_recving = set(), set()
        return sending, recving

    def get_failed_requests(self) -> set[str]:
        """Requests to finish with an error (policy "fail"); empty under "recompute"."""
        failed, self._failed = self._failed, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        d = self.driver
        blocks, d.load_error_blocks = d.load_error_blocks, set()
        # Under "fail" the whole request fails: no block is worth recomputing.
        return blocks if d.config.kv_load_failure_policy == "recompute" else set()

    def shutdown(self) -> None:
        self.driver.close()
        self.driver.endpoint.close()
