"""``KVPlaneConnector``: kvplane as a vLLM KV connector.

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "KVPlaneConnector",
                           "kv_connector_module_path": "kvplane.connector.vllm",
                           "kv_role": "kv_both"}'

P and D run the same line; a proxy sends each request to P with
``kv_transfer_params: {"do_remote_decode": true}`` and ``max_tokens: 1``,
then to D with the ``kv_transfer_params`` of P's response (``kvplane
proxy`` is one).  The settings are NixlConnector's
(``kv_connector_extra_config``: see ``vllm_settings``).

The only module of kvplane that imports vLLM.  It is a thin facade: the
scheduler half is ``vllm_scheduler.VllmSchedulerSide`` (over the split
``ConnectorScheduler``), the worker half ``vllm_worker.VllmWorkerSide``
(over ``ConnectorWorker`` and a ``PlaneDriver`` per TP rank); what crosses
between vLLM's processes is the plane's own records (``records``),
wrapped in vLLM's metadata classes.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from kvplane.transport.layer_slice import LayerSlice

from . import vllm_stats
from .kv_groups import KvGroups
from .prefill_backoff import prefill_backoff
from .records import RankInfo, StepMeta, WorkerReport
from .vllm_scheduler import SchedulerStep, VllmSchedulerSide
from .vllm_settings import COMPAT_HASH, for_dp_rank, settings_from
from .vllm_worker import VllmWorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvplane.vllm")


@dataclass
class KVPlaneMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one per engine step."""

    step: SchedulerStep = field(default_factory=lambda: SchedulerStep(meta=StepMeta()))


@dataclass
class KVPlaneHandshake(KVConnectorHandshakeMetadata):
    """Worker rank -> scheduler at start-up: where the rank's side channel is."""

    info: RankInfo


@dataclass
class KVPlaneWorkerMeta(KVConnectorWorkerMetadata):
    """Worker ranks -> scheduler, each step: the ranks' reports."""

    reports: list[WorkerReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPlaneWorkerMeta)
        return KVPlaneWorkerMeta(reports=self.reports + other.reports)


@dataclass
class KVPlaneStats(KVConnectorStats):
    """Counts since the last interval plus each rank's gauges (vllm_stats)."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return KVPlaneStats(data=vllm_stats.merge(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return dict(vllm_stats.reduce(self.data))

    def is_empty(self) -> bool:
        return vllm_stats.is_empty(self.data)


class KVPlanePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvplane_<count>_total`` counters and ``vllm:kvplane_<gauge>``
    gauges, per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        self.counters = {key: per_engine(self._counter_cls(
            name=f"vllm:{_metric_name(key)}", documentation=f"kvplane connector: {key}",
            labelnames=labelnames)) for key in vllm_stats.COUNT_KEYS}
        self.gauges = {key: per_engine(self._gauge_cls(
            name=f"vllm:{_metric_name(key)}", documentation=f"kvplane connector: {key} (all ranks)",
            labelnames=labelnames, multiprocess_mode="mostrecent")) for key in vllm_stats.GAUGE_KEYS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        reduced = vllm_stats.reduce(transfer_stats_data)
        for key in vllm_stats.COUNT_KEYS:
            if reduced[key]:
                self.counters[key][engine_idx].inc(reduced[key])
        if transfer_stats_data.get("gauges"):
            for key in vllm_stats.GAUGE_KEYS:
                self.gauges[key][engine_idx].set(reduced[key])


def _metric_name(key: str) -> str:
    return key if key.startswith("kvplane_") else f"kvplane_{key}"


class KVPlaneConnector(KVConnectorBase_V1, SupportsHMA):
    # "pull": D READs P's blocks; KVPlanePushConnector's "push": P WRITEs them (vllm_push).
    TRANSFER_MODE = "pull"

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        from vllm import envs

        ktc = vllm_config.kv_transfer_config
        self.engine_id: str = ktc.engine_id
        host = envs.VLLM_NIXL_SIDE_CHANNEL_HOST
        self.settings = settings_from(ktc.kv_connector_extra_config,
                                      kv_load_failure_policy=ktc.kv_load_failure_policy,
                                      side_channel_port=envs.VLLM_NIXL_SIDE_CHANNEL_PORT,
                                      side_channel_host="127.0.0.1" if host == "localhost" else host)
        parallel = vllm_config.parallel_config
        # With DP each engine core is one connector: its own DP index (vLLM
        # suffixed the engine id with it) names its files and its ports.
        self.dp_index: int = getattr(parallel, "data_parallel_index", 0) or 0
        self.settings = for_dp_rank(self.settings, self.dp_index)
        if self.settings.insecure:
            log.warning("kvplane: kvplane_insecure: the side channel is plaintext, notifications are accepted "
                        "from any agent and kv_transfer_params are not authenticated (docs/security.md)")
        elif self.settings.keys is None:
            log.warning("kvplane: kvplane_keypair without kvplane_secret_file: kv_transfer_params are not "
                        "authenticated (docs/security.md)")
        if self.settings.unknown_keys:
            log.warning("kvplane: unknown kv_connector_extra_config keys ignored: %s",
                        ", ".join(self.settings.unknown_keys))
        if getattr(parallel, "decode_context_parallel_size", 1) != 1 or \
                getattr(parallel, "prefill_context_parallel_size", 1) != 1:
            raise ValueError("KVPlaneConnector does not support context parallelism (DCP and PCP must be 1)")
        self.tp_size: int = parallel.tensor_parallel_size
        self.pp_size: int = parallel.pipeline_parallel_size
        self.kv_groups = _kv_groups(kv_cache_config, self.tp_size, self.TRANSFER_MODE, self.settings.bidirectional)
        mla = _is_mla(kv_cache_config)  # its latent is whole on every TP rank (TpMapping.replicated)
        if self.pp_size > 1 and (self.TRANSFER_MODE != "pull" or self.settings.bidirectional or mla
                                 or self.kv_groups.count > 1):
            # P-side PP as NixlConnector (pull) moves it: each stage a slice of a one-group model's layers.
            raise ValueError("KVPlaneConnector runs pipeline parallel size > 1 on the prefill side of pull mode "
                             "only: not with push, bidirectional_kv_xfer, MLA or several KV cache groups")
        self._load_error_blocks: set[int] = set()
        self.scheduler_side: VllmSchedulerSide | None = None
        self.worker_side: VllmWorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = VllmSchedulerSide(self.engine_id, self.settings, tp_size=self.tp_size,
                                                    block_size=_block_size(vllm_config, kv_cache_config),
                                                    warn=log.warning, transfer_mode=self.TRANSFER_MODE,
                                                    groups=self.kv_groups, replicated_kv=mla, pp_size=self.pp_size,
                                                    prefill_backoff=prefill_backoff(vllm_config))
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            pp_rank = get_pp_group().rank_in_group if self.pp_size > 1 else 0
            self.worker_side = VllmWorkerSide(
                self.engine_id, self.settings, rank=pp_rank * self.tp_size + get_tensor_model_parallel_rank(),
                tp_size=self.tp_size, pp_size=self.pp_size, dp_index=self.dp_index,
                compat_hash=_compat_hash(vllm_config, kv_cache_config, self.settings.enforce_handshake_compat,
                                         tp_size=self.tp_size, pp_size=self.pp_size),
                replicated_kv=mla, layer_slice=_layer_slice(vllm_config) if self.pp_size > 1 else None)

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        assert self.worker_side is not None
        return KVPlaneHandshake(info=self.worker_side.rank_info())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self.worker_side is not None and isinstance(connector_metadata, KVPlaneMetadata)
        # Applied before the forward pass: READs start while it runs.
        self.worker_side.bind(connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # bind_connector_metadata started this step's loads

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads are asynchronous: a request runs once its recv is reported

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # nothing to save: the reader pulls from our KV cache

    def wait_for_save(self) -> None:
        pass

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker_side is not None
        sending, recving, failed, blocks = self.worker_side.results()
        self._load_error_blocks = blocks
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks: set[int] = self._load_error_blocks
        self._load_error_blocks = set()
        return blocks

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker_side is not None
        report = self.worker_side.take_report()
        return None if report is None or report.empty else KVPlaneWorkerMeta(reports=[report])

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler_side is not None:
            counts = self.scheduler_side.stats()
            # Nothing new (most steps): None, which vLLM reads as it reads an empty one.
            return KVPlaneStats(data=vllm_stats.scheduler_stats_data(counts)) if counts else None
        if self.worker_side is None:
            return None
        counts, gauges = self.worker_side.stats()
        return KVPlaneStats(data=vllm_stats.stats_data(self.worker_side.rank, counts, gauges))

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()

    # ================================================================ scheduler side
    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Every stage's ranks (vLLM keys them (pp rank, tp rank)): rank pp x TP + tp."""
        self.set_xfer_handshake_metadata({pp * self.tp_size + tp: meta for (pp, tp), meta in metadata.items()})

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self.scheduler_side is not None
        infos = {}
        for rank, meta in metadata.items():
            if not isinstance(meta, KVPlaneHandshake):
                raise ValueError(f"rank {rank}: handshake metadata {type(meta).__name__}, not kvplane's")
            infos[rank] = meta.info
        self.scheduler_side.add_ranks(infos)

    def on_new_request(self, request: Any) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(self.kv_groups.count))  # a read fills every group's blocks

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        if self.kv_groups.count > 1:
            local = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else ()
            self.scheduler_side.update_state_after_alloc_groups(request, tuple(tuple(g) for g in local),
                                                                num_external_tokens)
            return
        ids = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else [[]]
        self.scheduler_side.update_state_after_alloc(request, tuple(ids[0]) if ids else (), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        scheduled = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        scheduled += list(scheduler_output.scheduled_cached_reqs.req_ids)
        return KVPlaneMetadata(step=self.scheduler_side.build_step(scheduled))

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler_side is not None
        meta = connector_output.kv_connector_worker_meta
        reports = meta.reports if isinstance(meta, KVPlaneWorkerMeta) else []
        self.scheduler_side.update_from_workers(reports)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        if self.kv_groups.count > 1:
            return self.scheduler_side.request_finished_groups(request, tuple(tuple(g) for g in block_ids))
        return self.scheduler_side.request_finished(request, tuple(block_ids[0]) if block_ids else ())

    # ================================================================ classmethods
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPlaneStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVPlanePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # any: blocks are moved whole, in the layout both sides share


class KVPlanePushConnector(KVPlaneConnector):
    """Push mode (NixlPushConnector's flow: D registers its blocks, P WRITEs
    them; ``vllm_push``): ``"kv_connector": "KVPlanePushConnector"`` on P and D."""

    TRANSFER_MODE = "push"

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        if self.tp_size != 1:
            raise ValueError("KVPlanePushConnector runs with tensor parallel size 1 (push at TP > 1 is a known gap)")
        if self.settings.bidirectional:
            raise ValueError("KVPlanePushConnector does not support bidirectional_kv_xfer (as NixlPushConnector)")


def _kv_groups(kv_cache_config: Any, tp_size: int, mode: str, bidirectional: bool) -> KvGroups:
    """The model's KV cache groups as kvplane moves them; ValueError (one
    line) for what it does not: several groups with TP > 1, push or
    bidirectional, a group that is neither full nor sliding-window attention
    (SSM state, MLA beside other groups), groups of different block sizes or not all transferable.
    A one-group MLA model runs at any TP: its latent is on every rank whole,
    a reader rank reads one holder rank's blocks (``TpMapping.replicated``)."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return KvGroups()
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if len(kv_cache_config.kv_cache_groups) == 1:
        return KvGroups()  # full attention or MLA: whole blocks

    groups = kv_cache_config.kv_cache_groups
    what = f"a model with {len(groups)} KV cache groups"
    if tp_size != 1 or mode != "pull" or bidirectional:
        raise ValueError(f"KVPlaneConnector moves {what} in pull mode at tensor parallel size 1 without "
                         "bidirectional_kv_xfer only")
    specs = [g.kv_cache_spec for g in groups]
    for spec in specs:
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):  # not MLA, SSM, ...
            raise ValueError(f"KVPlaneConnector moves full and sliding-window attention groups; {what} has "
                             f"{type(spec).__name__}")
    sizes = {spec.block_size for spec in specs}
    if len(sizes) != 1:
        raise ValueError(f"KVPlaneConnector moves KV cache groups of one block size; {what} has {sorted(sizes)}")
    transfer = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(groups))))
    if transfer != tuple(range(len(groups))):
        raise ValueError(f"KVPlaneConnector moves every KV cache group; {what} transfers {transfer}")
    return KvGroups.from_windows([getattr(spec, "sliding_window", None) if isinstance(spec, SlidingWindowSpec)
                                  else None for spec in specs], sizes.pop())


def _block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """Tokens per KV block: the KV cache group's, else the cache config's."""
    if kv_cache_config is not None:
        size = getattr(kv_cache_config.kv_cache_groups[0].kv_cache_spec, "block_size", None)
        if size:
            return int(size)
    return int(vllm_config.cache_config.block_size)


def _is_mla(kv_cache_config: Any) -> bool:
    return kv_cache_config is not None and any(isinstance(g.kv_cache_spec, MLAAttentionSpec)
                                               for g in kv_cache_config.kv_cache_groups)


def _layer_slice(vllm_config: Any) -> LayerSlice:
    """The layers this PP stage's worker holds (vLLM's own split)."""
    model = vllm_config.model_config
    first, end = model.get_layers_start_end_indices(vllm_config.parallel_config)
    return LayerSlice(first, end - first, model.get_total_num_hidden_layers())


def _compat_hash(vllm_config: Any, kv_cache_config: Any, enforce: bool, tp_size: int = 1, pp_size: int = 1) -> str:
    """What both sides must agree on for their blocks to mean the same: with
    ``enforce_handshake_compat`` (default) the model's KV shape and dtype
    (a hybrid model's also its block size); without it only the protocol
    version.  The KV heads are the
    model's (a rank's heads times TP): P and D may shard them differently;
    MLA's one latent "head" is on every rank whole, not sharded."""
    if not enforce or kv_cache_config is None:
        return COMPAT_HASH
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    model = vllm_config.model_config
    # The block size is not hashed: blocks of unlike sizes are read slice by
    # slice (transport.block_sizes); a hybrid model's groups hash theirs.
    # The model's layers: a PP stage holds a slice of them (its reader all).
    layers = len(group.layer_names) if pp_size == 1 else model.get_total_num_hidden_layers()
    parts = [COMPAT_HASH, str(getattr(model, "architecture", "")), str(layers),
             str(int(getattr(spec, "num_kv_heads", 0) or 0) * (1 if isinstance(spec, MLAAttentionSpec) else tp_size)),
             str(getattr(spec, "head_size", "")), str(getattr(spec, "dtype", ""))]
    if isinstance(spec, MLAAttentionSpec):  # one latent (head_size wide) per token, not K and V heads
        parts.append(f"mla:{getattr(spec, 'head_size', '')}")
    for other in kv_cache_config.kv_cache_groups[1:]:  # a hybrid model: every group's kind and layers
        parts += [type(other.kv_cache_spec).__name__, str(len(other.layer_names)),
                  str(getattr(other.kv_cache_spec, "sliding_window", ""))]
    if len(kv_cache_config.kv_cache_groups) > 1:  # groups' blocks are paired whole: one block size
        parts.append(str(getattr(spec, "block_size", "")))
    return f"{COMPAT_HASH}:{hashlib.sha256(':'.join(parts).encode()).hexdigest()[:24]}"
