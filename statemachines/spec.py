"""Declarative machine specs, compiled into a dict dispatch.

A machine is data: states (terminal or not, the resources each holds, an
optional deadline), events (attrs frozen classes), and one table entry per
(state, event) pair: guarded transitions, an ignore with a reason, or a
protocol error.  ``compile_machine`` validates the table (see ``validate``)
and produces a ``Machine`` whose ``handle`` costs one dict lookup plus the
guards, effects and action builders of the chosen transition.

Deadlines are part of the framework, not of each transition: entering a
state with a deadline arms the instance's timer, leaving it cancels it.  A
waiting state therefore cannot forget its timer.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import attrs

from .base import Action, ArmTimer, CancelTimer, Event, Instance, TimerFired

Guard = Callable[[Any, Any, Any, float], bool]
Effect = Callable[[Any, Any, Any, float], None]
DeadlineFn = Callable[[Any, Any, float], float]


@attrs.frozen
class State:
    name: str
    terminal: bool = False
    # Resources held while in this state (e.g. "blocks", "xfer", "engine_ref").
    holds: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    # True when the state waits on a remote party; such a state needs a deadline.
    waits_on_remote: bool = False
    # deadline(instance, config, now) -> absolute time; evaluated on every
    # transition into (or within) the state, so an effect that moves it re-arms.
    deadline: DeadlineFn | None = None
    doc: str = ""


@attrs.frozen
class Transition:
    src: str
    event: type
    dest: str
    guard: Guard | None = None
    guard_doc: str = ""
    effect: Effect | None = None
    # What the transition emits, in order: ``Emit`` records (the action class
    # and the machine-local ``build(instance, event, config, now)``).
    actions: tuple = ()
    # Resources the transition takes on beyond what its event and actions
    # declare (e.g. the duty to report a recv that the scheduler awaits).
    acquires: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)


@attrs.frozen
class Ignore:
    src: str
    event: type
    reason: str


@attrs.frozen
class ProtocolError:
    src: str
    event: type
    reason: str


class MachineDefinitionError(Exception):
    """A spec that fails validation; the message names the state and event."""


class ProtocolViolation(Exception):
    """An event that the spec declares impossible in the current state."""

    def __init__(self, machine: str, key: Any, state: str, event: Event, reason: str):
        self.machine, self.key, self.state, self.event, self.reason = machine, key, state, event, reason
        super().__init__(f"{machine}:{key}: {type(event).__name__} in {state}: {reason}")


class NoGuardMatched(ProtocolViolation):
    """Every guarded transition of a (state, event) pair was false."""


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
    held: frozenset[str] = attrs.field(converter=frozenset)
    needs: frozenset[str] = attrs.field(converter=frozenset)
    ended: type
    uses: frozenset[type] = attrs.field(default=frozenset(), converter=frozenset)


@attrs.frozen
class Spec:
    """The full declaration of a machine, before compilation."""

    name: str
    instance_type: type
    initial: str
    states: tuple[State, ...]
    events: tuple[type, ...]
    table: tuple[Transition | Ignore | ProtocolError, ...]
    # Event fed by the plane after a protocol violation so that the machine
    # fails closed through its ordinary release path.
    fail_closed_event: type | None = None
    # Another machine's resource this one uses (see Source); None: none.
    source: Source | None = None
    # Events that create an instance when none with their id exists (the
    # plane routes from these; ``validate_composition`` checks them).
    created_by: tuple[type, ...] = ()
    doc: str = ""


# Dispatch entries: a tuple of transitions (guarded, first match wins) or an
# Ignore / ProtocolError marker.
_Entry = tuple  # tuple[_Compiled, ...] | Ignore | ProtocolError


class _Compiled(NamedTuple):
    # A plain tuple: unpacked once per dispatch, cheaper than attribute reads.
    guard: Guard | None
    dest: str
    effect: Effect | None
    builders: tuple[Callable, ...]


class Machine:
    """A compiled spec.  Stateless: instances carry all per-request data."""

    __slots__ = ("spec", "name", "states", "_table", "_deadlines", "terminal_states")

    def __init__(self, spec: Spec, table: dict):
        self.spec = spec
        self.name = spec.name
        self.states = {s.name: s for s in spec.states}
        self._table = table
        self._deadlines = {s.name: s.deadline for s in spec.states if s.deadline is not None}
        self.terminal_states = frozenset(s.name for s in spec.states if s.terminal)

    def new(self, key: Any, **data: Any) -> Instance:
        return self.spec.instance_type(key=key, state=self.spec.initial, **data)

    def is_terminal(self, inst: Instance) -> bool:
        return inst.state in self.terminal_states

    def handle(self, inst: Instance, event: Event, config: Any, now: float) -> list[Action]:
        """Apply ``event`` to ``inst`` at time ``now`` and return the actions,
        ending with ArmTimer / CancelTimer when the deadline moved.

        Returns ``IGNORED`` (an empty tuple, identity-comparable) for a
        declared ignore; raises ``ProtocolViolation`` for a declared error.
        """
        old = inst.deadline
        actions = self.apply(inst, event, config, now)
        if actions is not IGNORED:
            timer = timer_action(self.name, inst.key, old, inst.deadline)
            if timer is not None:
                actions.append(timer)
        return actions

    def apply(self, inst: Instance, event: Event, config: Any, now: float) -> list[Action]:
        """``handle`` without the timer actions: the new deadline is left in
        ``inst.deadline`` for the ControlPlane, which owns the timer heap and
        so need not build and then consume an ArmTimer per transition."""
        entry = self._table.get((inst.state, type(event)))
        if entry is None:
            # Only reachable for an event type outside the spec's alphabet.
            raise ProtocolViolation(self.name, inst.key, inst.state, event, "event not in this machine's alphabet")
        if entry.__class__ is tuple:
            for guard, dest, effect, builders in entry:
                if guard is None or guard(inst, event, config, now):
                    break
            else:
                raise NoGuardMatched(self.name, inst.key, inst.state, event, "no guard matched")
            if effect is not None:
                effect(inst, event, config, now)
            actions = [b(inst, event, config, now) for b in builders]
            inst.state = dest
            dl = self._deadlines.get(dest)
            inst.deadline = None if dl is None else dl(inst, config, now)
            return actions
        if entry.__class__ is Ignore:
            return IGNORED
        raise ProtocolViolation(self.name, inst.key, inst.state, event, entry.reason)

    def explain(self, state: str, event_type: type) -> Any:
        """The table entry for a pair (for diagrams, docs and tests)."""
        return self._table[(state, event_type)]


# Returned by identity for a declared ignore, so the plane can count it.
IGNORED: tuple = ()


def timer_action(kind: str, key: Any, old: float | None, new: float | None) -> Action | None:
    """The timer action a deadline change means: arm the new one, or cancel."""
    if new is not None:
        return ArmTimer(kind, key, new) if new != old else None
    return CancelTimer(kind, key) if old is not None else None


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


def compile_machine(spec: Spec, *, check: bool = True) -> Machine:
    """Validate and compile.  ``check=False`` exists for mutation tests that
    build a deliberately broken machine to show the runtime checks catch it."""
    from .validate import validate

    spec = with_timer_ignores(spec)
    if check:
        validate(spec)
    table: dict = {}
    for entry in spec.table:
        key = (entry.src, entry.event)
        if isinstance(entry, Transition):
            compiled = _Compiled(entry.guard, entry.dest, entry.effect, tuple(a.build for a in entry.actions))
            table[key] = table.get(key, ()) + (compiled,)
        else:
            table[key] = entry
    return Machine(spec, table)


def transitions_of(spec: Spec) -> Iterable[Transition]:
    return (e for e in spec.table if isinstance(e, Transition))
