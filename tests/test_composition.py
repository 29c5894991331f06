"""The composition (which event creates which machine, and every
cross-machine wire) is checked against the machines' alphabets, and the
plane executes exactly what it declares."""
from __future__ import annotations

import attrs
import pytest

from kvplane.statemachines import actions as A
from kvplane.statemachines import events as E
from kvplane.statemachines.composition import WIRES, ActionField, Const, Wire
from kvplane.statemachines.machines import SPECS
from kvplane.statemachines.plane import ControlPlane
from kvplane.statemachines.render_composition import render_composition_mermaid
from kvplane.statemachines.spec import MachineDefinitionError
from kvplane.statemachines.validate_composition import creators, validate_composition


def errors_of(specs=SPECS, wires=WIRES) -> list[str]:
    with pytest.raises(MachineDefinitionError) as info:
        validate_composition(specs, wires)
    return [line.strip() for line in str(info.value).splitlines()[1:]]


def with_spec(name, **changes):
    return {**SPECS, name: attrs.evolve(SPECS[name], **changes)}


def without_wire(action):
    return tuple(w for w in WIRES if w.action is not action)


def test_the_real_composition_is_valid():
    validate_composition(SPECS)


def test_routing_is_derived_from_the_specs():
    assert creators(SPECS) == {
        E.NewRequest: "decode_request", E.LeaseGranted: "lease", E.PushRegistered: "push_write",
        E.PushReady: "push_write", E.EngineAcquire: "remote_engine", E.HeartbeatRegister: "heartbeat",
    }


def test_an_event_creating_two_machines_is_refused():
    specs = with_spec("lease", created_by=(E.LeaseGranted, E.NewRequest))
    errs = errors_of(specs)
    assert "NewRequest creates more than one machine: decode_request, lease" in errs
    assert "lease: created by NewRequest, which is not in its events" in errs


def test_a_machine_nothing_creates_is_refused():
    assert errors_of(with_spec("lease", created_by=())) == ["lease: no event creates it (declare created_by)"]


def test_a_creating_event_must_be_a_transition_from_the_initial_state():
    specs = with_spec("lease", created_by=(E.LeaseGranted, E.LeaseHeartbeat))
    assert errors_of(specs) == ["lease: created by LeaseHeartbeat: PREFILLING x LeaseHeartbeat must be a transition"]


def test_an_event_addressed_to_another_machine_is_refused():
    spec = SPECS["lease"]
    specs = with_spec("lease", events=spec.events + (E.StartLoad,))
    assert "lease: handles StartLoad, which is addressed to 'decode_request'" in errors_of(specs)


def test_every_internal_action_has_exactly_one_wire():
    assert errors_of(wires=without_wire(A.GrantHold)) == [
        "decode_request: emits the internal action GrantHold, which no wire delivers"]
    twice = WIRES + tuple(w for w in WIRES if w.action is A.NoteActivity)
    assert errors_of(wires=twice) == ["NoteActivity: wired 2 times (an internal action has exactly one wire)"]
    # Heartbeat registration is a wire like the others.
    assert [w.target for w in WIRES if w.action is A.StartHeartbeat] == ["heartbeat"]


def test_a_wired_event_must_be_in_the_target_alphabet():
    spec = SPECS["push_write"]
    specs = with_spec("push_write", events=tuple(e for e in spec.events if e is not E.EngineReady))
    assert "wire WakeRequesters -> EngineReady: EngineReady is not in push_write's events" in errors_of(specs)


def test_a_wire_must_give_every_required_field_from_fields_that_exist():
    grant = next(w for w in WIRES if w.action is A.GrantHold)
    broken = attrs.evolve(grant, fields=tuple((f, s) for f, s in grant.fields if f != "request_id")
                          + (("blocks", ActionField("block_ids")), ("duration", Const(1.0))))
    errs = errors_of(wires=without_wire(A.GrantHold) + (broken,))
    assert errs == [
        "wire GrantHold -> LeaseGranted: field 'duration' given 2 times",
        "wire GrantHold -> LeaseGranted: LeaseGranted has no field 'blocks'",
        "wire GrantHold -> LeaseGranted: required field 'request_id' is not given",
    ]
    wrong = Wire(A.GrantHold, "remote_engine", E.LeaseGranted, grant.fields)
    assert "wire GrantHold -> LeaseGranted: the event is addressed to 'lease', not to 'remote_engine'" in \
        errors_of(wires=without_wire(A.GrantHold) + (wrong,))


def test_a_plane_refuses_an_invalid_composition():
    from kvplane.statemachines.machines import MACHINES
    from kvplane.statemachines.machine import compile_machine

    broken = compile_machine(attrs.evolve(SPECS["lease"], created_by=()))
    with pytest.raises(MachineDefinitionError, match="no event creates it"):
        ControlPlane(machines={**MACHINES, "lease": broken})


def test_the_grant_hold_wire_is_executed_from_its_data():
    from kvplane.statemachines.config import PlaneConfig

    plane = ControlPlane(PlaneConfig(decoder_kv_blocks_ttl=100.0))
    queue: list = []
    plane._internal[A.GrantHold](plane, A.GrantHold("r1", (3, 4)), 0.0, queue)
    assert queue == [E.LeaseGranted(request_id="r1", block_ids=(3, 4), expected_consumers=1, duration=100.0,
                                    renewable=False)]


def test_every_wire_is_drawn():
    text = render_composition_mermaid(SPECS)
    for w in WIRES:
        assert f"{w.action.__name__} → {w.event.__name__}" in text
    for name, spec in SPECS.items():
        assert f'{name}["{name}<br/>created by {", ".join(e.__name__ for e in spec.created_by)}"]' in text
