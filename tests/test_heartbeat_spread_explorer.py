"""The explorer on the spread heartbeat schedule, the plane's default.

The explorer's own profiles pin the lockstep schedule (whole-second sends,
the state counts docs/design-review.md states); here every lease and READ-gate
property is checked again with each engine on its phase grid, and the
injected bugs the schedule touches (a lease that never expires, a READ gate
that trusts a broken heartbeat chain, an engine evicted under a transfer)
are still found.
"""
from __future__ import annotations

import attrs
import pytest

from kvplane.statemachines.base import TimerFired
from kvplane.statemachines.explorer import EXPLORER_PLANE_CONFIG, STALL_FAULTS, explore
from kvplane.statemachines.machine import compile_machine
from kvplane.statemachines.machines import MACHINES, lease, remote_engine
from kvplane.statemachines.spec import Transition

from core_support import trusting_gate_machine

SPREAD = attrs.evolve(EXPLORER_PLANE_CONFIG, heartbeat_spread=True)


def kinds(result) -> list[str]:
    return [v.kind for v in result.violations]


def test_the_explorer_config_pins_lockstep_and_the_plane_default_is_spread():
    from kvplane.statemachines.config import PlaneConfig

    assert PlaneConfig().heartbeat_spread and not EXPLORER_PLANE_CONFIG.heartbeat_spread


@pytest.mark.parametrize("kw", [
    {},
    dict(requests=("read",), faults=STALL_FAULTS, skew=40.0, max_depth=14),
    dict(requests=("read", "read"), faults=frozenset({"stall"}), max_aborts=0, stall=3.5, max_depth=9),
    dict(requests=("read2",), skew=-8.0, max_depth=16),
], ids=["default", "stalls with skew", "two reads, stalls", "turn 2 with skew"])
def test_real_machines_pass_with_spread_heartbeats(kw):
    r = explore(plane=SPREAD, **kw)
    assert r.ok and not r.truncated, "\n".join(map(str, r.violations))


def test_a_lease_without_its_timer_is_found_with_spread_heartbeats():
    states = tuple(attrs.evolve(s, deadline=None) if s.name in lease.HELD else s for s in lease.STATES)
    machine = compile_machine(attrs.evolve(lease.SPEC, states=states), check=False)
    r = explore(machines={**MACHINES, "lease": machine}, requests=("read",), max_faults=0, max_depth=6, plane=SPREAD)
    assert "liveness" in kinds(r)


def test_a_read_gate_trusting_a_broken_chain_is_found_with_spread_heartbeats():
    stalls = dict(requests=("read",), faults=frozenset({"stall"}), max_aborts=0, max_depth=8, plane=SPREAD)
    assert explore(**stalls).ok
    r = explore(machines={**MACHINES, "decode_request": trusting_gate_machine()}, **stalls)
    assert "read_of_unheld_lease" in kinds(r)


def test_evicting_a_referenced_engine_is_found_with_spread_heartbeats():
    rows = tuple(e for e in remote_engine.TABLE
                 if not (isinstance(e, Transition) and e.src == "STALE" and e.event is TimerFired
                         and e.guard is remote_engine.referenced))
    machine = compile_machine(attrs.evolve(remote_engine.SPEC, table=rows))
    r = explore(machines={**MACHINES, "remote_engine": machine}, requests=("read",), faults=frozenset({"read_hang"}),
                max_aborts=0, max_depth=14, plane=SPREAD)
    assert "evicted_while_referenced" in kinds(r)
