"""The ``transitions`` baselines, shaped so a ControlPlane can drive them.

``RefMachine`` wraps ``statemachines.reference.ReferenceMachine`` (one
``transitions.Machine`` per instance, the project's own second interpreter
of the same Spec).  ``SharedMachine`` is the cheapest way to use the library:
one ``transitions.Machine`` and one model per machine kind.  Both run the
same guards, effects and action builders as the compiled tables, so only the
dispatch differs.

The plane reads a few things from a machine (``new``, ``apply``,
``terminal_states``, ``states``, ``spec``) and from an instance (``state``,
``deadline`` and machine fields); the adapters provide exactly those.
"""
from __future__ import annotations

from typing import Any

from transitions import Machine as TMachine

from kvplane.statemachines.machines import SPECS
from kvplane.statemachines.reference import ReferenceMachine, RefInstance, RefModel
from kvplane.statemachines.spec import Spec


class RefMachine(ReferenceMachine):
    """(a): one transitions.Machine per request (the reference interpreter)."""

    def is_terminal(self, p) -> bool:
        return p.state in self.terminal_states


class SharedMachine(RefMachine):
    """(a'): transitions used its cheapest way: one ``transitions.Machine`` and
    one model per machine kind, the request's state swapped into the model
    before each event and read back after it.  No Machine is built per
    request and nothing is added to or removed from the Machine's model list
    (``add_model``/``remove_model`` scan it, O(models) each)."""

    def __init__(self, spec: Spec):
        super().__init__(spec)
        self._shared = RefInstance(None, RefModel())
        TMachine(model=self._shared.model, states=[s.name for s in self.spec.states], transitions=self._transitions,
                 initial=self.spec.initial, auto_transitions=False, send_event=False)

    def new(self, key: Any, **data: Any) -> RefInstance:
        return RefInstance(self.spec.instance_type(key=key, state=self.spec.initial, **data), None)

    def apply(self, p: RefInstance, event, config, now: float):
        # handle() goes through apply() too.
        shared = self._shared
        shared.inst = p.inst
        shared.model.state = p.inst.state  # swap the request's state in; apply() writes it back to p.inst
        try:
            return super().apply(shared, event, config, now)
        finally:
            shared.inst = None


def ref_machines() -> dict[str, RefMachine]:
    return {name: RefMachine(spec) for name, spec in SPECS.items()}


def shared_machines() -> dict[str, SharedMachine]:
    return {name: SharedMachine(spec) for name, spec in SPECS.items()}
