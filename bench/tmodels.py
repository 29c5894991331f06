"""The ``transitions`` baselines, shaped so a ControlPlane can drive them.

``RefMachine`` wraps ``statemachines.reference.ReferenceMachine`` (one
``transitions.Machine`` per instance, the project's own second interpreter
of the same Spec).  ``SharedMachine`` is the cheaper way to use the library:
one ``transitions.Machine`` per machine kind, each request added as a model
(``add_model``) and removed when it reaches a terminal state.  Both run the
same guards, effects and action builders as the compiled tables, so only the
dispatch differs.

The plane reads a few things from a machine (``new``, ``apply``,
``terminal_states``, ``states``, ``spec``) and from an instance (``state``,
``deadline`` and machine fields); the adapters provide exactly those.
"""
from __future__ import annotations

from typing import Any

from transitions import Machine as TMachine
from transitions import MachineError

from statemachines.base import ArmTimer, CancelTimer
from statemachines.machines import SPECS
from statemachines.reference import ReferenceMachine
from statemachines.spec import IGNORED, Ignore, NoGuardMatched, ProtocolViolation, Spec, Transition, with_timer_ignores


class _Proxy:
    """An instance as the plane sees it: the attrs record, plus the model."""

    __slots__ = ("inst", "model")

    def __init__(self, inst, model):
        self.inst, self.model = inst, model

    @property
    def state(self) -> str:
        return self.inst.state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inst, name)


class RefMachine:
    def __init__(self, spec: Spec):
        self.ref = ReferenceMachine(spec)
        self.spec = self.ref.spec
        self.name = spec.name
        self.states = {s.name: s for s in self.spec.states}
        self._terminal = frozenset(s.name for s in self.spec.states if s.terminal)

    def new(self, key: Any, **data: Any) -> _Proxy:
        r = self.ref.new(key, **data)
        return _Proxy(r.inst, r.model)

    def handle(self, p: _Proxy, event, config, now: float):
        return self.ref.handle(p, event, config, now)

    def apply(self, p: _Proxy, event, config, now: float):
        # The plane's entry point; it arms timers from inst.deadline, and
        # the ArmTimer actions handle() adds are harmless duplicates there.
        return self.handle(p, event, config, now)

    @property
    def terminal_states(self) -> frozenset:
        return self._terminal

    def is_terminal(self, p) -> bool:
        return p.state in self._terminal


class _Model:
    __slots__ = ("__dict__",)


class SharedMachine(RefMachine):
    """One transitions.Machine for every instance of a kind (``add_model``)."""

    def __init__(self, spec: Spec):
        spec = with_timer_ignores(spec)
        self.spec = spec
        self.name = spec.name
        self.states = {s.name: s for s in spec.states}
        self._terminal = frozenset(s.name for s in spec.states if s.terminal)
        self._outcome = {(e.src, e.event): e for e in spec.table if not isinstance(e, Transition)}
        trans = [
            {"trigger": t.event.__name__, "source": t.src, "dest": t.dest,
             "conditions": [_guard(t)] if t.guard is not None else [], "after": [_after(t)]}
            for t in spec.table if isinstance(t, Transition)
        ]
        self.machine = TMachine(model=None, states=[s.name for s in spec.states], transitions=trans,
                                initial=spec.initial, auto_transitions=False, send_event=False)

    def new(self, key: Any, **data: Any) -> _Proxy:
        inst = self.spec.instance_type(key=key, state=self.spec.initial, **data)
        model = _Model()
        self.machine.add_model(model, initial=inst.state)
        return _Proxy(inst, model)

    def handle(self, p: _Proxy, event, config, now: float):
        inst, model = p.inst, p.model
        outcome = self._outcome.get((model.state, type(event)))
        if outcome is not None:
            if outcome.__class__ is Ignore:
                return IGNORED
            raise ProtocolViolation(self.name, inst.key, model.state, event, outcome.reason)
        model.inst, model.event, model.config, model.now, model.actions = inst, event, config, now, []
        old_deadline = inst.deadline
        try:
            fired = model.trigger(type(event).__name__, model)
        except MachineError as exc:
            raise ProtocolViolation(self.name, inst.key, model.state, event, str(exc)) from None
        if not fired:
            raise NoGuardMatched(self.name, inst.key, model.state, event, "no guard matched")
        inst.state = model.state
        actions = model.actions
        del model.inst, model.event, model.config, model.actions  # do not pin them between events
        dl = self.states[inst.state].deadline
        if dl is not None:
            at = dl(inst, config, now)
            if at != old_deadline:
                inst.deadline = at
                actions.append(ArmTimer(self.name, inst.key, at))
        elif old_deadline is not None:
            inst.deadline = None
            actions.append(CancelTimer(self.name, inst.key))
        if inst.state in self._terminal:
            # transitions keeps models in a list: removal is O(models).
            self.machine.remove_model(model)
        return actions


def _guard(t: Transition):
    return lambda m: t.guard(m.inst, m.event, m.config, m.now)


def _after(t: Transition):
    def after(m):
        if t.effect is not None:
            t.effect(m.inst, m.event, m.config, m.now)
        m.actions.extend(a.build(m.inst, m.event, m.config, m.now) for a in t.actions)

    return after


def ref_machines() -> dict[str, RefMachine]:
    return {name: RefMachine(spec) for name, spec in SPECS.items()}


def shared_machines() -> dict[str, SharedMachine]:
    return {name: SharedMachine(spec) for name, spec in SPECS.items()}
