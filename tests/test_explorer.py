"""The explorer passes the real machines and finds each historical bug class
injected into a copy of a spec, with a replayable shortest counterexample."""
from __future__ import annotations


import attrs
import pytest

from statemachines.base import TimerFired
from statemachines.eventlog import read_log
from statemachines.events import EngineActivity, EngineReady
from statemachines.explorer import ExploreConfig, clone_plane, explore
from statemachines.machines import MACHINES, SPECS, decode_request, lease, remote_engine
from statemachines.plane import ControlPlane
from statemachines.replay import replay
from statemachines.spec import Ignore, MachineDefinitionError, Transition, compile_machine, with_timer_ignores
from statemachines.validate import validate


def compile_unchecked(spec):
    """compile_machine without validation: for bugs the validator would refuse."""
    return compile_machine(spec, check=False)


def with_machine(name, machine):
    return {**MACHINES, name: machine}


def assert_found(result, kind):
    kinds = [v.kind for v in result.violations]
    assert kind in kinds, f"expected {kind}, found {kinds}"
    v = result.violations[kinds.index(kind)]
    assert v.moves and v.logs["D"], v
    # Each plane's log replays exactly into a fresh plane with the same machines.
    return v


def test_real_machines_pass_the_default_configuration():
    r = explore()
    assert r.ok, "\n".join(map(str, r.violations))
    assert r.states > 1000 and not r.truncated


def test_real_machines_pass_turn2_with_skew_and_faults():
    r = explore(requests=("read2",), skew=-8.0, max_depth=16)
    assert r.ok, "\n".join(map(str, r.violations))


def test_symmetry_reduction_merges_interchangeable_requests():
    with_sym = explore(requests=("read", "read"), max_depth=8)
    without = explore(requests=("read", "read"), max_depth=8, symmetry=False)
    assert with_sym.ok and without.ok
    assert with_sym.states < without.states


# ------------------------------------------------------------ bug 1: FPH report dropped
def _drop_fph_report():
    rows = []
    for e in decode_request.TABLE:
        if isinstance(e, Transition) and e.src == "HANDSHAKING" and e.event is EngineReady and e.dest == "RECV_DONE":
            e = attrs.evolve(e, actions=tuple(a for a in e.actions if a.__name__ != "ReportRecv"))
        rows.append(e)
    return attrs.evolve(decode_request.SPEC, table=tuple(rows))


def test_bug_full_prefix_hit_report_dropped():
    spec = _drop_fph_report()
    with pytest.raises(MachineDefinitionError, match="report"):
        validate(with_timer_ignores(spec))
    r = explore(machines=with_machine("decode_request", compile_unchecked(spec)), requests=("hit",), max_faults=0,
                max_aborts=0, max_depth=8)
    v = assert_found(r, "liveness")
    assert "never reported" in v.message


# ------------------------------------------------------------ bug 2: lease never expires
def test_bug_lease_without_timer():
    states = tuple(attrs.evolve(s, deadline=None) if s.name in lease.HELD else s for s in lease.STATES)
    spec = attrs.evolve(lease.SPEC, states=states)
    with pytest.raises(MachineDefinitionError, match="no deadline"):
        validate(with_timer_ignores(spec))
    r = explore(machines=with_machine("lease", compile_unchecked(spec)), requests=("read",), max_faults=0,
                max_depth=6)
    v = assert_found(r, "liveness")
    assert "lease:p0 still holds ['blocks']" in v.message


# ------------------------------------------------------------ bug 3: activity ignored
def test_bug_engine_activity_ignored():
    rows = []
    for e in remote_engine.TABLE:
        if isinstance(e, Transition) and e.event is EngineActivity:
            e = Ignore(e.src, EngineActivity, "liveness refreshed only at handshake")
        rows.append(e)
    spec = attrs.evolve(remote_engine.SPEC, table=tuple(rows))
    machine = compile_machine(spec)  # the validator cannot see this one
    r = explore(machines=with_machine("remote_engine", machine), requests=("read",), max_faults=0, max_depth=12)
    assert_found(r, "stale_despite_activity")


# ------------------------------------------------------------ bug 4: turn-2 offset ignored
def test_bug_turn2_deadline_without_clock_offset():
    def expired_no_offset(r, ev, cfg, now):
        """remote expiry <= now + margin (offset forgotten)"""
        return r.remote_expiry is not None and r.remote_expiry <= now + cfg.expiry_safety_margin

    rows = tuple(attrs.evolve(e, guard=expired_no_offset)
                 if isinstance(e, Transition) and e.guard is decode_request.remote_blocks_expired else e
                 for e in decode_request.TABLE)
    machine = compile_machine(attrs.evolve(decode_request.SPEC, table=rows))
    r = explore(machines=with_machine("decode_request", machine), requests=("read2",), skew=-8.0, max_faults=0,
                max_aborts=0, max_depth=18)
    assert_found(r, "turn2_read_of_expired_blocks")


# ------------------------------------------------------------ bug 5: evict referenced engine
def test_bug_evict_engine_with_transfer_in_flight():
    rows = tuple(e for e in remote_engine.TABLE
                 if not (isinstance(e, Transition) and e.src == "STALE" and e.event is TimerFired
                         and e.guard is remote_engine.referenced))
    machine = compile_machine(attrs.evolve(remote_engine.SPEC, table=rows))
    r = explore(machines=with_machine("remote_engine", machine), requests=("read",), faults=frozenset({"read_hang"}),
                max_aborts=0, max_depth=14)
    assert_found(r, "evicted_while_referenced")


def test_counterexample_logs_replay_exactly(tmp_path):
    states = tuple(attrs.evolve(s, deadline=None) if s.name in lease.HELD else s for s in lease.STATES)
    machines = with_machine("lease", compile_unchecked(attrs.evolve(lease.SPEC, states=states)))
    r = explore(machines=machines, requests=("read",), max_faults=0, max_depth=6)
    v = r.violations[0]
    paths = v.write(str(tmp_path / "cex"))
    assert len(paths) == 2
    for p in paths:
        log = read_log(p)
        assert log.config is not None and log.records
        res = replay(p, machines=machines)
        assert res.divergence is None, res.divergence
    # With the real lease machine the same stimuli diverge: the grant arms a timer.
    res = replay(str(tmp_path / "cex.P.jsonl"))
    assert res.divergence is not None and res.divergence.what == "actions"
    assert "ArmTimer" in str(res.divergence.got)


def test_clone_plane_is_independent():
    from statemachines import events as E

    p = ControlPlane()
    p.handle(E.NewRequest(request_id="r", engine_id="e", remote_request_id="x"), 0.0)
    q = clone_plane(p)
    q.handle(E.HandshakeOk(engine_id="e"), 1.0)
    assert p.get("remote_engine", "e").state == "HANDSHAKING"
    assert q.get("remote_engine", "e").state == "CONNECTED"
    assert p.get("remote_engine", "e").refs is not q.get("remote_engine", "e").refs
