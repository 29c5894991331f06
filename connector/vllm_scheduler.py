"""The scheduler half of kvplane's vLLM connector, without vLLM.

vLLM calls it with its ``Request`` objects (read here by attribute:
``request_id``, ``kv_transfer_params``, ``num_prompt_tokens``,
``num_computed_tokens``, ``status``); it drives a ``ConnectorScheduler`` and
hands the workers one ``SchedulerStep`` per engine step.  What vLLM's
request lifecycle means for the plane, path by path:

- D, remote KV, tokens to load: awaited; vLLM keeps the request in
  WAITING_FOR_REMOTE_KVS until the workers report the recv (a failed one
  is reported finished too, and failed).
- D, full prefix hit (nothing to load): not awaited; the worker tells P
  to free at once and vLLM runs the request.
- D, aborted before its blocks were allocated: the same notify, so P frees
  now rather than when its lease runs out; vLLM is never told (it awaits
  nothing).
- D, aborted while its recv is awaited: the recv is aborted and still
  reported (failed), which is when vLLM frees the blocks.
- P, finished normally: the blocks go under a lease, freed when every
  reader is done or the lease expires (``finished_sending``); finished any
  other way (aborted, error): freed now.

Bad params from a proxy never reach the plane: the request is counted,
logged by the caller, and computed locally.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import attrs

from .kv_dump import DUMP_KEY, DumpKV
from .params import BadTransferParams
from .records import RankInfo, StepMeta, WorkerReport
from .scheduler import ConnectorScheduler
from .vllm_params import from_vllm, to_vllm
from .vllm_settings import VllmSettings

# vLLM's RequestStatus names of a request that finished producing output.
FINISHED_NORMALLY = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
@attrs.frozen
class SchedulerStep:
    """What the workers get each step: the plane's records and the dumps."""

    meta: StepMeta
    dumps: tuple[DumpKV, ...] = ()


class VllmSchedulerSide:
    def __init__(self, engine_id: str, settings: VllmSettings, *, tp_size: int = 1,
                 warn: Callable[..., None] = lambda *a: None):
        self.settings = settings
        self.sched = ConnectorScheduler(engine_id, tp_size=tp_size, config=settings.plane,
                                        host=settings.side_channel_host)
        self.warn = warn
        self._remote: set[str] = set()  # D: requests with remote KV (accepted params)
        self._allocated: set[str] = set()  # of those, blocks allocated (first update_state_after_alloc)
        self._awaited: set[str] = set()  # of those, the recv is awaited
        self._recv_reported: set[str] = set()  # awaited recvs vLLM was told are finished
        self._running: set[str] = set()  # of those, scheduled since (the plane was told)
        self._dumps: list[DumpKV] = []
        self._local_hit: dict[str, int] = {}  # D: tokens of the prompt D had cached (the read starts there)
        self._recv_failed: set[str] = set()
        self.counters: Counter = Counter()

    # ------------------------------------------------------------ start-up
    def add_ranks(self, infos: dict[int, RankInfo]) -> None:
        for info in infos.values():
            self.sched.add_rank(info)

    # ------------------------------------------------------------ requests
    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        try:
            translated = from_vllm(params) if params.get("do_remote_prefill") else params
            self.sched.on_new_request(request.request_id, translated)
        except BadTransferParams as exc:
            self.counters["bad_transfer_params"] += 1
            self.warn("kvplane: request %s: %s; its prompt is computed locally", request.request_id, exc)
            return
        if params.get("do_remote_prefill"):
            self._remote.add(request.request_id)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        if rid not in self._remote or rid in self._allocated:
            return 0, False
        if num_computed_tokens:
            self.counters["prefix_hits"] += 1
        self._local_hit[rid] = num_computed_tokens
        return self.sched.get_num_new_matched_tokens(rid, request.num_prompt_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: tuple[int, ...], num_external_tokens: int) -> None:
        """``block_ids``: the newly allocated blocks the remote tokens go into
        (vLLM: the unhashed blocks of the one group), empty when there is
        nothing to load.  vLLM calls again after the recv: ignored."""
        rid = request.request_id
        if rid not in self._remote or rid in self._allocated:
            return
        self._allocated.add(rid)
        if num_external_tokens > 0:
            self._awaited.add(rid)
            tag = (request.kv_transfer_params or {}).get(DUMP_KEY)
            if isinstance(tag, str) and tag and self.settings.kv_dump_dir and block_ids:
                # What the read brings, saved when it is done, before D writes anything.
                self._dumps.append(DumpKV(request_id=rid, tag=f"{tag}.recv", block_ids=block_ids, num_tokens=0,
                                          holds_blocks=False, when="recv"))
        else:
            self.counters["full_prefix_hits"] += 1
        self.sched.update_state_after_alloc(rid, block_ids if num_external_tokens > 0 else (),
                                            num_external_tokens)

    def build_step(self, scheduled_ids: list[str]) -> SchedulerStep:
        for rid in scheduled_ids:
            if rid in self._recv_reported and rid not in self._running:
                self.sched.request_running(rid)
                self._running.add(rid)
        dumps, self._dumps = tuple(self._dumps), []
        return SchedulerStep(meta=self.sched.build_connector_meta(), dumps=dumps)

    def request_finished(self, request: Any, block_ids: tuple[int, ...]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params or {}
        normal = getattr(request.status, "name", str(request.status)) in FINISHED_NORMALLY
        if rid in self._remote:
            self._remote.discard(rid)
            awaited = rid in self._awaited
            self._awaited.discard(rid)
            if rid not in self._allocated:
                # Aborted before it was scheduled: an unawaited empty recv, so the
                # worker tells P to free now; vLLM awaits nothing.
                self.counters["aborted_before_alloc"] += 1
                self.sched.update_state_after_alloc(rid, (), 0)
                self.sched.request_finished(rid, ())
                return False, None
            self._allocated.discard(rid)
            if awaited and rid not in self._recv_reported:
                # Still awaited: abort the recv; it is reported (failed), and vLLM
                # frees the blocks then.
                self.counters["aborted_awaited_recv"] += 1
                self.sched.abort(rid)
                return False, None
            self._recv_reported.discard(rid)
            self._running.discard(rid)
            delay, out = self.sched.request_finished(rid, block_ids,
                                                     hold_for_next_turn=self.settings.bidirectional and normal)
            read_ok = rid not in self._recv_failed
            self._recv_failed.discard(rid)
            first = self._local_hit.pop(rid, 0)
            if out is not None:
                return delay, to_vllm(out, num_tokens=request.num_computed_tokens)
            return self._maybe_dump(request, block_ids, params, normal, first_read_token=first, read_ok=read_ok)
        if params.get("do_remote_decode"):
            if not normal or not block_ids:
                self.sched.abort(rid)
                return False, None
            delay, out = self.sched.request_finished(rid, block_ids)
            if out is None:
                return False, None
            self._maybe_dump(request, block_ids, params, normal, holds_blocks=False)  # the lease holds them
            return delay, to_vllm(out, num_tokens=request.num_computed_tokens)
        return self._maybe_dump(request, block_ids, params, normal)

    def _maybe_dump(self, request: Any, block_ids: tuple[int, ...], params: dict, normal: bool, *,
                    holds_blocks: bool = True, first_read_token: int = 0,
                    read_ok: bool | None = None) -> tuple[bool, dict[str, Any] | None]:
        """A request tagged ``kvplane_dump_kv`` (with a dump folder set) has
        its prompt's KV saved; (delay the free, params) for vLLM."""
        tag = params.get(DUMP_KEY)
        if not (normal and isinstance(tag, str) and tag and self.settings.kv_dump_dir and block_ids):
            return False, None
        self._dumps.append(DumpKV(request_id=request.request_id, tag=tag, block_ids=block_ids,
                                  num_tokens=request.num_prompt_tokens, holds_blocks=holds_blocks,
                                  first_read_token=first_read_token, read_ok=read_ok))
        return holds_blocks, None

    # ------------------------------------------------------------ worker results
    def update_from_workers(self, reports: list[WorkerReport], finished_recving: set[str]) -> None:
        """One step's worker reports (vLLM: the aggregated worker meta) and
        the recvs vLLM was told are finished (its aggregated set)."""
        for report in reports:
            self.sched.update_from_worker(report)
            self._recv_failed |= report.failed_recving & self._awaited
        self.sched.get_finished()  # vLLM acts on the workers' own sets; these only keep the books
        self.sched.take_load_error_blocks()
        for rid in finished_recving:
            if rid in self._awaited:
                self._recv_reported.add(rid)
