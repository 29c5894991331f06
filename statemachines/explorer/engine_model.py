"""The engine world: vLLM's scheduler, the engine-side request machine, two
worker ranks a side.

``kvplane explore --engine`` composes, per request, the connector's
scheduler half as the ``engine_request`` machine on each side (D's engine:
``d<i>``, a remote prefill; P's engine: ``p<i>``, a remote decode) with the
rank world of ``ranks`` (one plane per worker rank) and a model of vLLM
0.32.0's scheduler (``v1/core/sched/scheduler.py``) that calls the
connector in every order vLLM allows:

- P's engine prefills the prompt (on_new_request, get_num_new_matched_tokens,
  update_state_after_alloc, scheduled, finished normally: delay-free and a
  lease on every P rank), or aborts it while prefilling (after a
  preemption): then D never gets it;
- D's engine, request by request: matched but not allocated (no free
  blocks: matched again later), allocated (with the tokens the connector
  matched; awaited: WAITING_FOR_REMOTE_KVS), promoted once the recv is in
  its finished set (``update_state_after_alloc(.., 0)`` and scheduled; a
  failed recv is matched again from 0 computed tokens), scheduled again (a
  step without worker output), preempted (blocks freed, computed tokens 0,
  matched and allocated again; the adapter feeds ``EnginePreempted``),
  finished, or aborted at any point (budgeted): in WAITING_FOR_REMOTE_KVS
  vLLM keeps the blocks until the recv is reported;
- the workers' reports reach vLLM through vLLM's own aggregation
  (``KVOutputAggregator``: a request is finished when ``get_finished_count``
  reports arrived, counted, not per rank; failed_recving rides with it).

The connector's translation of the machine's actions is the worker's
(``connector.worker.ConnectorWorker.bind``): ``SendNewRemote`` a
NewRequest on every D rank, ``SendLoad`` / ``SendNotifyOnly``
BlocksAllocated (awaited / not) then StartLoad, ``SendRunning``
RequestRunning, ``SendFinish`` RequestFinished, ``SendAbort`` Abort,
``GrantLease`` LeaseGranted on every P rank, ``SendLeaseAbort``
LeaseAbort; answers go back to vLLM.  Records reach the ranks at the call
(the real connector batches them into the step's metadata, in call order).

Checks (besides the rank world's): an awaited recv is reported to vLLM
exactly once, and only while vLLM awaits it (WAITING_FOR_REMOTE_KVS, or
aborted there with its blocks kept): else vLLM's scheduler asserts; a
delayed free is answered by exactly one finished_sending, after every P
rank ended its lease, and nothing else gets one; the machine never meets a
call or report its table declares an error; a request D's engine dropped
before allocating it is notified to P (no fault-free lease runs out for
it); at quiescence no vLLM request waits, no blocks are kept and no
machine is left (every waiting state reached an end under its deadline).

Abstractions: no turn 2, no push, no rank crash (a dead worker takes the
engine with it); the prompt is 4 tokens in one block; a "hit" profile has
all of them cached locally (nothing to load: notify-only), a "read" none;
after a preemption vLLM's local cache is assumed gone (0 computed).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, cast

from .. import actions as A
from .. import engine_calls as C
from .. import events as E
from ..base import ArmTimer, CancelTimer, TimerFired
from ..machine import Machine, ProtocolViolation, compile_machine
from ..machines import engine_request as ER
from ..rank_results import RankResults
from .checks import Found
from .config import ExploreConfig
from .model import Model
from .moves import Deliver, EngineCall, Move, Tick, TickLosing, WorkerOutput
from .ranks import RankModel, RankWorld, ResultsFactory
from .world import ARRIVED, World

ENGINE_MACHINE = compile_machine(ER.SPEC)
PROMPT_TOKENS = 4
D_BLOCKS, P_BLOCKS = (1,), (2,)

# vLLM's view of D's request i (``EngineWorld.vd``): plain ints (they enter the canonical state).
(V_NONE, V_WAITING, V_WFR, V_READY, V_RUNNING, V_PREEMPTED, V_HOLD_RECV, V_HOLD_SEND, V_FREED,
 V_DROPPED) = range(10)
# V_WAITING: arrived, never allocated; V_WFR: WAITING_FOR_REMOTE_KVS; V_READY: the same, with the recv
# in vLLM's finished set; V_HOLD_RECV: aborted in WAITING_FOR_REMOTE_KVS, blocks kept until the recv is
# reported; V_HOLD_SEND: finished with a delayed free; V_DROPPED: P's engine aborted it, D never got it.
V_WORDS = {V_NONE: "not arrived", V_WAITING: "WAITING", V_WFR: "WAITING_FOR_REMOTE_KVS",
           V_READY: "WAITING_FOR_REMOTE_KVS (recv finished)", V_RUNNING: "RUNNING", V_PREEMPTED: "PREEMPTED",
           V_HOLD_RECV: "FINISHED_ABORTED (blocks kept until its recv is reported)",
           V_HOLD_SEND: "FINISHED (blocks kept until finished_sending)", V_FREED: "FINISHED (freed)",
           V_DROPPED: "never sent to D"}
# P's engine, request i (``EngineWorld.vp``).
P_NONE, P_HOLD_SEND, P_FREED = range(3)


# name -> (the vLLM states of D's request it is enabled in, a fault-free (drain) step, words)
CALLS: dict[str, tuple[tuple[int, ...], bool, str]] = {
    "prefill": ((V_NONE,), False, "P's engine prefills request {r} ({profile}) and grants its lease; D's engine "
                "gets it (on_new_request)"),
    "prefill_aborted": ((V_NONE,), False, "P's engine preempts, then aborts request {r} ({profile}) while "
                        "prefilling: nothing granted"),
    "alloc": ((V_WAITING, V_PREEMPTED), True, "D's engine matches and allocates request {r} ({profile})"),
    "no_blocks": ((V_WAITING, V_PREEMPTED), False, "D's engine matches request {r} ({profile}) but has no "
                  "free blocks (it will match again)"),
    "promote": ((V_READY,), True, "D's engine promotes request {r} ({profile}), its recv finished: "
                "update_state_after_alloc(.., 0), scheduled"),
    "step": ((V_RUNNING,), False, "D's engine schedules request {r} ({profile}) again (a step without "
             "worker output)"),
    "preempt": ((V_RUNNING,), False, "D's engine preempts request {r} ({profile}): blocks freed, 0 computed"),
    "finish": ((V_RUNNING,), True, "D's engine finishes request {r} ({profile})"),
    "abort": ((V_WAITING, V_WFR, V_READY, V_RUNNING, V_PREEMPTED), False,
              "D's engine aborts request {r} ({profile})"),
}
ENABLED_IN = {name: set(states) for name, (states, _, _) in CALLS.items()}
DRAIN_CALLS = tuple(name for name, (_, drain, _) in CALLS.items() if drain)


class EngineWorld(RankWorld):
    """A RankWorld with both engines: ``machines`` the engine_request
    instances by key ("d<i>": D's engine, "p<i>": P's), copied on write;
    ``vd`` / ``vp`` vLLM's view of each request on D / P; ``pending``
    vLLM's aggregation counts ((what, request id) -> reports still due,
    "recv" or "send") and ``failed`` the failed recvs it holds; ``recvs``
    how many times D's vLLM got each recv; ``dropped`` the requests D's
    engine finished before allocating them; ``preempts`` preemptions so
    far; ``answers`` the last AnswerMatched per D request."""

    __slots__ = ("machines", "vd", "vp", "pending", "failed", "recvs", "dropped", "preempts", "answers", "inbox")
    machines: dict[str, Any]
    vd: list[int]
    vp: list[int]
    pending: dict[tuple[str, str], int]
    failed: frozenset[str]
    recvs: list[int]
    dropped: frozenset[int]
    preempts: int
    answers: dict[str, tuple[int, bool]]
    # Side -> what its ranks reported since vLLM's last step: ("recv", id, ok) or ("send", id).
    inbox: dict[str, tuple]

    def clone(self) -> "EngineWorld":
        w = cast(EngineWorld, super().clone())
        w.machines = dict(self.machines)
        w.vd, w.vp, w.recvs = list(self.vd), list(self.vp), list(self.recvs)
        w.pending = dict(self.pending)
        w.failed, w.dropped, w.preempts = self.failed, self.dropped, self.preempts
        w.answers = dict(self.answers)
        w.inbox = dict(self.inbox)
        return w


class EngineModel(RankModel):
    """The rank world driven by vLLM's scheduler through ``engine_request``.

    ``engine_machine``: the engine_request machine (a mutant's, or the
    real one); ``finished_count``: what the connector answers vLLM's
    ``get_finished_count`` (None: vLLM counts one report per rank, the
    world size)."""

    def __init__(self, cfg: ExploreConfig, machines: dict[str, Machine] | None = None,
                 results: ResultsFactory = RankResults, *, engine_machine: Machine | None = None,
                 finished_count: int | None = None):
        super().__init__(cfg, machines, results)
        self.engine = engine_machine or ENGINE_MACHINE
        self.finished_count = finished_count
        for prof in self.profiles:
            if prof.name not in ("read", "hit", "notify"):
                raise ValueError(f"the engine world models profiles read, hit and notify, not {prof.name!r}")

    # ------------------------------------------------------------- setup
    def initial(self, record: bool = False) -> EngineWorld:
        base = super().initial(record)
        w = EngineWorld.__new__(EngineWorld)
        for name in World.__slots__ + RankWorld.__slots__:
            setattr(w, name, getattr(base, name))
        w.machines = {}
        w.vd, w.vp, w.recvs = [V_NONE] * self.n, [P_NONE] * self.n, [0] * self.n
        w.pending, w.failed, w.dropped, w.preempts, w.answers = {}, frozenset(), frozenset(), 0, {}
        w.inbox = {"D": (), "P": ()}
        return w

    def canon(self, w: World, symmetry: bool) -> tuple:
        assert isinstance(w, EngineWorld)
        now = {"d": self.now(w, "D0"), "p": self.now(w, "P0")}
        rel = self.canonical._rel
        engines = tuple(sorted(
            (key, inst.state, rel(inst.deadline, now[key[0]]), inst.block_ids, inst.num_external_tokens)
            for key, inst in w.machines.items()))
        return (self.canonical.key(w, False), engines, tuple(w.vd), tuple(w.vp), tuple(sorted(w.pending.items())),
                tuple(sorted(w.failed)), tuple(w.recvs), tuple(sorted(w.dropped)), w.preempts,
                tuple(sorted(w.answers.items())), w.inbox["D"], w.inbox["P"])

    # ------------------------------------------------------------- moves
    def _calls(self, w: EngineWorld, i: int) -> list[str]:
        cfg, state = self.cfg, w.vd[i]
        out = []
        for name, enabled in ENABLED_IN.items():
            if state not in enabled:
                continue
            if name in ("abort", "prefill_aborted") and w.aborts >= cfg.max_aborts:
                continue
            if name == "preempt" and w.preempts >= cfg.max_preemptions:
                continue
            out.append(name)
        return out

    def moves(self, w: World) -> list[Move]:
        assert isinstance(w, EngineWorld)
        out: list[Move] = []
        urgent = bool(w.net)
        for i in range(self.n):
            for name in self._calls(w, i):
                # The network is faster than a scheduler step; an abort may still race it.
                if name == "abort" or not urgent:
                    out.append(EngineCall(name, i))
        for side in ("D", "P"):
            if w.inbox[side]:
                out.append(WorkerOutput(side))
        out.extend(self._network_moves(w))
        if not w.net and not w.inbox["D"] and not w.inbox["P"]:
            out.extend(self._tick_moves(w))
        return out

    def drain_move(self, w: World) -> Move | None:
        assert isinstance(w, EngineWorld)
        if w.net:
            return Deliver(0)
        for side in ("D", "P"):
            if w.inbox[side]:
                return WorkerOutput(side)
        for i in range(self.n):
            for name in DRAIN_CALLS:
                if w.vd[i] in ENABLED_IN[name]:
                    return EngineCall(name, i)
        if self._next_time(w) is not None:
            return Tick()
        return None

    def describe(self, w: World, move: Move) -> str:
        if isinstance(move, EngineCall):
            words = CALLS[move.name][2].format(r=move.request, profile=self.profiles[move.request].name)
            return f"{words} (t={w.t:g})"
        if isinstance(move, WorkerOutput):
            assert isinstance(w, EngineWorld)
            reports = ", ".join(f"{x[0]} {x[1]}" + ("" if x[0] != "recv" or x[2] else " (failed)")
                                for x in w.inbox[move.side])
            return f"{move.side}'s engine takes its workers' output: {reports} (t={w.t:g})"
        return super().describe(w, move)

    def _next_time(self, w: World) -> float | None:
        assert isinstance(w, EngineWorld)
        best = super()._next_time(w)
        for key, inst in w.machines.items():
            if inst.deadline is not None:
                at = inst.deadline - self.skew[key[0].upper()]
                if best is None or at < best:
                    best = at
        return best

    def apply(self, w: World, move: Move) -> None:
        if isinstance(move, EngineCall):
            assert isinstance(w, EngineWorld)
            getattr(self, "_call_" + move.name)(w, move.request)
            self.checks.check_invariants(w)
            return
        if isinstance(move, WorkerOutput):
            assert isinstance(w, EngineWorld)
            self._take_output(w, move.side)
            self.checks.check_invariants(w)
            return
        super().apply(w, move)

    def _rank_tick(self, w: World, move: Tick | TickLosing) -> None:
        RankModel._rank_tick(self, w, move)
        assert isinstance(w, EngineWorld)
        for key in sorted(w.machines):
            inst = w.machines.get(key)
            now = self.now(w, key[0].upper())
            if inst is not None and inst.deadline is not None and inst.deadline <= now:
                self._engine(w, key, TimerFired(ER.SPEC.name, key, inst.deadline))

    _APPLY = {**RankModel._APPLY, Tick: _rank_tick, TickLosing: _rank_tick}

    # ---------------------------------------------- the engine machine, translated
    def _engine(self, w: EngineWorld, key: str, event) -> list:
        """``event`` to the connector's machine for ``key``; its records go to
        the ranks, its answers back to the caller."""
        old = w.machines.get(key)
        inst = self.engine.new(key) if old is None else copy.copy(old)
        side = key[0].upper()
        try:
            acts = self.engine.handle(inst, event, self.cfg.plane, self.now(w, side))
        except ProtocolViolation as exc:
            raise Found("engine_protocol_violation",
                        f"{side}'s connector, request {key} in {exc.state}: {type(event).__name__} is an error there "
                        f"({exc.reason})") from None
        if inst.state in self.engine.terminal_states:
            w.machines.pop(key, None)
        else:
            w.machines[key] = inst
        answers = []
        for a in acts:
            translate = self._TRANSLATE.get(type(a))
            if translate is not None:
                translate(self, w, key, a)
            elif isinstance(a, (C.AnswerMatched, C.AnswerFinished, C.AnswerDelayFree)):
                answers.append(a)
            # A flag is the embedder's log; the Tell* name what the model's vLLM was just told (its update_from_output).
            elif not isinstance(a, (ArmTimer, CancelTimer, C.FlagOverdue, C.TellRecvFinished, C.TellSendingFinished,
                                    C.DeclineSmallRead)):
                raise TypeError(f"engine model bug: no translation for {type(a).__name__}")
        return answers

    def _send_new_remote(self, w: EngineWorld, key: str, a: C.SendNewRemote) -> None:
        i = int(key[1:])
        for dname in self.live(w, self.d_ranks):
            self._feed(w, dname, E.NewRequest(
                request_id=key, engine_id="P", remote_request_id=f"p{i}", remote_block_ids=P_BLOCKS,
                remote_ranks=self.remote_ranks(dname), expected_consumers=self.consumers,
                remote_expiry=w.p_expiry[i], remote_renewable=True))

    def _load(self, w: EngineWorld, key: str, block_ids: tuple, tokens: int, awaiting: bool) -> None:
        live = self.live(w, self.d_ranks)
        if awaiting:
            w.awaited = w.awaited | {(dname, key) for dname in live}
        for dname in live:
            self._feed(w, dname, E.BlocksAllocated(request_id=key, block_ids=block_ids, num_remote_tokens=tokens,
                                                   awaiting=awaiting))
            self._feed(w, dname, E.StartLoad(request_id=key))

    def _send_load(self, w: EngineWorld, key: str, a: C.SendLoad) -> None:
        self._load(w, key, a.block_ids, a.num_remote_tokens, True)

    def _send_notify_only(self, w: EngineWorld, key: str, a: C.SendNotifyOnly) -> None:
        self._load(w, key, (), 0, False)

    def _to_d_ranks(self, w: EngineWorld, event) -> None:
        for dname in self.live(w, self.d_ranks):
            self._feed(w, dname, event)

    def _send_running(self, w: EngineWorld, key: str, a: C.SendRunning) -> None:
        self._to_d_ranks(w, E.RequestRunning(request_id=key))

    def _send_finish(self, w: EngineWorld, key: str, a: C.SendFinish) -> None:
        self._to_d_ranks(w, E.RequestFinished(request_id=key, block_ids=a.block_ids))

    def _send_abort(self, w: EngineWorld, key: str, a: C.SendAbort) -> None:
        self._to_d_ranks(w, E.Abort(request_id=key))

    def _grant_lease(self, w: EngineWorld, key: str, a: C.GrantLease) -> None:
        if a.hold:
            raise TypeError("engine model bug: the engine world models no turn-2 hold")
        for pname in self.live(w, self.p_ranks):
            self._feed(w, pname, E.LeaseGranted(request_id=key, block_ids=a.block_ids,
                                                expected_consumers=self.consumers))

    def _send_lease_abort(self, w: EngineWorld, key: str, a: C.SendLeaseAbort) -> None:
        for pname in self.live(w, self.p_ranks):
            if key in w.planes[pname].instances["lease"]:
                self._feed(w, pname, E.LeaseAbort(request_id=key))

    _TRANSLATE: dict[type, Callable] = {
        C.SendNewRemote: _send_new_remote, C.SendLoad: _send_load, C.SendNotifyOnly: _send_notify_only,
        C.SendRunning: _send_running, C.SendFinish: _send_finish, C.SendAbort: _send_abort,
        C.GrantLease: _grant_lease, C.SendLeaseAbort: _send_lease_abort,
    }

    # ------------------------------------------------------- vLLM's calls
    @staticmethod
    def _answer(answers: list, kind: type, what: str):
        found = [a for a in answers if isinstance(a, kind)]
        if len(found) != 1:
            raise Found("engine_answer_missing", f"the connector answered {what} with {answers}")
        return found[0]

    def _finished_answer(self, answers: list, what: str) -> bool:
        """request_finished's answer: whether the engine keeps the blocks."""
        kinds = [a for a in answers if isinstance(a, (C.AnswerFinished, C.AnswerDelayFree))]
        if len(kinds) != 1:
            raise Found("engine_answer_missing", f"the connector answered request_finished of {what} with {answers}")
        return isinstance(kinds[0], C.AnswerDelayFree)

    def _call_prefill(self, w: EngineWorld, i: int) -> None:
        p, d = f"p{i}", f"d{i}"
        self._engine(w, p, C.EngineNewRequest(request_id=p, remote_decode=True))
        self._engine(w, p, C.EngineMatched(request_id=p, num_prompt_tokens=PROMPT_TOKENS, num_computed_tokens=0))
        self._engine(w, p, C.EngineAllocated(request_id=p, block_ids=P_BLOCKS))
        self._engine(w, p, C.EngineScheduled(request_id=p))
        answers = self._engine(w, p, C.EngineFinished(request_id=p, normal=True, block_ids=P_BLOCKS))
        if self._finished_answer(answers, p):
            w.vp[i] = P_HOLD_SEND
        # The params carry P rank 0's expiry (the ranks grant together).
        lease = w.planes[self.p_ranks[0]].instances["lease"].get(p)
        w.p_expiry[i] = None if lease is None else lease.expiry
        self._engine(w, d, C.EngineNewRequest(request_id=d, remote_prefill=True))
        w.vd[i] = V_WAITING
        w.phase[i] = ARRIVED  # the rank world's bookkeeping

    def _call_prefill_aborted(self, w: EngineWorld, i: int) -> None:
        p = f"p{i}"
        w.aborts += 1
        self._engine(w, p, C.EngineNewRequest(request_id=p, remote_decode=True))
        self._engine(w, p, C.EngineMatched(request_id=p, num_prompt_tokens=PROMPT_TOKENS, num_computed_tokens=0))
        self._engine(w, p, C.EngineAllocated(request_id=p, block_ids=P_BLOCKS))
        self._engine(w, p, C.EngineScheduled(request_id=p))
        self._engine(w, p, C.EnginePreempted(request_id=p))
        self._engine(w, p, C.EngineMatched(request_id=p, num_prompt_tokens=PROMPT_TOKENS, num_computed_tokens=0))
        answers = self._engine(w, p, C.EngineFinished(request_id=p, normal=False, block_ids=()))
        if self._finished_answer(answers, p):
            w.vp[i] = P_HOLD_SEND
        w.vd[i] = V_DROPPED

    def _computed(self, w: EngineWorld, i: int) -> int:
        """The block-aligned local hit vLLM presents: the whole prompt for a
        hit, until a preemption (the cache is assumed gone then)."""
        return PROMPT_TOKENS if self.profiles[i].num_remote_tokens == 0 and w.vd[i] == V_WAITING else 0

    def _match(self, w: EngineWorld, i: int, computed: int) -> tuple[int, bool]:
        d = f"d{i}"
        answers = self._engine(w, d, C.EngineMatched(request_id=d, num_prompt_tokens=PROMPT_TOKENS,
                                                     num_computed_tokens=computed))
        ans = self._answer(answers, C.AnswerMatched, f"get_num_new_matched_tokens of {d}")
        w.answers[d] = (ans.num_tokens, ans.load_async)
        return ans.num_tokens, ans.load_async

    def _allocate(self, w: EngineWorld, i: int, tokens: int, load_async: bool) -> None:
        """update_state_after_alloc, then: awaited (WAITING_FOR_REMOTE_KVS) or
        scheduled this step."""
        d = f"d{i}"
        self._engine(w, d, C.EngineAllocated(request_id=d, block_ids=D_BLOCKS if tokens > 0 else (),
                                             num_external_tokens=tokens))
        if load_async:
            w.vd[i] = V_WFR
            return
        self._engine(w, d, C.EngineScheduled(request_id=d))
        w.vd[i] = V_RUNNING

    def _call_alloc(self, w: EngineWorld, i: int) -> None:
        tokens, load_async = self._match(w, i, self._computed(w, i))
        self._allocate(w, i, tokens, load_async)

    def _call_no_blocks(self, w: EngineWorld, i: int) -> None:
        self._match(w, i, self._computed(w, i))

    def _call_promote(self, w: EngineWorld, i: int) -> None:
        d = f"d{i}"
        if d in w.failed:
            # kv_load_failure_policy recompute: nothing valid was loaded, the
            # blocks are freed and the request is matched again from 0.
            w.failed = w.failed - {d}
            tokens, load_async = self._match(w, i, 0)
            self._allocate(w, i, tokens, load_async)
            return
        self._allocate(w, i, 0, False)

    def _call_step(self, w: EngineWorld, i: int) -> None:
        self._engine(w, f"d{i}", C.EngineScheduled(request_id=f"d{i}"))

    def _call_preempt(self, w: EngineWorld, i: int) -> None:
        w.preempts += 1
        self._engine(w, f"d{i}", C.EnginePreempted(request_id=f"d{i}"))
        w.vd[i] = V_PREEMPTED

    def _call_finish(self, w: EngineWorld, i: int) -> None:
        d = f"d{i}"
        delay = self._finished_answer(self._engine(w, d, C.EngineFinished(request_id=d, normal=True,
                                                                           block_ids=D_BLOCKS)), d)
        w.vd[i] = V_HOLD_SEND if delay else V_FREED

    def _call_abort(self, w: EngineWorld, i: int) -> None:
        d, state = f"d{i}", w.vd[i]
        w.aborts += 1
        blocks = () if state in (V_WAITING, V_PREEMPTED) else D_BLOCKS
        delay = self._finished_answer(self._engine(w, d, C.EngineFinished(request_id=d, normal=False,
                                                                           block_ids=blocks)), d)
        if state == V_WAITING:
            w.dropped = w.dropped | {i}
        w.failed = w.failed - {d}
        if delay:
            w.vd[i] = V_HOLD_SEND
        elif state == V_WFR:
            w.vd[i] = V_HOLD_RECV  # vLLM itself keeps the blocks the recv writes into
        else:
            w.vd[i] = V_FREED

    # ------------------------------------------------ the workers' reports
    def _count(self, w: EngineWorld, what: str, rid: str, world_size: int) -> bool:
        """vLLM's KVOutputAggregator: one report of ``rid``; True when it is
        finished (as many reports as the finished count, from any ranks)."""
        need = self.finished_count or world_size
        left = w.pending.get((what, rid), need) - 1
        if left == 0:
            w.pending.pop((what, rid), None)
            return True
        w.pending[(what, rid)] = left
        return False

    def _report_recv(self, w: World, pname: str, a: A.ReportRecv, lose_heartbeats: bool) -> None:
        assert isinstance(w, EngineWorld)
        Model._report_recv(self, w, pname, a, lose_heartbeats)  # the rank's own: awaited, once
        w.inbox = {**w.inbox, "D": w.inbox["D"] + (("recv", a.request_id, a.ok),)}

    def _take_output(self, w: EngineWorld, side: str) -> None:
        """vLLM aggregates one step's worker output, then acts on what finished."""
        reports, w.inbox = w.inbox[side], {**w.inbox, side: ()}
        finished = []
        for x in reports:
            if x[0] == "recv":
                if not x[2]:
                    w.failed = w.failed | {x[1]}
                if self._count(w, "recv", x[1], len(self.d_ranks)):
                    finished.append(x)
            elif self._count(w, "send", x[1], len(self.p_ranks)):
                finished.append(x)
        for x in finished:
            (self._vllm_recv if x[0] == "recv" else self._vllm_sent)(w, int(x[1][1:]))

    def _vllm_recv(self, w: EngineWorld, i: int) -> None:
        """vLLM's update_from_output: finished_recving (and failed_recving) of d<i>."""
        d, state = f"d{i}", w.vd[i]
        w.recvs[i] += 1
        if w.recvs[i] > 1:
            raise Found("recv_reported_twice", f"vLLM got the recv of {d} a second time (request {V_WORDS[state]}): "
                        f"its scheduler asserts")
        if state not in (V_WFR, V_HOLD_RECV):
            raise Found("recv_reported_not_awaited", f"vLLM got the recv of {d}, which is {V_WORDS[state]}: "
                        f"its scheduler asserts")
        self._finished_recving(w, i)  # the rank world's: every live D rank reported it
        ok = d not in w.failed
        self._engine(w, d, C.RecvFinished(request_id=d, ok=ok))
        if state == V_HOLD_RECV:
            w.failed = w.failed - {d}
            w.vd[i] = V_FREED
        else:
            w.vd[i] = V_READY

    def _free_blocks(self, w: World, pname: str, a: A.FreeBlocks, lose_heartbeats: bool) -> None:
        assert isinstance(w, EngineWorld)
        Model._free_blocks(self, w, pname, a, lose_heartbeats)  # the rank's own: freed once
        if pname not in self.p_ranks:
            return
        i = int(a.request_id[1:])
        if a.reason != "consumed" and i in w.dropped and not w.faults:
            raise Found("dropped_request_not_notified",
                        f"{pname}'s lease {a.request_id} ended {a.reason}, with no fault, though D's engine dropped "
                        f"request d{i} before allocating it: nobody told P to free its blocks")
        w.inbox = {**w.inbox, "P": w.inbox["P"] + (("send", a.request_id),)}

    def _vllm_sent(self, w: EngineWorld, i: int) -> None:
        """vLLM's update_from_output: finished_sending of p<i>."""
        p = f"p{i}"
        if w.vp[i] != P_HOLD_SEND:
            raise Found("finished_sending_not_awaited",
                        f"vLLM got finished_sending of {p}, whose blocks it does not keep: its scheduler asserts")
        self._finished_sending(w, i)  # the rank world's: once, after every live P rank's lease ended
        self._engine(w, p, C.SendingFinished(request_id=p))
        w.vp[i] = P_FREED

    _ACTION_HANDLERS = {**RankModel._ACTION_HANDLERS, A.ReportRecv: _report_recv, A.FreeBlocks: _free_blocks}

    # ------------------------------------------------------------ quiescence
    def quiescent_problems(self, w: World) -> list[str]:
        assert isinstance(w, EngineWorld)
        problems = self.checks.quiescent_problems(w)
        for key, inst in sorted(w.machines.items()):
            problems.append(f"{key[0].upper()}'s connector: engine_request {key} stuck in {inst.state}")
        for i in range(self.n):
            if w.vd[i] in (V_WFR, V_HOLD_RECV):
                problems.append(f"vLLM's request d{i} is {V_WORDS[w.vd[i]]}, and nothing will report its recv")
            if w.vd[i] == V_HOLD_SEND:
                problems.append(f"D's vLLM keeps the blocks of d{i}, and no finished_sending will come")
            if w.vp[i] == P_HOLD_SEND:
                problems.append(f"P's vLLM keeps the blocks of p{i}, and no finished_sending will come")
        for side, reports in w.inbox.items():
            if reports:
                problems.append(f"{side}'s engine never took its workers' output {list(reports)}")
        for (what, rid), left in sorted(w.pending.items()):
            problems.append(f"vLLM still counts {left} report(s) of {what} {rid}")
        return problems



def model_for(cfg: ExploreConfig, machines: dict[str, Machine] | None = None) -> Model:
    """The model ``cfg`` asks for: one plane a side, one per rank
    (``cfg.ranks``), or the engine world over the ranks (``cfg.engine``)."""
    if cfg.engine:
        return EngineModel(cfg, machines)
    return Model(cfg, machines) if cfg.ranks is None else RankModel(cfg, machines)
