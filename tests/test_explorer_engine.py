"""The engine world (ExploreConfig.engine, ``explorer/engine_model.py``):
vLLM's scheduler calls the engine_request machine of each side in every
order it allows, over two worker ranks a side.  The real machines pass; each
historical boundary bug in MUTATIONS, made by changing a table row or the
connector's translation, is caught with a counterexample trace."""
from __future__ import annotations

import attrs
import pytest

from kvplane.app.offline.checks import cmd_explore, write_violation
from kvplane.statemachines import engine_calls as C
from kvplane.statemachines.emit import emits
from kvplane.statemachines.events import Abort
from kvplane.statemachines.explorer import ENGINE_FAULTS, ExploreConfig, explore
from kvplane.statemachines.explorer.engine_model import V_FREED, V_HOLD_RECV, EngineModel
from kvplane.statemachines.explorer.moves import EngineCall, WorkerOutput
from kvplane.statemachines.explorer.moves import Deliver, Tick
from kvplane.statemachines.machine import compile_machine
from kvplane.statemachines.machines import MACHINES, decode_request
from kvplane.statemachines.machines import engine_request as ER
from kvplane.statemachines.replay import replay
from kvplane.statemachines.spec import MachineDefinitionError, Transition, with_timer_ignores
from kvplane.statemachines.validate import validate

ENGINE = dict(engine=True, ranks=(2, 2), faults=ENGINE_FAULTS)


def ok(r):
    assert r.ok and not r.truncated, "\n".join(map(str, r.violations))
    return r


# ------------------------------------------------------------ the real machines pass
def test_real_machines_pass_reads_with_aborts_and_preemption():
    r = ok(explore(**ENGINE, requests=("read",), max_faults=0, max_aborts=1, max_depth=16))
    assert r.states > 1000


def test_real_machines_pass_a_read_with_rank_faults():
    ok(explore(**ENGINE, requests=("read",), max_faults=1, max_aborts=1, max_depth=13))


def test_real_machines_pass_a_local_hit_beside_a_read():
    ok(explore(**ENGINE, requests=("hit", "read"), max_faults=0, max_aborts=1, max_depth=11))


def test_the_calls_vllm_makes_reach_every_engine_state():
    """The model drives the machine through its states: a read that is
    preempted after its recv and recomputed, and one aborted while awaited."""
    m = EngineModel(ExploreConfig(**ENGINE, requests=("read",), max_preemptions=1))
    w = m.initial()
    seen = set()

    def run(move):
        m.apply(w, move)
        seen.update(i.state for i in w.machines.values())

    run(EngineCall("prefill", 0))
    assert w.machines["p0"].state == "LEASED" and w.machines["d0"].state == "QUEUED"
    run(EngineCall("alloc", 0))
    while w.net:
        run(Deliver(0))
    run(WorkerOutput("D"))
    assert w.machines["d0"].state == "RECV_DONE" and w.recvs == [1]
    for name in ("promote", "step", "preempt", "alloc", "finish"):
        run(EngineCall(name, 0))
    while w.net or w.inbox["P"]:
        run(Deliver(0) if w.net else WorkerOutput("P"))
    assert w.machines == {} and w.sent == [1]
    assert {"QUEUED", "AWAITING_RECV", "RECV_DONE", "RUNNING", "LEASED"} <= seen

    # Aborted while awaited: vLLM keeps the blocks until every rank reported (failed).
    w = m.initial()
    for move in (EngineCall("prefill", 0), EngineCall("alloc", 0), EngineCall("abort", 0)):
        run(move)
    assert w.machines["d0"].state == "ABORTING" and w.vd[0] == V_HOLD_RECV
    while w.net or w.inbox["D"] or w.inbox["P"]:
        run(Deliver(0) if w.net else WorkerOutput("D" if w.inbox["D"] else "P"))
    assert "d0" not in w.machines and w.vd[0] == V_FREED and w.recvs == [1]


# ------------------------------------------------------------ the mutation list
@emits(C.AnswerMatched)
def _always_async(r, ev, cfg, now):
    """the bug: the match is loaded asynchronously even when nothing is to load"""
    n = max(0, ev.num_prompt_tokens - ev.num_computed_tokens)
    return C.AnswerMatched(r.key, n, True)


def _rows(module, change):
    rows = tuple(change(e) if isinstance(e, Transition) else e for e in module.TABLE)
    assert rows != module.TABLE
    return attrs.evolve(module.SPEC, table=rows)


def _empty_recv_awaited():
    """get_num_new_matched_tokens answers load_async for a full prefix hit:
    vLLM waits in WAITING_FOR_REMOTE_KVS for a recv the ranks never make."""
    spec = _rows(ER, lambda e: attrs.evolve(e, actions=tuple(
        _always_async if a is ER.answer_remote_tokens else a for a in e.actions)))
    validate(with_timer_ignores(spec))  # the table's resources cannot see it: only the explorer does
    return dict(model_factory=lambda cfg, machines: EngineModel(cfg, machines, engine_machine=compile_machine(spec)))


def _report_on_abort_after_done():
    """A rank whose recv was reported reports it again (failed) when the
    request is aborted: the worker's second report of one recv."""
    def change(e):
        if e.event is Abort and e.src in decode_request.FINISHED_RECV and e.src != "RUNNING":
            return attrs.evolve(e, actions=e.actions + (decode_request.report_aborted,))
        return e
    spec = _rows(decode_request, change)
    with pytest.raises(MachineDefinitionError):
        validate(with_timer_ignores(spec))
    return dict(machines={**MACHINES, "decode_request": compile_machine(spec, check=False)})


def _abort_before_alloc_aborts():
    """request_finished before allocation aborts the ranks' request instead of
    a notify-only load: the ranks stop heartbeating, nobody tells P."""
    def change(e):
        if e.src == ER.S.QUEUED and e.event is C.EngineFinished:
            return attrs.evolve(e, actions=tuple(ER.send_abort if a is ER.send_notify_only else a
                                                 for a in e.actions))
        return e
    spec = _rows(ER, change)
    validate(with_timer_ignores(spec))  # every resource still ends: only the explorer sees P's blocks held
    return dict(model_factory=lambda cfg, machines: EngineModel(cfg, machines, engine_machine=compile_machine(spec)))


def _finished_count_one():
    """The connector answers vLLM's get_finished_count with 1: vLLM finishes
    a request on the first rank's report."""
    return dict(model_factory=lambda cfg, machines: EngineModel(cfg, machines, finished_count=1))


# name -> (explore keywords that make the mutant, the configuration, the violations it must produce)
MUTATIONS = {
    "an awaited empty recv never reported": (
        _empty_recv_awaited, dict(ENGINE, requests=("hit",), max_faults=0, max_aborts=0, max_depth=8),
        {"liveness"}),
    "a recv reported twice": (
        _report_on_abort_after_done, dict(ENGINE, requests=("read",), max_faults=0, max_aborts=1, max_depth=9),
        {"report_twice"}),
    "an abort before allocation without a notify": (
        _abort_before_alloc_aborts, dict(ENGINE, requests=("read",), max_faults=0, max_aborts=1, max_depth=8),
        {"dropped_request_not_notified"}),
    "finished_sending before every rank ended its lease": (
        _finished_count_one, dict(ENGINE, requests=("read",), max_faults=0, max_aborts=0, max_depth=12),
        {"finished_sending_before_all_ranks"}),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(name, tmp_path):
    make, cfg, kinds = MUTATIONS[name]
    ok(explore(**cfg))  # the real machines pass the same configuration
    mutant = make()
    r = explore(**mutant, **cfg, stop_at_first=False)
    found = {v.kind for v in r.violations}
    assert kinds <= found, f"{name}: expected {kinds}, found {found}"
    for v in r.violations:
        # The engine's calls are the steps; every rank's log replays exactly.
        assert v.moves and set(v.logs) == {"P0", "P1", "D0", "D1"}, v
        for p in write_violation(v, str(tmp_path / v.kind)):
            res = replay(p, machines=mutant.get("machines"))
            assert res.divergence is None, res.divergence


def test_empty_recv_counterexample_names_the_request_vllm_waits_on():
    make, cfg, _ = MUTATIONS["an awaited empty recv never reported"]
    v = explore(**make(), **cfg).violations[0]
    assert "d0 is WAITING_FOR_REMOTE_KVS, and nothing will report its recv" in v.message
    assert any(m.startswith("D's engine matches and allocates request 0 (hit)") for m in v.moves)


def test_abort_before_alloc_counterexample_ends_with_the_lease_expiring():
    make, cfg, _ = MUTATIONS["an abort before allocation without a notify"]
    v = explore(**make(), **cfg).violations[0]
    assert v.kind == "dropped_request_not_notified" and "ended expired" in v.message
    assert any(m.startswith("D's engine aborts request 0") for m in v.moves)
    assert not any("allocates" in m for m in v.moves)


def test_tick_waits_for_the_workers_output():
    m = EngineModel(ExploreConfig(**ENGINE, requests=("read",)))
    w = m.initial()
    m.apply(w, EngineCall("prefill", 0))
    m.apply(w, EngineCall("alloc", 0))
    while w.net:
        m.apply(w, Deliver(0))
    assert w.inbox["D"] and Tick() not in m.moves(w) and WorkerOutput("D") in m.moves(w)


def test_cli_engine_option(capsys):
    assert cmd_explore(["--engine", "--requests", "read", "--depth", "8", "--faults", "0", "--quiet"]) == 0
    assert cmd_explore(["--engine", "--requests", "read2", "--quiet"]) == 2
    assert cmd_explore(["--engine", "--stall", "--quiet"]) == 2
