"""The ``python-statemachine`` baseline, shaped so a ControlPlane can drive it.

Each Spec becomes a ``StateMachine`` subclass (states, and per event class
one event made of the table's transitions in table order, guards as
``cond``, effect and action builders as ``on``), and each request gets its
own instance of it, the library's documented way.  Declared ignores and
protocol errors are answered before the library is asked, as
``ReferenceMachine`` does for transitions; the guards, effects and builders
are the tables' own, so only the dispatch differs.

Optional (``pip install -e '.[bench]'``): ``AVAILABLE`` says whether the
library imports; the bench sections skip this anchor with a line when not.
"""
from __future__ import annotations

from typing import Any

from kvplane.statemachines.machine import IGNORED, NoGuardMatched, ProtocolViolation, closing_errors
from kvplane.statemachines.machines import SPECS
from kvplane.statemachines.reference import RefInstance
from kvplane.statemachines.spec import Ignore, ProtocolError, Spec, Transition, transitions_of, with_timer_ignores

try:
    from statemachine import State, StateMachine
    from statemachine.exceptions import TransitionNotAllowed
    import statemachine as _psm

    AVAILABLE = True
    VERSION = getattr(_psm, "__version__", "?")
except ImportError:  # the bench extra is not installed
    AVAILABLE = False
    VERSION = None

MISSING = "python-statemachine is not installed (pip install -e '.[bench]'): its anchor is skipped"


def _cond(t: Transition):
    guard = t.guard
    assert guard is not None

    def cond(inst, ev, cfg, now):  # arguments injected by name from send()
        return guard(inst, ev, cfg, now)

    return cond


def _on(t: Transition):
    effect, builders = t.effect, tuple(a.build for a in t.actions)

    def on(inst, ev, cfg, now, acts):
        if effect is not None:
            effect(inst, ev, cfg, now)
        acts.extend(b(inst, ev, cfg, now) for b in builders)

    return on


def machine_class(spec: Spec) -> type:
    """A StateMachine subclass with the spec's states and transitions."""
    states = {s.name: State(s.name, value=s.name, initial=s.name == spec.initial, final=s.terminal)
              for s in spec.states}
    events: dict[str, Any] = {}
    for t in transitions_of(spec):
        kw: dict[str, Any] = {"on": _on(t)}
        if t.guard is not None:
            kw["cond"] = _cond(t)
        tl = states[t.src].to(states[t.dest], **kw)
        name = t.event.__name__
        events[name] = tl if name not in events else events[name] | tl
    namespace: dict[str, Any] = {f"state_{name}": st for name, st in states.items()}
    namespace.update(events)
    return type(f"PSM_{spec.name}", (StateMachine,), namespace)


class PSMMachine:
    """One python-statemachine instance per request."""

    def __init__(self, spec: Spec):
        self.spec = spec = with_timer_ignores(spec)
        self.name = spec.name
        self.states = {s.name: s for s in spec.states}
        self.terminal_states = frozenset(s.name for s in spec.states if s.terminal)
        self._no_guard = closing_errors(spec)
        self._outcome = {(e.src, e.event): e for e in spec.table
                         if not isinstance(e, Transition) and (e.src, e.event) not in self._no_guard}
        self._cls = machine_class(spec)

    def new(self, key: Any, **data: Any) -> RefInstance:
        return RefInstance(self.spec.instance_type(key=key, state=self.spec.initial, **data), self._cls())

    def is_terminal(self, p: RefInstance) -> bool:
        return p.state in self.terminal_states

    def handle(self, p: RefInstance, event, config, now: float):
        return self.apply(p, event, config, now)

    def apply(self, p: RefInstance, event, config, now: float):
        inst, sm = p.inst, p.model
        outcome = self._outcome.get((inst.state, type(event)))
        if outcome.__class__ is Ignore:
            return IGNORED
        if outcome.__class__ is ProtocolError:
            raise ProtocolViolation(self.name, inst.key, inst.state, event, outcome.reason)
        acts: list = []
        try:
            sm.send(type(event).__name__, inst=inst, ev=event, cfg=config, now=now, acts=acts)
        except TransitionNotAllowed:
            reason = self._no_guard.get((inst.state, type(event)))
            if reason is None:
                raise NoGuardMatched(self.name, inst.key, inst.state, event, "no guard matched") from None
            raise ProtocolViolation(self.name, inst.key, inst.state, event, reason) from None
        inst.state = sm.current_state_value
        dl = self.states[inst.state].deadline
        inst.deadline = None if dl is None else dl(inst, config, now)
        return acts


def psm_machines() -> dict[str, PSMMachine]:
    return {name: PSMMachine(spec) for name, spec in SPECS.items()}
