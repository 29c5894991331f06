"""vLLM's own NixlConnector plus what the side-by-side run needs of it.

The job checks NixlConnector with the same KV check as kvplane: a request
tagged ``kvplane_dump_kv`` has its blocks held at the end until the worker
has saved their KV (``connector.kv_dump``).  ``kvplane_drop_notifications``
loses that fraction of the NIXL notifications its worker receives (seeded),
the job's ``--drop-notifications`` fault, as kvplane's connector does with
``transport.faults``.  Nothing else of NixlConnector changes: its
transfers, leases and errors are its own.  Loaded by vLLM through
``kv_connector_module_path`` in the ``--connector nixl`` run only;
``DumpingNixlPushConnector`` is the same over ``NixlPushConnector`` (``--push``).
"""
from __future__ import annotations

import logging
import random
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector, NixlPushConnector

from kvplane.connector.kv_dump import DUMP_KEY, DumpKV, dump_kv, dump_path
from kvplane.connector.vllm_scheduler import FINISHED_NORMALLY

log = logging.getLogger("kvplane.vllm")


class _Dumping:
    """The dumps and the notification fault, over either NixlConnector class
    (the next class in the MRO)."""

    _vllm_config: Any
    connector_worker: Any

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._dump_dir = extra.get("kvplane_kv_dump_dir")
        self._dumps: list[DumpKV] = []
        self._layers: list[Any] = []
        self._dumped: set[str] = set()
        self._local_hit: dict[str, int] = {}
        self._recv_tags: dict[str, str] = {}
        self._recv_dumps: dict[str, DumpKV] = {}
        rate = float(extra.get("kvplane_drop_notifications", 0.0))
        if rate and self.connector_worker is not None:
            self._drop_notifications(rate, int(extra.get("kvplane_fault_seed", 0)))

    def _drop_notifications(self, rate: float, seed: int) -> None:
        wrapper = self.connector_worker.nixl_wrapper
        receive = wrapper.get_new_notifs
        rng = random.Random(seed)
        self.notifications_dropped = 0

        def lossy() -> dict:
            got = receive()
            kept = {}
            for agent, msgs in got.items():
                keep = [m for m in msgs if rng.random() >= rate]
                self.notifications_dropped += len(msgs) - len(keep)
                if keep:
                    kept[agent] = keep
            return kept

        wrapper.get_new_notifs = lossy

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._local_hit.setdefault(request.request_id, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tag = (request.kv_transfer_params or {}).get(DUMP_KEY)
        if num_external_tokens > 0 and isinstance(tag, str) and self._dump_dir:
            self._recv_tags[request.request_id] = tag
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        params_in = dict(request.kv_transfer_params or {})
        delay, params = super().request_finished_all_groups(request, block_ids)
        first = self._local_hit.pop(request.request_id, 0)
        tag = params_in.get(DUMP_KEY)
        normal = getattr(request.status, "name", "") in FINISHED_NORMALLY
        if self._dump_dir and isinstance(tag, str) and normal and block_ids and block_ids[0]:
            # P (delay: its lease holds the blocks) or D (held here until dumped).
            self._dumps.append(DumpKV(request_id=request.request_id, tag=tag, block_ids=tuple(block_ids[0]),
                                      num_tokens=request.num_prompt_tokens, holds_blocks=not delay,
                                      first_read_token=first, groups=_groups(block_ids)))
            block = int(self._vllm_config.cache_config.block_size)
            held = -(-request.num_computed_tokens // block)
            if delay and params and params.get("do_remote_decode") and held:
                # D's hold for the next turn (bidirectional): every held block, the last
                # one partly filled (NixlConnector's P reads it too; kvplane's reads whole ones).
                self._dumps.append(DumpKV(request_id=request.request_id, tag=f"{tag}.hold",
                                          block_ids=tuple(block_ids[0][:held]),
                                          num_tokens=request.num_computed_tokens, holds_blocks=False))
            return True, params
        return delay, params

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for rid, req in getattr(meta, "reqs_to_recv", {}).items():
            tag = self._recv_tags.pop(rid, None)
            if tag is not None and req.local_block_ids and req.local_block_ids[0]:
                self._dumps.append(DumpKV(request_id=rid, tag=f"{tag}.recv", block_ids=tuple(req.local_block_ids[0]),
                                          num_tokens=0, holds_blocks=False, when="recv",
                                          groups=_groups(req.local_block_ids)))
        meta.kvplane_dumps = tuple(self._dumps)
        self._dumps = []
        return meta

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        # A hybrid model's groups alias their layers pairwise: each region once, as kvplane's dump.
        self._layers = list({t.data_ptr(): t for t in kv_caches.values()}.values())

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        for dump in getattr(connector_metadata, "kvplane_dumps", ()):
            if dump.when == "recv":
                self._recv_dumps[dump.request_id] = dump
                continue
            try:
                dump_kv(self._layers, dump, dump_path(self._dump_dir, dump.tag, 0),
                        engine_id=self._vllm_config.kv_transfer_config.engine_id)
            except (OSError, ValueError, RuntimeError) as exc:
                log.warning("KV dump of %s failed: %s", dump.request_id, exc)
            if dump.holds_blocks:
                self._dumped.add(dump.request_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        for rid in results.finished_recving:
            dump = self._recv_dumps.pop(rid, None)
            if dump is not None and rid not in results.failed_recving:
                try:  # before the request runs: the blocks hold just what was read
                    dump_kv(self._layers, dump, dump_path(self._dump_dir, dump.tag, 0),
                        engine_id=self._vllm_config.kv_transfer_config.engine_id)
                except (OSError, ValueError, RuntimeError) as exc:
                    log.warning("KV dump of %s failed: %s", dump.request_id, exc)
        results.finished_sending |= self._dumped
        self._dumped = set()
        return results


def _groups(block_ids: Any) -> tuple:
    """A hybrid model's per-group lists for a group-wise dump; () with one group."""
    return tuple(tuple(g) for g in block_ids) if len(block_ids) > 1 else ()


class DumpingNixlConnector(_Dumping, NixlConnector):
    pass


class DumpingNixlPushConnector(_Dumping, NixlPushConnector):
    pass
