"""The ``engine_request`` machine run beside the vLLM connector's scheduler
half, as a shadow: every engine call the connector gets is also fed to the
machine (one instance per request), and what the machine answers and sends
the ranks is compared with what the connector did.  A test engine keeps the
mismatches; none means the drafted machine decides, on that run, exactly
what today's request-id sets decide (the check before the machine replaces
them).  Timers are the machine's own, fired on the engine's clock.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from kvplane.connector.records import StepMeta
from kvplane.statemachines import engine_calls as C
from kvplane.statemachines.base import ArmTimer, CancelTimer, TimerFired
from kvplane.statemachines.machine import IGNORED, ProtocolViolation, compile_machine
from kvplane.statemachines.machines.engine_request import SPEC

MACHINE = compile_machine(SPEC)
NORMAL = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


def meta_records(meta: StepMeta) -> Counter:
    """A step's records as (kind, request id) pairs."""
    out: Counter = Counter()
    out.update(("new", n.request_id) for n in meta.new_requests)
    out.update(("load" if x.awaiting else "notify", x.request_id) for x in meta.loads)
    out.update(("running", rid) for rid in meta.running)
    out.update(("finish", f.request_id) for f in meta.finished)
    out.update(("grant", f.request_id) for f in meta.finished if f.hold is not None)
    out.update(("grant", g.request_id) for g in meta.grants)
    out.update(("abort", rid) for rid in meta.aborts)
    out.update(("lease_abort", rid) for rid in meta.lease_aborts)
    return out


_RECORD = {C.SendNewRemote: "new", C.SendLoad: "load", C.SendNotifyOnly: "notify", C.SendRunning: "running",
           C.SendFinish: "finish", C.GrantLease: "grant", C.SendAbort: "abort", C.SendLeaseAbort: "lease_abort"}


class EngineShadow:
    def __init__(self, connector: Any, clock: Callable[[], float]):
        self.connector = connector
        self.side = connector.scheduler_side
        self.clock = clock
        self.cfg = connector.settings.plane
        self.requests: dict[str, Any] = {}
        self.pending: Counter = Counter()  # records the machine sent since the last metadata
        self.mismatches: list[str] = []
        self.flags: list[C.FlagOverdue] = []
        self._refused_before = 0
        for name in ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "update_connector_output", "request_finished_all_groups"):
            setattr(connector, name, self._wrap(name, getattr(connector, name)))

    def _wrap(self, name: str, real: Callable) -> Callable:
        shadow = getattr(self, f"_{name}")

        def call(*args: Any) -> Any:
            self._fire_timers()
            self._refused_before = self.side.counters["bad_transfer_params"]
            result = real(*args)
            shadow(result, *args)
            return result

        return call

    # ------------------------------------------------------------ feeding
    def _feed(self, rid: str, event: Any) -> list:
        inst = self.requests.get(rid)
        if inst is None:
            return []
        try:
            out = MACHINE.handle(inst, event, self.cfg, self.clock())
        except ProtocolViolation as exc:
            self.mismatches.append(f"{rid}: the machine refuses {type(event).__name__} in {inst.state}: {exc.reason}")
            return []
        if out is IGNORED:
            return []
        acts = [a for a in out if not isinstance(a, (ArmTimer, CancelTimer))]
        for a in acts:
            kind = _RECORD.get(type(a))
            if kind is not None:
                self.pending[(kind, rid)] += 1
            if isinstance(a, C.FlagOverdue):
                self.flags.append(a)
        if MACHINE.is_terminal(inst):
            del self.requests[rid]
        return acts

    def _fire_timers(self) -> None:
        now = self.clock()
        for rid, inst in list(self.requests.items()):
            if inst.deadline is not None and inst.deadline <= now:
                self._feed(rid, TimerFired(SPEC.name, rid, inst.deadline))

    # ------------------------------------------------------------ the engine's calls
    def _on_new_request(self, result: Any, request: Any) -> None:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        refused = self.side.counters["bad_transfer_params"] > self._refused_before  # computed locally
        if not (params.get("do_remote_prefill") or params.get("do_remote_decode")) or refused:
            return
        self.requests[rid] = MACHINE.new(rid)
        self._feed(rid, C.EngineNewRequest(request_id=rid, remote_prefill=bool(params.get("do_remote_prefill")),
                                           remote_decode=bool(params.get("do_remote_decode"))))

    def _get_num_new_matched_tokens(self, result: Any, request: Any, num_computed_tokens: int) -> None:
        rid = request.request_id
        acts = self._feed(rid, C.EngineMatched(request_id=rid, num_prompt_tokens=request.num_prompt_tokens,
                                               num_computed_tokens=num_computed_tokens))
        answer = next(((a.num_tokens, a.load_async) for a in acts if isinstance(a, C.AnswerMatched)), (0, False))
        if tuple(result) != answer:
            self.mismatches.append(f"{rid}: matched tokens {tuple(result)}, the machine {answer}")

    def _update_state_after_alloc(self, result: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        ids = blocks.get_unhashed_block_ids_all_groups()[0] if num_external_tokens > 0 else []
        self._feed(rid, C.EngineAllocated(request_id=rid, block_ids=tuple(ids), num_external_tokens=num_external_tokens))

    def _build_connector_meta(self, result: Any, scheduler_output: Any) -> None:
        scheduled = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        scheduled += list(scheduler_output.scheduled_cached_reqs.req_ids)
        real = meta_records(result.step.meta)
        # The connector reads the scheduled ids when it builds the metadata:
        # what they make the machine send belongs to this step too.
        for rid in scheduled:
            self._feed(rid, C.EngineScheduled(request_id=rid))
        mine, self.pending = self.pending, Counter()
        if +real != +mine:
            self.mismatches.append(f"step records {sorted(real.elements())}, the machine {sorted(mine.elements())}")

    def _update_connector_output(self, result: Any, output: Any) -> None:
        failed = set(output.failed_recving or ())
        for rid in sorted(output.finished_recving or ()):
            self._feed(rid, C.RecvFinished(request_id=rid, ok=rid not in failed))
        for rid in sorted(output.finished_sending or ()):
            self._feed(rid, C.SendingFinished(request_id=rid))

    def _request_finished_all_groups(self, result: Any, request: Any, block_ids: Any) -> None:
        rid = request.request_id
        normal = getattr(request.status, "name", str(request.status)) in NORMAL
        blocks = tuple(block_ids[0]) if block_ids else ()
        hold = normal and self.side.settings.bidirectional
        acts = self._feed(rid, C.EngineFinished(request_id=rid, normal=normal, block_ids=blocks,
                                                hold_for_next_turn=hold))
        delay = any(isinstance(a, C.AnswerDelayFree) for a in acts)
        answered = any(isinstance(a, (C.AnswerDelayFree, C.AnswerFinished)) for a in acts)
        if answered and (bool(result[0]), result[1] is not None) != (delay, delay):
            self.mismatches.append(f"{rid}: request_finished {result[0]}, params {result[1] is not None}; "
                                   f"the machine delays: {delay}")
