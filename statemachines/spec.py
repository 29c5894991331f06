"""Declarative machine specs, compiled into a dict dispatch.

A machine is data: states (terminal or not, the resources each holds, an
optional deadline), events (attrs frozen classes), and one table entry per
(state, event) pair: guarded transitions, an ignore with a reason, or a
protocol error.  ``machine.compile_machine`` validates a spec (see
``validate``) and compiles it into a ``Machine``; this module only declares.

Deadlines are part of the framework, not of each transition: entering a
state with a deadline arms the instance's timer, leaving it cancels it.  A
waiting state therefore cannot forget its timer.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Iterable

import attrs

from .base import Action, Event, TimerFired

Guard = Callable[[Any, Any, Any, float], bool]
Effect = Callable[[Any, Any, Any, float], None]
DeadlineFn = Callable[[Any, Any, float], float]


# Typed converters: ``converter=frozenset`` leaves the element type unsolved for mypy.
def _names(items: Iterable[str]) -> frozenset[str]:
    return frozenset(items)


def _state(name: str) -> str:
    """A state name as a plain str.  Tables name states through each
    machine's StrEnum; the compiled machine and every instance keep the plain
    value, which compares and hashes the same but without Enum's Python-level
    ``__hash__`` on every dispatch."""
    return name.value if isinstance(name, Enum) else name


def _state_names(items: Iterable[str]) -> frozenset[str]:
    return frozenset(_state(s) for s in items)


def _action_classes(items: Iterable[type[Action]]) -> frozenset[type[Action]]:
    return frozenset(items)


@attrs.frozen
class State:
    name: str = attrs.field(converter=_state)
    terminal: bool = False
    # Resources held while in this state (e.g. "blocks", "xfer", "engine_ref").
    holds: frozenset[str] = attrs.field(default=frozenset(), converter=_names)
    # True when the state waits on a remote party; such a state needs a deadline.
    waits_on_remote: bool = False
    # deadline(instance, config, now) -> absolute time; evaluated on every
    # transition into (or within) the state, so an effect that moves it re-arms.
    deadline: DeadlineFn | None = None
    doc: str = ""


@attrs.frozen
class Transition:
    src: str = attrs.field(converter=_state)
    event: type[Event] = attrs.field()
    dest: str = attrs.field(converter=_state)
    guard: Guard | None = None
    guard_doc: str = ""
    effect: Effect | None = None
    # What the transition emits, in order: ``Emit`` records (the action class
    # and the machine-local ``build(instance, event, config, now)``).
    actions: tuple = ()
    # Resources the transition takes on beyond what its event and actions
    # declare (e.g. the duty to report a recv that the scheduler awaits).
    acquires: frozenset[str] = attrs.field(default=frozenset(), converter=_names)


@attrs.frozen
class Ignore:
    src: str = attrs.field(converter=_state)
    event: type[Event]
    reason: str


@attrs.frozen
class ProtocolError:
    src: str = attrs.field(converter=_state)
    event: type[Event]
    reason: str


class MachineDefinitionError(Exception):
    """A spec that fails validation; the message names the state and event."""


@attrs.frozen
class Source:
    """Another machine's resource that a machine uses, and how long it may.

    The instance of kind ``kind`` with the same key holds it in the states
    ``held`` (P's lease holds the blocks a push WRITEs from).  The plane
    keeps every instance of the using machine that is in one of the states
    ``needs`` alive only while its source is held: when the source leaves
    ``held``, the plane feeds it ``ended`` (an event with ``kind``,
    ``request_id`` and ``source_state`` fields); an event that it would handle
    in ``needs``, or that would move it into ``needs``, while the source is
    not held is replaced by ``ended`` (or refused, if it would create it).  The validator proves
    that ``ended`` ends the machine from every live state and that an action
    in ``uses`` is built only from a state in ``needs``: so such an action
    (a WRITE from the blocks) is never built while the source is not held,
    and what it started is released when the source ends.
    """

    kind: str
    held: frozenset[str] = attrs.field(converter=_state_names)
    needs: frozenset[str] = attrs.field(converter=_state_names)
    ended: type[Event]
    uses: frozenset[type[Action]] = attrs.field(default=frozenset(), converter=_action_classes)


@attrs.frozen
class Spec:
    """The full declaration of a machine, before compilation."""

    name: str
    instance_type: type
    initial: str = attrs.field(converter=_state)
    states: tuple[State, ...]
    events: tuple[type[Event], ...]
    table: tuple[Transition | Ignore | ProtocolError, ...]
    # Event fed by the plane after a protocol violation so that the machine
    # fails closed through its ordinary release path.
    fail_closed_event: type[Event] | None = None
    # Another machine's resource this one uses (see Source); None: none.
    source: Source | None = None
    # Events that create an instance when none with their id exists (the
    # plane routes from these; ``validate_composition`` checks them).
    created_by: tuple[type[Event], ...] = ()
    doc: str = ""


def with_timer_ignores(spec: Spec) -> Spec:
    """Declare TimerFired in every non-terminal state without a deadline as an
    ignore: the plane drops stale timers, so one can only be a leftover."""
    declared = {(e.src, e.event) for e in spec.table}
    extra = tuple(
        Ignore(s.name, TimerFired, "no deadline in this state: a stale timer")
        for s in spec.states
        if not s.terminal and s.deadline is None and (s.name, TimerFired) not in declared
    )
    return attrs.evolve(spec, table=spec.table + extra) if extra else spec


def transitions_of(spec: Spec) -> Iterable[Transition]:
    return (e for e in spec.table if isinstance(e, Transition))
