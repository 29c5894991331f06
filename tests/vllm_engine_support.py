"""One engine's two halves of the vLLM connector (scheduler and worker), in
one process over real NIXL and ZMQ, without vLLM: the pair the worker-side
and push tests step the way vLLM's engine loop does."""
from __future__ import annotations

import socket

import torch

from kvplane.connector.vllm_scheduler import VllmSchedulerSide
from kvplane.connector.vllm_settings import for_dp_rank, settings_from
from kvplane.connector.vllm_worker import VllmWorkerSide
from vllm_support import Req as VllmRequest
from vllm_support import deployment_secret

BLOCKS, BLOCK_TOKENS, WIDTH = 32, 16, 8


def Req(request_id: str, kv_transfer_params: dict | None, **kw) -> VllmRequest:
    """A 40-token prompt, all computed: what these engines pass."""
    return VllmRequest(request_id, kv_transfer_params, **{"num_prompt_tokens": 40, "num_computed_tokens": 40, **kw})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_layers(seed: int, block_tokens: int = BLOCK_TOKENS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(BLOCKS, 2, block_tokens, WIDTH, generator=g).to(torch.bfloat16)
            for i in range(2)}


class Engine:
    """One engine's scheduler half and worker half, stepped as vLLM's loop
    does; one deployment secret per test folder unless ``extra`` names keys."""

    def __init__(self, name: str, tmp, seed: int, mode: str = "pull", block_tokens: int = BLOCK_TOKENS, *,
                 dp_index: int = 0, side_channel_port: int | None = None, **extra):
        """``dp_index``: the engine core's data-parallel index, as vLLM's DP
        rank k's connector gets it (its files' ``{dp}``, its port's offset
        from ``side_channel_port``)."""
        if "kvplane_keypair" not in extra and "kvplane_insecure" not in extra:
            extra["kvplane_secret_file"] = deployment_secret(tmp)
        self.name = name
        self.settings = for_dp_rank(settings_from({"kvplane_event_log": str(tmp / f"{name}.events.jsonl"),
                                                   "kvplane_status_file": str(tmp / f"{name}.status.json"),
                                                   "kvplane_kv_dump_dir": str(tmp), **extra},
                                                  side_channel_port=side_channel_port or free_port()), dp_index)
        self.sched = VllmSchedulerSide(name, self.settings, transfer_mode=mode, block_size=block_tokens)
        self.worker = VllmWorkerSide(name, self.settings, dp_index=dp_index)
        self.kv = kv_layers(seed, block_tokens)
        self.worker.register_kv_caches(self.kv)
        self.sched.add_ranks({0: self.worker.rank_info()})
        self.finished: dict[str, set[str]] = {"sending": set(), "recving": set(), "failed": set()}

    def step(self, scheduled=()) -> None:
        """One engine step: metadata to the worker, results back."""
        self.worker.bind(self.sched.build_step(list(scheduled)))
        sending, recving, failed, _ = self.worker.results()
        self.finished["sending"] |= sending
        self.finished["recving"] |= recving
        self.finished["failed"] |= failed
        report = self.worker.take_report()
        self.sched.update_from_workers([report] if report else [])
