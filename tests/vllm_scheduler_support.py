"""An engine as vLLM's EngineCore runs it, minus the model: vLLM's real
``Scheduler`` with the ``KVPlaneConnector`` (scheduler role, loaded by
``kv_connector_module_path`` like in a serving engine), and in place of each
worker process a kvplane ``ConnectorWorker`` rank over the loopback
transport.  Each ``step()`` is one engine step: ``schedule()``, the
connector metadata to every rank (pickled, as between processes), every
rank's results wrapped in a ``KVConnectorOutput`` the way kvplane's worker
half hands them to vLLM, aggregated over the ranks by vLLM's own
``KVOutputAggregator``, and a ``ModelRunnerOutput`` with one sampled token
per scheduled request back into ``update_from_output``.  A test may edit
what a rank hands vLLM (drop, repeat, add) to inject faults.

The model is a local tiny config (``app.vllm.model``; ``--model mtp``'s
with its multi-module MTP speculative config): nothing is downloaded, no
weights are loaded.
"""
from __future__ import annotations

import copy
import functools
import pickle
import tempfile
from typing import Any, Callable

import torch
import zmq

from kvplane.connector.driver import PlaneDriver
from kvplane.connector.ranks import rank_engine_id
from kvplane.connector.records import StepMeta, WorkerReport
from kvplane.connector.worker import ConnectorWorker
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         SpeculativeConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvplane.connector.vllm import KVPlaneConnector, KVPlaneHandshake, KVPlaneMetadata, KVPlaneWorkerMeta

from kvplane.statemachines.eventlog import MemoryLog
from split_support import shutdown_all

BLOCK_SIZE = 16
NUM_BLOCKS = 64
KV_ELEMS = 8  # floats per block on each rank (the loopback transport moves them)
TOKEN = 7  # what the stand-in model samples (never EOS: requests end on max_tokens)
# Short leases (tests wait for them to run out); a handshake (real ZMQ, on its
# own thread) may take many steps of the hand-driven clock on a busy machine.
PLANE = dict(kv_lease_duration=6.0, transfer_timeout=2.0, recv_timeout=60.0, handshake_timeout=30.0)


@functools.cache
def secret_file() -> str:
    """One deployment secret for every engine these tests build: P signs its
    params with it and D verifies them, as in a real deployment."""
    from tests.vllm_support import deployment_secret

    return deployment_secret(tempfile.mkdtemp(prefix="kvplane-secret-"))


@functools.cache
def model_config(model: str = "tiny") -> ModelConfig:
    from kvplane.app.vllm.model import write_tiny_model

    folder = write_tiny_model(tempfile.mkdtemp(prefix=f"kvplane-{model}-"), model)
    return ModelConfig(model=str(folder), dtype="bfloat16", seed=0, max_model_len=4096)


def speculative(model: str) -> SpeculativeConfig | None:
    """``model``'s speculative decoding as the job's engines run it (``--model mtp``: multi-module MTP)."""
    from kvplane.app.vllm.model import speculative_config

    spec = speculative_config(model)
    if spec is None:
        return None
    return SpeculativeConfig(**spec, target_model_config=model_config(model), target_parallel_config=ParallelConfig())


def vllm_config(engine_id: str, *, tp: int = 1, policy: str = "fail", extra: dict | None = None,
                max_num_seqs: int = 16, max_num_batched_tokens: int = 1024, model: str = "tiny") -> VllmConfig:
    config = VllmConfig(
        model_config=model_config(model),
        speculative_config=speculative(model),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=4096,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPlaneConnector", kv_connector_module_path="kvplane.connector.vllm", kv_role="kv_both",
            engine_id=engine_id, kv_load_failure_policy=policy,
            kv_connector_extra_config={**PLANE, "kvplane_secret_file": secret_file(), **(extra or {})}),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config


def new_request(request_id: str, *, num_tokens: int = 40, max_tokens: int = 3, params: dict | None = None,
                first_token: int = 100, prompt: list[int] | None = None) -> Request:
    """A request of ``num_tokens`` prompt tokens (distinct per ``first_token``:
    no prefix hit unless a test wants one), or of exactly ``prompt``."""
    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens = list(range(first_token, first_token + num_tokens)) if prompt is None else list(prompt)
    request = Request(request_id=request_id, prompt_token_ids=tokens,
                      sampling_params=sampling, pooling_params=None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    request.kv_transfer_params = copy.deepcopy(params)
    return request


def rank_output(report: WorkerReport) -> KVConnectorOutput:
    """What kvplane's worker half (``KVPlaneConnector.get_transfer_results``,
    ``get_block_ids_with_load_errors``, ``build_connector_worker_meta``)
    hands vLLM for one rank's report: a failed recv is finished too."""
    return KVConnectorOutput(
        finished_sending=set(report.finished_sending) or None,
        finished_recving=set(report.finished_recving | report.failed_recving) or None,
        failed_recving=set(report.failed_recving),
        invalid_block_ids=set(report.load_error_blocks),
        kv_connector_worker_meta=None if report.empty else KVPlaneWorkerMeta(reports=[report]))


Edit = Callable[[int, KVConnectorOutput], KVConnectorOutput | None]


class Engine:
    """One vLLM engine: the real scheduler and ``tp`` loopback worker ranks."""

    def __init__(self, fabric: LoopbackFabric, name: str, clock: Callable[[], float], *, tp: int = 1,
                 policy: str = "fail", keypair: tuple[bytes, bytes], peers: dict[str, bytes],
                 max_num_seqs: int = 16, extra: dict | None = None, num_blocks: int = NUM_BLOCKS,
                 max_num_batched_tokens: int = 1024, model: str = "tiny"):
        self.name, self.tp, self.clock = name, tp, clock
        self.config = vllm_config(name, tp=tp, policy=policy, extra=extra, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens, model=model)
        self.config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
        self.sched = Scheduler(vllm_config=self.config,
                               kv_cache_config=KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                                             kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]),
                               structured_output_manager=StructuredOutputManager(self.config),
                               block_size=BLOCK_SIZE, log_stats=True)
        connector = self.sched.connector
        assert isinstance(connector, KVPlaneConnector) and connector.scheduler_side is not None
        self.connector = connector
        self.side = connector.scheduler_side
        self.side.sched.clock = clock  # the lease expiry it states, in the ranks' clock
        # The scheduler half's event log (the engine's calls as its machine took them).
        # (in memory unless the engine writes it: kvplane_event_log).
        self.log: MemoryLog | None = None
        if self.side.log_writer is None:
            self.log = MemoryLog(config=connector.settings.plane)
            self.side.sched.plane.recorder = self.log
        self.workers: list[ConnectorWorker] = []
        self.kv: list[torch.Tensor] = []
        for r in range(tp):
            rank_id = rank_engine_id(name, r)
            # The ranks serve and connect with the deployment's keypair, as vllm_worker's do.
            keys = connector.settings.keys
            driver = PlaneDriver(engine_id=rank_id, endpoint=LoopbackEndpoint(fabric, rank_id),
                                 config=connector.settings.plane, clock=clock, tp_rank=r,
                                 curve_keypair=keys.signing.curve_keypair if keys else keypair,
                                 trusted_peers=None if keys else peers,
                                 deployment_keys=keys.public_keys if keys else ())
            worker = ConnectorWorker(driver, rank=r, tp_size=tp)
            kv = torch.zeros(NUM_BLOCKS, KV_ELEMS)
            worker.register_kv_caches(kv)
            self.workers.append(worker)
            self.kv.append(kv)
        connector.set_xfer_handshake_metadata(
            {r: through_the_wire(KVPlaneHandshake(info=w.rank_info())) for r, w in enumerate(self.workers)})
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.metas: list[StepMeta] = []  # every step's records, scheduler -> ranks
        self.scheduled: list[dict[str, int]] = []  # every step's tokens scheduled per request
        self.outputs: list[Any] = []  # every EngineCoreOutput
        self.edit: Edit | None = None  # rank, what it hands vLLM -> what vLLM gets (None: no output)
        self.silent: set[int] = set()  # ranks whose transfers are not polled (their process stalls)
        # What vLLM was told, aggregated over the ranks, in order.
        self.seen_recving: list[str] = []
        self.seen_failed: list[str] = []
        self.seen_sending: list[str] = []
        self.reasons: dict[str, str] = {}  # the scheduler half's reason for each failed recv

    # ------------------------------------------------------------ requests
    def add(self, request: Request) -> Request:
        self.sched.add_request(request)
        return request

    def abort(self, request_id: str) -> None:
        self.sched.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------ steps
    def step(self) -> None:
        out = self.sched.schedule()
        meta = through_the_wire(out.kv_connector_metadata)
        assert isinstance(meta, KVPlaneMetadata)
        self.metas.append(meta.step.meta)
        self.scheduled.append(dict(out.num_scheduled_tokens))
        scheduled = list(out.num_scheduled_tokens)
        per_rank: list[ModelRunnerOutput | None] = []
        for r, w in enumerate(self.workers):
            w.bind(meta.step.meta)
            if r not in self.silent:
                w.step()
            kv_out: KVConnectorOutput | None = rank_output(through_the_wire(w.report()))
            if self.edit is not None:
                kv_out = self.edit(r, kv_out)
            per_rank.append(ModelRunnerOutput(
                req_ids=scheduled, req_id_to_index={rid: i for i, rid in enumerate(scheduled)},
                sampled_token_ids=[self._sampled(rid) for rid in scheduled], kv_connector_output=kv_out))
        merged = self.aggregator.aggregate(per_rank)
        assert merged is not None
        seen = merged.kv_connector_output
        if seen is not None:
            self.seen_recving += sorted(seen.finished_recving or ())
            self.seen_failed += sorted(seen.failed_recving or ())
            self.seen_sending += sorted(seen.finished_sending or ())
        for outputs in self.sched.update_from_output(out, merged).values():
            self.outputs.extend(outputs.outputs)
        self.reasons.update((f.request_id, f.reason) for f in self.side.last_report.failed_recving)

    def _sampled(self, request_id: str) -> list[int]:
        request = self.sched.requests.get(request_id)
        if request is None:
            return []
        # A step that ends the prompt samples one token; a middle chunk none.
        # schedule() already counted this step's tokens in num_computed_tokens
        # (_update_after_schedule), so a middle chunk is one still short of
        # num_tokens: vLLM's own is_prefill_chunk, and the model runner's
        # discard_request_mask (its seq_len < num_tokens).
        return [] if request.is_prefill_chunk else [TOKEN]

    # ------------------------------------------------------------ what it shows
    def status(self, request_id: str) -> RequestStatus | None:
        request = self.sched.requests.get(request_id)
        return None if request is None else request.status

    def blocks_of(self, request_id: str) -> tuple[int, ...]:
        (ids,) = self.sched.kv_cache_manager.get_block_ids(request_id)
        return tuple(ids)

    def finished(self, request_id: str) -> list[Any]:
        return [o for o in self.outputs if o.request_id == request_id and o.finish_reason is not None]

    def records(self, field: str) -> list[Any]:
        """Every record of one ``StepMeta`` field, in the order sent."""
        return [r for meta in self.metas for r in getattr(meta, field)]

    def held(self) -> list:
        """What the ranks' planes still hold (engine connections aside)."""
        return [h for w in self.workers for h in w.driver.plane.held() if h[0] not in ("remote_engine", "heartbeat")]

    def empty(self) -> bool:
        """Nothing left in vLLM's scheduler: no request, every block free."""
        s = self.sched
        pool = s.kv_cache_manager.block_pool
        return (not s.requests and not s.waiting and not s.kv_holding_waiting and not s.running
                and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1)

    def told_once(self) -> bool:
        """vLLM was told of each request's recv and of its send at most once."""
        return all(len(seen) == len(set(seen)) for seen in (self.seen_recving, self.seen_failed, self.seen_sending))

    def close(self) -> None:
        shutdown_all(self.workers)


def through_the_wire(record: Any) -> Any:
    """What the other process gets: a copy, sharing nothing."""
    return pickle.loads(pickle.dumps(record))


def engine_pair(clock, *, p_tp: int = 1, d_tp: int = 1, policy: str = "fail", d_blocks: int = NUM_BLOCKS,
                d_extra: dict | None = None, d_model: str | None = None, **kw) -> tuple[LoopbackFabric, Engine, Engine]:
    """``d_extra``: D's own kv_connector_extra_config keys (beside ``extra``, both's); ``d_model``:
    D's model when it is not P's (``model``)."""
    fabric = LoopbackFabric()
    pk, dk = zmq.curve_keypair(), zmq.curve_keypair()
    p = Engine(fabric, "P", clock, tp=p_tp, policy=policy, keypair=pk, peers={"D": dk[0]}, **kw)
    if d_extra:
        kw = dict(kw, extra={**kw.get("extra", {}), **d_extra})
    if d_model is not None:
        kw = dict(kw, model=d_model)
    d = Engine(fabric, "D", clock, tp=d_tp, policy=policy, keypair=dk, peers={"P": pk[0]}, num_blocks=d_blocks, **kw)
    return fabric, p, d
