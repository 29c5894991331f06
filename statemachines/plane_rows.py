"""The plane's compiled rows: one event in one state, and all the plane does about it, as one function.

For every (state, event) entry of a compiled machine's table the plane gets,
beside the machine's own row, a generated function that runs the same
transitions (the same guards, effects, builders and destination deadlines,
from the same entry: ``machine.transition_lines``) followed by what
``ControlPlane._finish`` does after any transition, written out for that
transition alone: the timer pushed only where the destination has a
deadline, the instance dropped only where it is terminal, a source's users
ended only where the transition leaves the source's held states, and each
action handed to the world or carried out by its wire (``wire_code``,
inlined).  A dispatcher per event class finds the instance and its row in
one lookup each.

Nothing here decides behaviour: the tables and wires do, and everything
these functions do not cover goes to the general path (``general``, the
plane's ``_dispatch``): a machine that is wrapped (observed, reference) or
uses a ``Source``, an unknown id, an event outside the alphabet, a
protocol violation (``ControlPlane._violated``).  Tests run both paths on
the same stimuli and compare them.
"""
from __future__ import annotations

import ast
import heapq
import math
import re
from typing import Any, Callable, NamedTuple

import attrs

from .base import Action, ArmTimer, CancelTimer, Event
from .base import fields as fields_of
from .base import built_from_fields
from .composition import Requesters, Wire
from .machine import IGNORED, Machine, ProtocolViolation, generated, positional, transition_lines
from .spec import Ignore, ProtocolError, Source
from .stats import Final, Ignored, StatKeys
from .wire_code import wire_lines
from .wire_inline import ROW_PARAMS, inline_wire

# dispatch(plane, event, now, out, queue, note): the signature of the plane's _dispatch.
Dispatch = Callable[[Any, Event, float, list, list, bool], None]


def compile_routes(machines: tuple[tuple[str, Any], ...], users: dict[str, tuple[tuple[str, Source], ...]],
                   creators: dict[type[Event], str], wires: dict[type[Action], Wire], keys: StatKeys,
                   general: Dispatch) -> dict[type[Event], Dispatch]:
    """Event class -> its dispatcher, for every class that some compiled
    machine without a Source handles; other classes take ``general``."""
    fast = {kind: m for kind, m in machines if type(m) is Machine and m.spec.source is None}
    holding = {kind: frozenset(s.name for s in m.spec.states if s.holds) for kind, m in fast.items()}
    # event class -> kind -> state -> plane row.  Each pass after the first
    # writes the previous pass's rows in at the wires that reach them
    # (wire_inline), writing again only the rows with a wire to a row the
    # pass before wrote again; a row with a wire is compiled once its text
    # is final (until then only its text is read).
    rows: dict[type[Event], dict[str, dict[str, Any]]] = {}
    rewritten: set[tuple[str, type[Event]]] = set()
    for depth in range(_INLINE_DEPTH + 1):
        targets = {(kind, event): dict(by_state) for event, by_kind in rows.items()
                   for kind, by_state in by_kind.items()}
        now_rewritten = set()
        for kind, m in fast.items():
            for (state, event), entry in m._table.items():
                reached = [w for t in transitions_of_entry(entry) for a in t.actions if (w := wires.get(a))]
                if depth and not any(_reaches(w, rewritten) for w in reached):
                    continue
                row = _plane_row(kind, m, state, event, entry, users.get(kind, ()), wires, keys, targets, holding,
                                 build=not reached)
                rows.setdefault(event, {}).setdefault(kind, {})[state] = row
                now_rewritten.add((kind, event))
        rewritten = now_rewritten
    for by_kind in rows.values():
        for by_state in by_kind.values():
            for state, row in by_state.items():
                if isinstance(row, _TextRow):
                    by_state[state] = row.compiled()
    routes: dict[type[Event], Dispatch] = {}
    for event, by_kind in rows.items():
        if not event.machine:  # routed by the event's ``kind``
            routes[event] = _kind_dispatcher(event, by_kind, general)
        elif event.machine in by_kind:
            kind = event.machine
            routes[event] = _class_dispatcher(kind, fast[kind], event, by_kind[kind], creators.get(event) == kind,
                                              general)
    return routes


def _reaches(w: Wire, rewritten: set[tuple[str, type[Event]]]) -> bool:
    """Whether wire ``w`` reaches a (kind, event) whose rows were written again."""
    return any(event is w.event and (kind == w.target or isinstance(w.target, Requesters))
               for kind, event in rewritten)


def transitions_of_entry(entry: Any) -> tuple:
    """The compiled transitions of a table entry (none for an ignore or an error)."""
    return () if entry.__class__ in (Ignore, ProtocolError) else entry


def _class_dispatcher(kind: str, machine: Machine, event: type[Event], rows: dict[str, Callable], creates: bool,
                      general: Dispatch) -> Dispatch:
    scope: dict[str, Any] = {"KIND": kind, "ROWS": rows, "GENERAL": general, "ProtocolViolation": ProtocolViolation,
                             "NEW": machine.spec.instance_type, "INITIAL": machine.spec.initial}
    body = ["def dispatch(plane, ev, now, out, queue, note):",
            f"    key = ev.{_identifier(event.key_field)}",
            "    insts = plane.instances[KIND]",
            "    inst = insts.get(key)",
            "    created = False",
            "    if inst is None:"]
    if creates:  # as Machine.new (by position where the class allows: a keyword call costs about twice)
        call = "NEW(key, INITIAL)" if positional(machine.spec.instance_type, ("key", "state")) \
            else "NEW(key=key, state=INITIAL)"
        body += [f"        inst = insts[key] = {call}", "        created = True"]
    else:  # an unknown id: refused there
        body += ["        return GENERAL(plane, ev, now, out, queue, note)"]
    # The rows of the few states where the event makes a transition are
    # written in (a call and a lookup fewer); the rest are looked up.
    written = [(state, row.written) for state, row in rows.items() if hasattr(row, "written")]
    if len(written) <= _WRITTEN_STATES:
        written = [(state, text) for state, text in written if len(text.body) <= _WRITTEN_LINES]
        body.append("    state = inst.state")
        for n, (state, text) in enumerate(written):
            body += [f"    if state == {state!r}:", "        try:"]
            body += ["            " + line for line in text.statements(scope, f"R{n}_")]
            body += ["        except ProtocolViolation as exc:",
                     "            plane._violated(KIND, inst, key, ev, exc, created, now, out, queue, note)",
                     "        return"]
    body += ["    row = ROWS.get(inst.state)",
             "    if row is None:",  # outside the alphabet: refused there
             "        if created:",
             "            del insts[key]",
             "        return GENERAL(plane, ev, now, out, queue, note)",
             "    try:",
             "        row(plane, insts, inst, key, ev, now, out, queue, note, created)",
             "    except ProtocolViolation as exc:",
             "        plane._violated(KIND, inst, key, ev, exc, created, now, out, queue, note)"]
    return generated(body, scope, "dispatch", f"{__file__}: dispatch {kind} {event.__name__}")


# How deep rows are written in at wires: a row's wire target's row, and the row of that row's wire.
_INLINE_DEPTH = 2
# At most this many states' rows are written into a dispatcher (each costs a
# string comparison in front of the states after it).
_WRITTEN_STATES = 4
# A row longer than this (one that writes wire targets' rows in) is called, not
# written in: the call is a small part of its cost, and its text a large part of compiling.
_WRITTEN_LINES = 60


def _kind_dispatcher(event: type[Event], by_kind: dict[str, dict[str, Callable]], general: Dispatch) -> Dispatch:
    """For an event routed by its ``kind`` field (a timer, a wake-up); none creates an instance."""
    scope: dict[str, Any] = {"BY_KIND": by_kind, "GENERAL": general, "ProtocolViolation": ProtocolViolation}
    body = ["def dispatch(plane, ev, now, out, queue, note):",
            "    kind = ev.kind",
            "    rows = BY_KIND.get(kind)",
            "    if rows is None:",
            "        return GENERAL(plane, ev, now, out, queue, note)",
            f"    key = ev.{_identifier(event.key_field)}",
            "    insts = plane.instances[kind]",
            "    inst = insts.get(key)"]
    # As in a class dispatcher: the few (kind, state) rows with a transition written in.
    written = [(kind, state, row.written) for kind, rows in by_kind.items() for state, row in rows.items()
               if hasattr(row, "written")]
    if len(written) <= _WRITTEN_STATES:
        written = [(kind, state, text) for kind, state, text in written if len(text.body) <= _WRITTEN_LINES]
        body += ["    if inst is not None:", "        state = inst.state", "        created = False"]
        for n, (kind, state, text) in enumerate(written):
            body += [f"        if kind == {kind!r} and state == {state!r}:", "            try:"]
            body += ["                " + line for line in text.statements(scope, f"R{n}_")]
            body += ["            except ProtocolViolation as exc:",
                     "                plane._violated(kind, inst, key, ev, exc, False, now, out, queue, note)",
                     "            return"]
    body += ["    row = None if inst is None else rows.get(inst.state)",
            "    if row is None:",
            "        return GENERAL(plane, ev, now, out, queue, note)",
            "    try:",
            "        row(plane, insts, inst, key, ev, now, out, queue, note, False)",
            "    except ProtocolViolation as exc:",
            "        plane._violated(kind, inst, key, ev, exc, False, now, out, queue, note)"]
    return generated(body, scope, "dispatch", f"{__file__}: dispatch by kind {event.__name__}")


_ROW_ARGS = ", ".join(ROW_PARAMS)


def _plane_row(kind: str, machine: Machine, state: str, event: type[Event], entry: Any,
               users: tuple[tuple[str, Source], ...], wires: dict[type[Action], Wire], keys: StatKeys,
               targets: dict[tuple[str, type[Event]], dict[str, Any]],
               holding: dict[str, frozenset[str]], build: bool = True) -> Any:
    """The plane row of one table entry (with ``build`` False, only its
    text: a ``_TextRow``, for a later pass to write in)."""
    if entry.__class__ is Ignore:
        return _ignore_row(kind, state, keys(Ignored, kind, state, event.__name__), state == machine.spec.initial)
    if entry.__class__ is ProtocolError:
        return _error_row(machine.name, entry.reason)
    scope: dict[str, Any] = {"KIND": kind, "SRC": state, "EVENT": event, "isfinite": math.isfinite,
                             "heappush": heapq.heappush}
    terminal, initial = machine.terminal_states, machine.spec.initial
    # (transition, builder) -> the locals holding the fields of an internal
    # action its wire carries out and the row therefore never builds (see unbuilt_action).
    unbuilt: dict[tuple[int, int], list[str]] = {}

    def bind(i: int, j: int, expression: str) -> list[str] | None:
        cls = entry[i].actions[j]
        action = unbuilt_action(cls, expression, scope, f"a{j}_", f"{i}_{j}") if cls in wires else None
        if action is None:
            return None
        unbuilt[(i, j)] = action.arguments
        scope[f"ACT{i}_{j}"] = cls
        return [f"{name} = {value}" for name, value in action.bindings]

    def listed(i: int, j: int) -> str:
        # The action as the recorder sees it: built only while recording.
        names = unbuilt.get((i, j))
        return f"a{j}" if names is None else f"ACT{i}_{j}({', '.join(names)})"

    def finish(i: int, t: Any, acts: list[str]) -> list[str]:
        # ControlPlane._finish, for this transition (keep the two in step).
        lines = []
        if t.dest in machine._deadlines:
            lines += ["if dl is not None and dl != old:",
                      "    if not isfinite(dl):",
                      "        dl = plane._nonfinite_deadline(KIND, key, ev, inst, now)",
                      "    ta = inst.timer_at  # ControlPlane._push_timer, inline",
                      "    if ta is None or dl < ta:",
                      "        inst.timer_at = dl",
                      "        plane._seq = seq = plane._seq + 1",
                      "        timers = plane._timers",
                      "        heappush(timers, (dl, seq, KIND, key))",
                      "        if len(timers) > plane._compact_at:",
                      "            plane._compact_timers()"]
        lines += ["if note:  # ControlPlane._note_top, inline",
                  f"    plane._top = (ev, now, KIND, key, SRC, inst.state, "
                  f"[{', '.join(listed(i, j) for j in range(len(acts)))}], old, inst.deadline)"]
        if t.dest in terminal:
            scope[f"FINAL{i}"] = keys(Final, kind, t.dest)
            lines += ["del insts[key]", f"plane.stats[FINAL{i}] += 1"]
        elif t.dest == initial:
            lines += ["if created:", "    del insts[key]"]
        if t.dest != state:
            for u, (user_kind, source) in enumerate(users):
                if state in source.held and t.dest not in source.held:
                    scope[f"USER{i}_{u}"], scope[f"SOURCE{i}_{u}"] = user_kind, source
                    lines += [f"if key in plane.instances[USER{i}_{u}]:",
                              f"    queue.append(plane._source_ended(SOURCE{i}_{u}, USER{i}_{u}, key, EVENT))"]
        for j, cls in enumerate(t.actions):
            field = (lambda name, j=j: f"a{j}_{name}") if (i, j) in unbuilt else None
            lines += _action_lines(cls, f"a{j}", wires, scope, f"{i}_{j}", field, targets, holding,
                                   last=all(c is CancelTimer for c in t.actions[j + 1:]))
        return lines + ["return"]

    lines = transition_lines(machine, state, event, entry, scope, finish, bind, deadline_as="dl")
    # The row's own locals, where its lines read them (most of them now read no configuration).
    used = [f"    {name} = {value}" for name, value in (("cfg", "plane.config"), ("old", "inst.deadline"))
            if any(re.search(rf"\b{name}\b", line) for line in lines)]
    body = [f"def row({_ROW_ARGS}):", *used, *lines]
    names = dict(scope)  # before generated() adds the function and __builtins__
    text = _TextRow(WrittenRow(body, names), f"{__file__}: row {kind} {state} {event.__name__}")
    return text.compiled() if build else text


class _TextRow(NamedTuple):
    """A row not compiled yet: its text (for a later pass to write in) and
    where its compiled code is filed."""

    written: "WrittenRow"
    where: str

    def compiled(self) -> Callable:
        row = generated(self.written.body, dict(self.written.names), "row", self.where)
        row.written = self.written  # type: ignore[attr-defined]  # for a dispatcher to write it in
        return row


class WrittenRow(NamedTuple):
    """A generated plane row's source and the names it reads from its scope."""

    body: list[str]
    names: dict[str, Any]

    def statements(self, scope: dict[str, Any], prefix: str) -> list[str]:
        """The row's statements (not indented), its scope's names renamed
        ``<prefix><name>`` and bound in ``scope``: the body of a dispatcher
        branch (the dispatcher's locals are the row's arguments)."""
        tree = ast.parse("\n".join(self.body))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in self.names:
                scope[prefix + node.id] = self.names[node.id]
                node.id = prefix + node.id
        function = tree.body[0]
        assert isinstance(function, ast.FunctionDef)
        return [line for stmt in function.body for line in ast.unparse(stmt).splitlines()]


def _action_lines(cls: type[Action], action: str, wires: dict[type[Action], Wire], scope: dict[str, Any],
                  tag: str, field: Callable[[str], str] | None, targets: dict[tuple[str, type[Event]], dict[str, Any]],
                  holding: dict[str, frozenset[str]], last: bool) -> list[str]:
    """What the plane does with one action its row built (the class its row
    declares; ``ControlPlane._internal`` maps the same classes).  A wire's
    event is queued, or its target's row written in where that may be
    (``wire_inline``; ``last``: nothing after the action reaches the world
    or the queue)."""
    if cls is ArmTimer:
        return [f"plane._arm({action}.at, {action}.kind, {action}.key)"]
    if cls is CancelTimer:
        return []  # lazy deletion, as the plane's own executor
    wire = wires.get(cls)
    if wire is None:
        return [f"out.append({action})"]
    written = inline_wire(wire, action, scope, tag, field, targets, holding, last)
    return written if written is not None else wire_lines(wire, action, scope, tag, field)


def unbuilt_action(cls: type[Action], expression: str, scope: dict[str, Any], prefix: str,
                   tag: str) -> "UnbuiltAction | None":
    """An internal action that a row would build only for its wire to read
    its fields: where ``expression`` (its builder, written in) is a plain
    call of ``cls``, the fields as (local name, value expression), in the
    order the call evaluates them, so the row binds locals instead of
    building the action (about a tenth of the cost).  None where ``cls``
    has converters, validators or a post-init, or the call is anything
    else.  A field left to its default gets the default, bound in scope."""
    try:
        call = ast.parse(expression, mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and scope.get(call.func.id) is cls):
        return None
    if not built_from_fields(cls):
        return None
    fields = fields_of(cls)
    positional = [f for f in fields if not f.kw_only]
    if len(call.args) > len(positional) or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    given: dict[str, str] = {f.name: ast.unparse(a) for f, a in zip(positional, call.args)}
    for kw in call.keywords:
        f = next((f for f in fields if f.alias == kw.arg), None)
        if f is None or f.name in given:
            return None  # ``**mapping``, an unknown or a repeated keyword: leave the call to say so
        given[f.name] = ast.unparse(kw.value)
    bindings = [(prefix + name, value) for name, value in given.items()]  # in the order the call evaluates them
    for f in fields:
        if f.name not in given:
            if f.default is attrs.NOTHING or isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
                return None
            scope[f"DEFAULT{tag}_{f.name}"] = f.default
            bindings.append((prefix + f.name, f"DEFAULT{tag}_{f.name}"))
    # The constructor's arguments, as the recorder's copy is built: by position where the class takes them so.
    arguments = [prefix + f.name for f in fields if not f.kw_only] + \
        [f"{f.alias}={prefix}{f.name}" for f in fields if f.kw_only]
    return UnbuiltAction(bindings, arguments)


class UnbuiltAction(NamedTuple):
    bindings: list[tuple[str, str]]  # (local, value), in evaluation order
    arguments: list[str]  # the constructor's arguments over those locals


def _ignore_row(kind: str, state: str, stat: Any, in_initial: bool) -> Callable:
    """A declared ignore: counted; an instance just created for it is dropped."""
    def row(plane: Any, insts: dict, inst: Any, key: Any, ev: Event, now: float, out: list, queue: list, note: bool,
            created: bool) -> None:
        plane.stats[stat] += 1
        if note:  # ControlPlane._note_top, inline
            plane._top = (ev, now, kind, key, state, state, IGNORED, inst.deadline, inst.deadline)
        if in_initial and created:
            del insts[key]

    return row


def _error_row(name: str, reason: str) -> Callable:
    def row(plane: Any, insts: dict, inst: Any, key: Any, ev: Event, now: float, out: list, queue: list, note: bool,
            created: bool) -> None:
        raise ProtocolViolation(name, inst.key, inst.state, ev, reason)

    return row


def _identifier(name: str) -> str:
    if not name.isidentifier():
        raise ValueError(f"event key field {name!r} is not an identifier")
    return name
