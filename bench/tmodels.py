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

from kvplane.statemachines.machines import SPECS
from kvplane.statemachines.reference import ReferenceMachine, RefInstance, RefModel
from kvplane.statemachines.spec import Spec


class RefMachine(ReferenceMachine):
    """(a): one transitions.Machine per request (the reference interpreter)."""

    def is_terminal(self, p) -> bool:
        return p.state in self.terminal_states


class SharedMachine(RefMachine):
    """(a'): one transitions.Machine for every instance of a kind (``add_model``)."""

    def __init__(self, spec: Spec):
        super().__init__(spec)
        self.machine = TMachine(model=None, states=[s.name for s in self.spec.states], transitions=self._transitions,
                                initial=self.spec.initial, auto_transitions=False, send_event=False)

    def new(self, key: Any, **data: Any) -> RefInstance:
        inst = self.spec.instance_type(key=key, state=self.spec.initial, **data)
        model = RefModel()
        self.machine.add_model(model, initial=inst.state)
        return RefInstance(inst, model)

    def apply(self, p: RefInstance, event, config, now: float):
        # handle() goes through apply() too.
        actions = super().apply(p, event, config, now)
        if p.state in self.terminal_states:
            # transitions keeps models in a list: removal is O(models).
            self.machine.remove_model(p.model)
        return actions


def ref_machines() -> dict[str, RefMachine]:
    return {name: RefMachine(spec) for name, spec in SPECS.items()}


def shared_machines() -> dict[str, SharedMachine]:
    return {name: SharedMachine(spec) for name, spec in SPECS.items()}
