"""A compiled machine: a Spec validated and turned into a dict dispatch.

``compile_machine`` validates a spec (see ``validate``) and produces a
``Machine``: a dict from (state, event class) to the declared row(s), and
one interpreter (``run``) that calls a row's guard, effect and builders
where the machine's table file defines them, then sets the state and the
destination's deadline.  Nothing is generated: a traceback through a guard
names ``machines/<machine>.py``.  Kept apart from ``spec`` so that the
declarations, the validator and the runtime import one way only:
spec <- validate <- machine.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import attrs

from .base import Action, ArmTimer, CancelTimer, Event, Instance
from .spec import DeadlineFn, Effect, Guard, Ignore, ProtocolError, Spec, Transition, with_timer_ignores
from .validate import validate


class ProtocolViolation(Exception):
    """An event that the spec declares impossible in the current state."""

    def __init__(self, machine: str, key: Any, state: str, event: Event, reason: str):
        self.machine, self.key, self.state, self.event, self.reason = machine, key, state, event, reason
        super().__init__(f"{machine}:{key}: {type(event).__name__} in {state}: {reason}")


class NoGuardMatched(ProtocolViolation):
    """Every guarded transition of a (state, event) pair was false."""


# Dispatch entries: a tuple of transitions (guarded, first match wins) or an
# Ignore / ProtocolError marker (the spec's own row).
_Entry = tuple  # tuple[_Compiled, ...] | Ignore | ProtocolError


class _Compiled(NamedTuple):
    # A plain tuple: unpacked once per dispatch, cheaper than attribute reads.
    guard: Guard | None
    dest: str
    effect: Effect | None
    builders: tuple[Callable, ...]
    # The class each builder builds, as its row declares it (``Emit.action``).
    actions: tuple[type[Action], ...]


class _Step(NamedTuple):
    """One transition as ``run`` reads it: the table's callables and the
    destination's deadline function (None: the destination has none)."""

    guard: Guard | None
    dest: str
    effect: Effect | None
    builders: tuple[Callable, ...]
    deadline: DeadlineFn | None


class _Group(NamedTuple):
    """A (state, event) pair's guarded transitions, in table order, and what
    no guard holding means there (None: only in a machine compiled with
    ``check=False``)."""

    steps: tuple[_Step, ...]
    no_guard: str | None


class Machine:
    """A compiled spec.  Stateless: instances carry all per-request data."""

    __slots__ = ("spec", "name", "states", "_table", "_deadlines", "terminal_states", "_no_guard", "rows", "new")

    def __init__(self, spec: Spec, table: dict):
        self.spec = spec
        self.name = spec.name
        self.states = {s.name: s for s in spec.states}
        self._table = table
        self._deadlines = {s.name: s.deadline for s in spec.states if s.deadline is not None}
        self.terminal_states = frozenset(s.name for s in spec.states if s.terminal)
        # (state, event) -> the reason of the error row closing its guarded
        # transitions: what no guard holding means there.
        self._no_guard = closing_errors(spec)
        # state -> event class -> what ``run`` interprets: the spec's Ignore or
        # ProtocolError row, or a _Group of transitions.
        self.rows: dict[str, dict[type, Any]] = {}
        for (state, event), entry in table.items():
            if entry.__class__ is not Ignore and entry.__class__ is not ProtocolError:
                entry = _Group(tuple(_Step(t.guard, t.dest, t.effect, t.builders, self._deadlines.get(t.dest))
                                     for t in entry), self._no_guard.get((state, event)))
            self.rows.setdefault(state, {})[event] = entry
        # new(key, **data): a function held by the machine (no bound method per call).
        self.new: Callable[..., Instance] = _maker(spec)

    def is_terminal(self, inst: Instance) -> bool:
        return inst.state in self.terminal_states

    def apply(self, inst: Instance, event: Event, config: Any, now: float) -> list[Action] | tuple[()]:
        """``handle`` without the timer actions: the new deadline is left in
        ``inst.deadline`` for the ControlPlane, which owns the timer heap and
        so need not build and then consume an ArmTimer per transition."""
        row = self.rows.get(inst.state, _NO_ROWS).get(event.__class__)
        if row is None:
            # Only reachable for an event type outside the spec's alphabet.
            raise ProtocolViolation(self.name, inst.key, inst.state, event, "event not in this machine's alphabet")
        return run(self, row, inst, event, config, now)

    def handle(self, inst: Instance, event: Event, config: Any, now: float) -> list[Action] | tuple[()]:
        """Apply ``event`` to ``inst`` at time ``now`` and return the actions,
        ending with ArmTimer / CancelTimer when the deadline moved.

        Returns ``IGNORED`` (an empty tuple, identity-comparable) for a
        declared ignore; raises ``ProtocolViolation`` for a declared error.
        """
        old = inst.deadline
        acts = self.apply(inst, event, config, now)
        if acts is not IGNORED:
            timer = timer_action(self.name, inst.key, old, inst.deadline)
            if timer is not None:
                acts.append(timer)  # type: ignore[union-attr]  # a transition's list
        return acts

    def explain(self, state: str, event_type: type) -> Any:
        """The table entry for a pair (for diagrams, docs and tests)."""
        return self._table[(state, event_type)]


_NO_ROWS: dict = {}


def run(machine: Machine, row: Any, inst: Instance, ev: Event, cfg: Any, now: float) -> list[Action] | tuple[()]:
    """Carry out one (state, event) row of ``machine``'s table on ``inst``:
    an ignore returns ``IGNORED``; an error raises ProtocolViolation;
    transitions are tried in table order (first guard that holds wins), and
    the chosen one runs its effect, its builders (while the instance is still
    in its state), sets the state and the destination's deadline, and
    returns the actions built.  No guard holding is the error row closing
    the group."""
    cls = row.__class__
    if cls is _Group:
        for guard, dest, effect, builders, deadline in row.steps:
            if guard is not None and not guard(inst, ev, cfg, now):
                continue
            if effect is not None:
                effect(inst, ev, cfg, now)
            acts = [build(inst, ev, cfg, now) for build in builders] if builders else []
            inst.state = dest
            inst.deadline = None if deadline is None else deadline(inst, cfg, now)
            return acts
        if row.no_guard is None:
            raise NoGuardMatched(machine.name, inst.key, inst.state, ev, "no guard matched")
        raise ProtocolViolation(machine.name, inst.key, inst.state, ev, row.no_guard)
    if cls is Ignore:
        return IGNORED
    raise ProtocolViolation(machine.name, inst.key, inst.state, ev, row.reason)


def _maker(spec: Spec) -> Callable[..., Instance]:
    cls, initial = spec.instance_type, spec.initial
    by_position = positional(cls, ("key", "state"))

    def new(key: Any, **data: Any) -> Instance:
        """A new instance in the initial state; ``data`` sets its other fields."""
        if data or not by_position:  # a keyword call costs about twice
            return cls(key=key, state=initial, **data)
        return cls(key, initial)

    new.__qualname__ = f"Machine.new ({spec.name})"
    return new


def positional(cls: type, names: tuple[str, ...]) -> bool:
    """Whether the attrs class ``cls`` takes ``names`` as its first positional arguments."""
    fields = [f for f in attrs.fields(cls) if f.init][:len(names)]
    return tuple(f.name for f in fields) == names and not any(f.kw_only for f in fields)


# Returned by identity for a declared ignore, so the plane can count it.
IGNORED: tuple[()] = ()


def timer_action(kind: str, key: Any, old: float | None, new: float | None) -> Action | None:
    """The timer action a deadline change means: arm the new one, or cancel."""
    if new is not None:
        return ArmTimer(kind, key, new) if new != old else None
    return CancelTimer(kind, key) if old is not None else None


def compile_machine(spec: Spec, *, check: bool = True) -> Machine:
    """Validate and compile.  ``check=False`` exists for mutation tests that
    build a deliberately broken machine to show the runtime checks catch it."""
    spec = with_timer_ignores(spec)
    if check:
        validate(spec)
    table: dict = {}
    for entry in spec.table:
        key = (entry.src, entry.event)
        if isinstance(entry, Transition):
            compiled = _Compiled(entry.guard, entry.dest, entry.effect, tuple(a.build for a in entry.actions),
                                 tuple(a.action for a in entry.actions))
            table[key] = table.get(key, ()) + (compiled,)
        elif key not in table:
            table[key] = entry
        # else: the error closing a guarded group (see closing_errors)
    return Machine(spec, table)


def closing_errors(spec: Spec) -> dict[tuple[str, type], str]:
    """(state, event) -> reason, for every ProtocolError row that closes a
    group of guarded transitions of its pair (the validator allows one only
    there, right after them)."""
    has_transitions = {(t.src, t.event) for t in spec.table if isinstance(t, Transition)}
    return {(e.src, e.event): e.reason for e in spec.table
            if isinstance(e, ProtocolError) and (e.src, e.event) in has_transitions}
