"""Validation of how machines are put together (``composition``): the
cross-machine counterpart of ``validate``.

Checks, each reported with the machine, event or action at fault:
- every event a machine handles is addressed to it: its ``machine`` names
  that machine, or it is routed by its ``kind`` field; its ``key_field`` is
  one of its fields;
- every machine is created by at least one event (``Spec.created_by``), each
  in its alphabet, addressed to it and a transition from its initial state;
  no event creates two machines;
- every internal action a table emits has exactly one wire, unless the
  plane executes it itself; every wire's action is internal;
- a wire's event is in its target machine's alphabet (for a fan-out to
  requesters: of every machine that emits the acquiring action), and its
  fields name the event's fields, cover every required one, and read only
  fields that exist (of the action, the config, the target instance).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import attrs

from .composition import (
    WIRES, ActionField, ConfigField, EngineField, HeartbeatChain, Requesters, RequesterKey, RequesterKind,
    TargetField, Wire,
)
from .config import PlaneConfig
from .base import Action, Event
from .base import fields as fields_of
from .spec import MachineDefinitionError, Spec, Transition


def creators(specs: dict[str, Spec]) -> dict[type[Event], str]:
    """Event class -> the machine kind it creates."""
    return {ev: name for name, spec in specs.items() for ev in spec.created_by}


def emitted(spec: Spec) -> set[type[Action]]:
    """The action classes a machine's table emits."""
    return {a.action for t in spec.table if isinstance(t, Transition) for a in t.actions}


def validate_composition(specs: dict[str, Spec], wires: Iterable[Wire] = WIRES) -> None:
    errors: list[str] = []
    err = errors.append
    wires = tuple(wires)
    for name, spec in specs.items():
        _check_addresses(name, spec, err)
        _check_creation(name, spec, err)
    created = Counter(ev for spec in specs.values() for ev in set(spec.created_by))
    for ev, n in sorted(created.items(), key=lambda x: x[0].__name__):
        if n > 1:
            makers = sorted(name for name, spec in specs.items() if ev in spec.created_by)
            err(f"{ev.__name__} creates more than one machine: {', '.join(makers)}")

    wired = Counter(w.action for w in wires)
    for action, n in wired.items():
        if n > 1:
            err(f"{action.__name__}: wired {n} times (an internal action has exactly one wire)")
    for name, spec in specs.items():
        for action in sorted(emitted(spec), key=lambda a: a.__name__):
            if not action.internal:
                continue
            if action not in wired:
                err(f"{name}: emits the internal action {action.__name__}, which no wire delivers")
    for w in wires:
        _check_wire(w, specs, err)

    if errors:
        raise MachineDefinitionError("machine composition is invalid:\n  " + "\n  ".join(errors))


def _field_names(cls: type) -> set[str]:
    return {f.name for f in fields_of(cls)}


def _check_addresses(name: str, spec: Spec, err) -> None:
    for ev in spec.events:
        fields = _field_names(ev)
        if ev.machine and ev.machine != name:
            err(f"{name}: handles {ev.__name__}, which is addressed to {ev.machine!r}")
        if not ev.machine and "kind" not in fields:
            err(f"{name}: {ev.__name__} names no machine and has no kind field to route by")
        if ev.key_field not in fields:
            err(f"{name}: {ev.__name__}'s key field {ev.key_field!r} is not one of its fields")


def _check_creation(name: str, spec: Spec, err) -> None:
    if not spec.created_by:
        err(f"{name}: no event creates it (declare created_by)")
    for ev in spec.created_by:
        where = f"{name}: created by {ev.__name__}"
        if ev not in spec.events:
            err(f"{where}, which is not in its events")
            continue
        if ev.machine != name:
            err(f"{where}, which is not addressed to it (machine {ev.machine!r})")
        rows = [e for e in spec.table if e.src == spec.initial and e.event is ev]
        if not rows or not all(isinstance(e, Transition) for e in rows):
            err(f"{where}: {spec.initial} x {ev.__name__} must be a transition")


def _check_wire(w: Wire, specs: dict[str, Spec], err) -> None:
    where = f"wire {w.action.__name__} -> {w.event.__name__}"
    if not w.action.internal:
        err(f"{where}: {w.action.__name__} is not an internal action")
    action_fields, event_fields = _field_names(w.action), _field_names(w.event)
    target = w.target
    fanout = isinstance(target, Requesters)
    if isinstance(target, Requesters):
        if w.event.machine:
            err(f"{where}: a fan-out to requesters needs an event routed by kind, not one for {w.event.machine!r}")
        if target.field not in action_fields:
            err(f"{where}: the action has no requesters field {target.field!r}")
        targets = sorted(name for name, spec in specs.items() if target.acquired_by in emitted(spec))
        if not targets:
            err(f"{where}: no machine emits {target.acquired_by.__name__}, so nobody is a requester")
    else:
        targets = [target]
        if target not in specs:
            err(f"{where}: target {target!r} is not a machine of this plane")
            targets = []
        elif w.event.machine != target:
            err(f"{where}: the event is addressed to {w.event.machine!r}, not to {target!r}")
    for target in targets:
        if w.event not in specs[target].events:
            err(f"{where}: {w.event.__name__} is not in {target}'s events")

    names = [field for field, _ in w.fields]
    for field, n in Counter(names).items():
        if n > 1:
            err(f"{where}: field {field!r} given {n} times")
    for field in sorted(set(names) - event_fields):
        err(f"{where}: {w.event.__name__} has no field {field!r}")
    required = {f.name for f in fields_of(w.event) if f.default is attrs.NOTHING}
    for field in sorted(required - set(names)):
        err(f"{where}: required field {field!r} is not given")
    config_fields = _field_names(PlaneConfig)
    for field, source in w.fields:
        at = f"{where}: {field}"
        if isinstance(source, ActionField) and source.name not in action_fields:
            err(f"{at}: {w.action.__name__} has no field {source.name!r}")
        elif isinstance(source, ConfigField) and source.name not in config_fields:
            err(f"{at}: PlaneConfig has no field {source.name!r}")
        elif isinstance(source, TargetField):
            if fanout:
                err(f"{at}: a fan-out has no single target instance to read")
            elif w.target in specs and source.name not in _field_names(specs[w.target].instance_type):
                err(f"{at}: {w.target} instances have no field {source.name!r}")
            if field == w.event.key_field:
                err(f"{at}: the target's id cannot come from the target")
        elif isinstance(source, (RequesterKind, RequesterKey)) and not fanout:
            err(f"{at}: {type(source).__name__} outside a fan-out to requesters")
        elif isinstance(source, HeartbeatChain) and "engine_id" not in action_fields:
            err(f"{at}: the heartbeat chain is per engine, and {w.action.__name__} names none")
        elif isinstance(source, EngineField):
            if "engine_id" not in action_fields:
                err(f"{at}: {w.action.__name__} names no engine to read {source.name!r} of")
            elif "remote_engine" in specs and source.name not in _field_names(specs["remote_engine"].instance_type):
                err(f"{at}: remote_engine instances have no field {source.name!r}")
    if fanout:
        given = dict(w.fields)
        if not isinstance(given.get("kind"), RequesterKind) or not isinstance(given.get(w.event.key_field),
                                                                              RequesterKey):
            err(f"{where}: a fan-out addresses each event by RequesterKind (kind) and RequesterKey "
                f"({w.event.key_field})")
    if w.only_if_live and fanout:
        err(f"{where}: only_if_live needs a single target")
