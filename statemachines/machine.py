"""A compiled machine: a Spec turned into a dict dispatch.

``compile_machine`` validates a spec (see ``validate``) and produces a
``Machine`` whose ``handle`` costs one dict lookup plus the guards, effects
and action builders of the chosen transition.  Kept apart from ``spec`` so
that the declarations, the validator and the runtime import one way only:
spec <- validate <- machine.
"""
from __future__ import annotations

import linecache
from typing import Any, Callable, NamedTuple

import attrs

from .base import Action, ArmTimer, CancelTimer, Event, Instance
from .spec import Effect, Guard, Ignore, ProtocolError, Spec, Transition, with_timer_ignores
from .inline import inline_expression, inline_statements, read_fields_for_aliases
from .validate import validate

# A row's arguments, as the table's callables take them.
_ARGS = ("inst", "ev", "cfg", "now")
_DEADLINE_ARGS = ("inst", "cfg", "now")


class ProtocolViolation(Exception):
    """An event that the spec declares impossible in the current state."""

    def __init__(self, machine: str, key: Any, state: str, event: Event, reason: str):
        self.machine, self.key, self.state, self.event, self.reason = machine, key, state, event, reason
        super().__init__(f"{machine}:{key}: {type(event).__name__} in {state}: {reason}")


class NoGuardMatched(ProtocolViolation):
    """Every guarded transition of a (state, event) pair was false."""


# Dispatch entries: a tuple of transitions (guarded, first match wins) or an
# Ignore / ProtocolError marker.
_Entry = tuple  # tuple[_Compiled, ...] | Ignore | ProtocolError


class _Compiled(NamedTuple):
    # A plain tuple: unpacked once per dispatch, cheaper than attribute reads.
    guard: Guard | None
    dest: str
    effect: Effect | None
    builders: tuple[Callable, ...]
    # The class each builder builds, as its row declares it (``Emit.action``).
    actions: tuple[type[Action], ...]


class Machine:
    """A compiled spec.  Stateless: instances carry all per-request data."""

    __slots__ = ("spec", "name", "states", "_table", "_deadlines", "terminal_states", "_no_guard", "_rows",
                 "_handle_rows", "inline", "handle", "new")

    def __init__(self, spec: Spec, table: dict, *, inline: bool = True):
        self.spec = spec
        # Whether rows write the table's callables in where they can (inline.py) or call each one.
        self.inline = inline
        self.name = spec.name
        self.states = {s.name: s for s in spec.states}
        self._table = table
        self._deadlines = {s.name: s.deadline for s in spec.states if s.deadline is not None}
        self.terminal_states = frozenset(s.name for s in spec.states if s.terminal)
        # (state, event) -> the reason of the error row closing its guarded
        # transitions: what no guard holding means there.
        self._no_guard = closing_errors(spec)
        # state -> event class -> the row function of that pair (see _row).
        self._rows: dict[str, dict[type, Callable]] = {}
        # The same, ending with the timer action ``handle`` returns (see _handle_row).
        self._handle_rows: dict[str, dict[type, Callable]] = {}
        for (state, event), entry in table.items():
            self._rows.setdefault(state, {})[event] = _row(self, state, event, entry)
            self._handle_rows.setdefault(state, {})[event] = _handle_row(self, state, event, entry)
        # handle(inst, event, config, now) and new(key, **data): functions held
        # by the instance, not methods, so a call costs no bound method and no attribute reads.
        self.handle: Callable[[Instance, Event, Any, float], list[Action] | tuple[()]] = _handler(self)
        self.new: Callable[..., Instance] = _maker(spec)

    def is_terminal(self, inst: Instance) -> bool:
        return inst.state in self.terminal_states

    def apply(self, inst: Instance, event: Event, config: Any, now: float) -> list[Action] | tuple[()]:
        """``handle`` without the timer actions: the new deadline is left in
        ``inst.deadline`` for the ControlPlane, which owns the timer heap and
        so need not build and then consume an ArmTimer per transition."""
        by_event = self._rows.get(inst.state)
        row = None if by_event is None else by_event.get(event.__class__)
        if row is None:
            # Only reachable for an event type outside the spec's alphabet.
            raise ProtocolViolation(self.name, inst.key, inst.state, event, "event not in this machine's alphabet")
        return row(inst, event, config, now)

    def explain(self, state: str, event_type: type) -> Any:
        """The table entry for a pair (for diagrams, docs and tests)."""
        return self._table[(state, event_type)]


def _handler(machine: Machine) -> Callable:
    rows, apply = machine._handle_rows, machine.apply

    def handle(inst: Instance, event: Event, config: Any, now: float) -> list[Action] | tuple[()]:
        """Apply ``event`` to ``inst`` at time ``now`` and return the actions,
        ending with ArmTimer / CancelTimer when the deadline moved.

        Returns ``IGNORED`` (an empty tuple, identity-comparable) for a
        declared ignore; raises ``ProtocolViolation`` for a declared error.
        """
        try:
            row = rows[inst.state][event.__class__]
        except KeyError:
            return apply(inst, event, config, now)  # outside the alphabet: raises
        return row(inst, event, config, now)

    handle.__qualname__ = f"Machine.handle ({machine.name})"
    return handle


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


def _row(machine: Machine, state: str, event: type, entry: Any) -> Callable:
    """The function that carries out one (state, event) entry of the table:
    ``row(inst, event, config, now) -> actions``.

    A guarded group becomes straight-line code, one ``if`` per transition in
    table order (first match wins, as the table reads), each running its
    effect, its builders (while the instance is still in ``state``), the
    state change and the destination's deadline; generated once per pair,
    the way attrs generates ``__init__``, so a dispatch costs one call and
    no loop over row records.
    """
    if entry.__class__ is Ignore:
        return _ignored
    if entry.__class__ is ProtocolError:
        return _refuser(machine.name, entry.reason)
    scope: dict[str, Any] = {}
    body = ["def row(inst, ev, cfg, now):"]
    body += transition_lines(machine, state, event, entry, scope,
                             lambda i, t, acts: [f"return [{', '.join(acts)}]"])
    return generated(body, scope, "row", f"{__file__}: {machine.name} {state} {event.__name__}")


def _handle_row(machine: Machine, state: str, event: type, entry: Any) -> Callable:
    """``_row`` for ``handle``: the actions end with the timer action the
    deadline change means (``timer_action``, written out per transition:
    only a destination with a deadline can arm one)."""
    if entry.__class__ is Ignore or entry.__class__ is ProtocolError:
        return _row(machine, state, event, entry)
    scope: dict[str, Any] = {"ArmTimer": ArmTimer, "CancelTimer": CancelTimer}

    def finish(i: int, t: Any, acts: list[str]) -> list[str]:
        listed = "".join(f"{a}, " for a in acts)
        lines = []
        if t.dest in machine._deadlines:
            lines += ["if new is not None:",
                      "    if new != old:",
                      f"        return [{listed}ArmTimer(name, inst.key, new)]",
                      f"    return [{listed}]"]
        return lines + ["if old is not None:", f"    return [{listed}CancelTimer(name, inst.key)]",
                        f"return [{listed}]"]

    body = ["def row(inst, ev, cfg, now):", "    old = inst.deadline"]
    body += transition_lines(machine, state, event, entry, scope, finish, deadline_as="new")
    return generated(body, scope, "row", f"{__file__}: handle {machine.name} {state} {event.__name__}")


# The lines ending one transition of a row, given its index in the group, the
# transition and the names of the actions it built: ``finish(i, t, acts)``.
Finish = Callable[[int, "_Compiled", list[str]], list[str]]
# The lines binding builder ``j`` of transition ``i``, given the expression
# that builds its action, or None for ``a<j> = <expression>``.
Bind = Callable[[int, int, str], "list[str] | None"]


def transition_lines(machine: Machine, state: str, event: type, entry: tuple, scope: dict[str, Any],
                     finish: Finish, bind: Bind | None = None, deadline_as: str | None = None) -> list[str]:
    """The body (indented one level) of a row over ``inst, ev, cfg, now``
    that carries out a group of transitions: per transition, in table order,
    its guard, effect, builders (into ``a0``, ``a1``, ...), the state change
    and the destination's deadline, then ``finish``'s lines, which must
    return; past the last guard, the error that closes the group.  The
    names it binds go into ``scope``.  Shared by the machine's rows and the
    plane's (``plane_rows``), so both run the table's transitions alike.
    ``bind(i, j, expression)`` may give the lines that stand for
    ``a<j> = <expression>`` (None: that assignment).  Where a destination
    has a deadline, ``deadline_as`` names a local that is assigned it too
    (for ``finish``'s lines to read without reading the instance again)."""
    reason = machine._no_guard.get((state, event))

    def call(fn: Callable, name: str, args: tuple[str, ...]) -> str:
        # The callable's expression written in (see inline.py), or a call to it bound as ``name``.
        expression = inline_expression(fn, args, scope, name) if machine.inline else None
        if expression is None:
            scope[name] = fn
            expression = f"{name}({', '.join(args)})"
        return expression

    scope.update({"ProtocolViolation": ProtocolViolation, "NoGuardMatched": NoGuardMatched,
                  "name": machine.name, "reason": reason})
    body = []
    for i, compiled in enumerate(entry):
        guard, dest, effect, builders, _ = compiled
        indent = "    "
        if guard is not None:
            body.append(f"    if {call(guard, f'g{i}', _ARGS)}:")
            indent = "        "
        if effect is not None:
            statements = inline_statements(effect, _ARGS, scope, f"e{i}") if machine.inline else None
            if statements is None:
                statements = [call(effect, f"e{i}", _ARGS)]
            body += [indent + line for line in statements]
        acts = []
        for j, build in enumerate(builders):
            expression = call(build, f"b{i}_{j}", _ARGS)
            lines = None if bind is None else bind(i, j, expression)
            body += [indent + line for line in (lines if lines is not None else [f"a{j} = {expression}"])]
            acts.append(f"a{j}")
        scope[f"d{i}"] = dest
        if dest != state:  # a self-loop leaves the state as it is (effects never set it)
            body.append(f"{indent}inst.state = d{i}")
        deadline = machine._deadlines.get(dest)
        if deadline is None:
            body.append(f"{indent}inst.deadline = None")
        else:
            also = "" if deadline_as is None else f"{deadline_as} = "
            body.append(f"{indent}{also}inst.deadline = {call(deadline, f'dl{i}', _DEADLINE_ARGS)}")
        body += [indent + line for line in finish(i, compiled, acts)]
        if guard is None:
            break  # an unguarded transition always matches: later rows are unreachable
    else:
        if reason is None:  # only in a machine compiled with check=False
            body.append("    raise NoGuardMatched(name, inst.key, inst.state, ev, 'no guard matched')")
        else:
            body.append("    raise ProtocolViolation(name, inst.key, inst.state, ev, reason)")
    # A property of the event that only reads one of its fields is read as that field.
    return read_fields_for_aliases(body, event) if machine.inline else body


def generated(body: list[str], scope: dict[str, Any], name: str, where: str) -> Callable:
    """The function ``name`` defined by ``body`` over ``scope``.  Its code is
    filed as ``where`` (a path under the module that generates it, then what
    it is) and its source kept in ``linecache``, so tracebacks show the
    generated lines and allocation traces count it as this package's."""
    source = "\n".join(body) + "\n"
    linecache.cache[where] = (len(source), None, source.splitlines(True), where)
    exec(compile(source, where, "exec"), scope)  # noqa: S102 (generated from the table's own callables, no input text)
    fn: Callable = scope[name]
    return fn


def _ignored(inst: Any, ev: Any, cfg: Any, now: float) -> tuple[()]:
    return IGNORED


def _refuser(name: str, reason: str) -> Callable:
    def refuse(inst: Any, ev: Any, cfg: Any, now: float) -> Any:
        raise ProtocolViolation(name, inst.key, inst.state, ev, reason)

    return refuse


# Returned by identity for a declared ignore, so the plane can count it.
IGNORED: tuple[()] = ()


def timer_action(kind: str, key: Any, old: float | None, new: float | None) -> Action | None:
    """The timer action a deadline change means: arm the new one, or cancel."""
    if new is not None:
        return ArmTimer(kind, key, new) if new != old else None
    return CancelTimer(kind, key) if old is not None else None


def compile_machine(spec: Spec, *, check: bool = True, inline: bool = True) -> Machine:
    """Validate and compile.  ``check=False`` exists for mutation tests that
    build a deliberately broken machine to show the runtime checks catch it;
    ``inline=False`` makes every row call the table's callables (inline.py),
    which tests compare with the inlined rows."""
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
    return Machine(spec, table, inline=inline)


def closing_errors(spec: Spec) -> dict[tuple[str, type], str]:
    """(state, event) -> reason, for every ProtocolError row that closes a
    group of guarded transitions of its pair (the validator allows one only
    there, right after them)."""
    has_transitions = {(t.src, t.event) for t in spec.table if isinstance(t, Transition)}
    return {(e.src, e.event): e.reason for e in spec.table
            if isinstance(e, ProtocolError) and (e.src, e.event) in has_transitions}
