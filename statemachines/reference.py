"""The same tables, interpreted by the ``transitions`` library.

``ReferenceMachine`` is a second, independent interpreter of a Spec (one
``transitions.Machine`` per instance), used to cross-check the compiled
dispatch and as the slow baseline in the benchmarks; it is not on the hot
path.  (The diagrams are drawn from the tables by ``render_machine``.)
"""
from __future__ import annotations

from typing import Any

from transitions import Machine as TMachine
from transitions import MachineError

from .machine import IGNORED, NoGuardMatched, ProtocolViolation, closing_errors, timer_action
from .spec import Ignore, ProtocolError, Spec, Transition, with_timer_ignores


class RefModel:
    """What one transitions.Machine drives: the instance plus the current stimulus."""


class ReferenceMachine:
    """Interprets a Spec with one ``transitions.Machine`` per instance."""

    def __init__(self, spec: Spec):
        self.spec = spec = with_timer_ignores(spec)
        self.name = spec.name
        self._states = {s.name: s for s in spec.states}
        self.states = self._states
        self.terminal_states = frozenset(s.name for s in spec.states if s.terminal)
        self._no_guard = closing_errors(spec)
        self._outcome = {(e.src, e.event): e for e in spec.table
                         if not isinstance(e, Transition) and (e.src, e.event) not in self._no_guard}
        self._transitions = [
            {
                "trigger": t.event.__name__,
                "source": t.src,
                "dest": t.dest,
                "conditions": [self._guard(t)] if t.guard is not None else [],
                "after": [self._after(t)],
            }
            for t in spec.table
            if isinstance(t, Transition)
        ]

    @staticmethod
    def _guard(t: Transition):
        guard = t.guard
        assert guard is not None  # only a guarded row gets a condition
        return lambda m: guard(m.inst, m.event, m.config, m.now)

    @staticmethod
    def _after(t: Transition):
        def after(m):
            if t.effect is not None:
                t.effect(m.inst, m.event, m.config, m.now)
            m.actions.extend(a.build(m.inst, m.event, m.config, m.now) for a in t.actions)

        return after

    def new(self, key: Any, **data: Any) -> "RefInstance":
        inst = self.spec.instance_type(key=key, state=self.spec.initial, **data)
        model = RefModel()
        TMachine(model=model, states=[s.name for s in self.spec.states], transitions=self._transitions,
                 initial=inst.state, auto_transitions=False, send_event=False)
        return RefInstance(inst, model)

    def handle(self, ref: "RefInstance", event, config, now: float):
        """Same contract as ``Machine.handle``: actions, then the timer action."""
        old_deadline = ref.inst.deadline
        actions = self.apply(ref, event, config, now)
        if actions is not IGNORED:
            timer = timer_action(self.name, ref.inst.key, old_deadline, ref.inst.deadline)
            if timer is not None:
                actions.append(timer)
        return actions

    def apply(self, ref: "RefInstance", event, config, now: float):
        """Same contract as ``Machine.apply`` (the ControlPlane's entry point,
        which arms timers from ``inst.deadline``): no timer action."""
        inst, model = ref.inst, ref.model
        outcome = self._outcome.get((model.state, type(event)))
        if isinstance(outcome, Ignore):
            return IGNORED
        if isinstance(outcome, ProtocolError):
            raise ProtocolViolation(self.name, inst.key, model.state, event, outcome.reason)
        model.inst, model.event, model.config, model.now, model.actions = inst, event, config, now, []
        try:
            fired = model.trigger(type(event).__name__, model)
        except MachineError as exc:
            raise ProtocolViolation(self.name, inst.key, model.state, event, str(exc)) from None
        finally:
            actions = model.actions
            del model.inst, model.event, model.config, model.actions  # pin nothing between events
        if not fired:
            reason = self._no_guard.get((model.state, type(event)))
            if reason is None:
                raise NoGuardMatched(self.name, inst.key, model.state, event, "no guard matched")
            raise ProtocolViolation(self.name, inst.key, model.state, event, reason)
        inst.state = model.state
        dl = self._states[inst.state].deadline
        inst.deadline = None if dl is None else dl(inst, config, now)
        return actions


class RefInstance:
    """An instance as a ControlPlane sees it: the attrs record (its fields
    read through) plus the transitions model that drives it."""

    __slots__ = ("inst", "model")

    def __init__(self, inst, model):
        self.inst, self.model = inst, model

    @property
    def state(self) -> str:
        return self.inst.state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inst, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # The plane writes the record's fields too (its timer entry, a
        # deadline it had to replace): they go through to the record.
        if name in RefInstance.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inst, name, value)
