"""A wire's event handled where the wire is: the target's row written in, not queued.

A compiled row (plane_rows) hands the event of an internal action's wire to
the plane's FIFO queue; the plane then builds nothing more but finds the
target instance, its dispatcher and its row, and runs the row after
everything queued before it.  Where that later run cannot be told from
running the target's row at the wire itself, the row writes the target's
row in at the wire: the event's fields become locals, and no event is
built, queued or dispatched.  That holds when, as the row runs:

- nothing is queued (a row that queued already, or that runs from the
  queue, where the queue holds its own event, queues); a recorded step
  too: its line holds the stimulus's own row's actions (noted before the
  wire) and the cascade's effects, read from the plane's output, the same
  either way;
- the target instance exists and is in a state whose row is written in
  (any other state: queued, as before);

and when, from the tables, either the wire is the last thing the row does
that reaches the world or the queue (so the target's row would run next
anyway), or the target's row appends to neither, drops no instance and
ends in one place: it changes only its own instance and the timer heap,
whose pushes keep their order (the row's own came first either way).

The target's row is the one the plane compiled for it (its text, kept as
``WrittenRow``): its arguments renamed to the wire's locals, its own
locals and scope names prefixed, ``ev.<field>`` read from the locals the
wire binds, ``ev`` itself (only on a non-finite deadline) built from them,
and its recording branch dropped.  A row that can raise (a protocol error
closes its instance through the dispatcher) or reads what the event does
not carry as a field is not written in; this relies on the tables'
contract that only their error rows and unmatched guards raise
ProtocolViolation, never a guard, effect or builder.  Rows are written in
two levels deep (``plane_rows._INLINE_DEPTH``), at most two states per
wire, the states holding a resource first.  Nothing here decides
behaviour; ``tests/test_plane_fast_path.py`` holds the written-in path to
the queued one (the general path) on the same stimuli, heap order included.
"""
from __future__ import annotations

import ast
import builtins
import functools
import re
from typing import Any, Callable, NamedTuple

from .base import Event, built_from_fields
from .composition import Requesters, Wire
from .wire_code import action_reader, event_arguments, wire_fields, wire_lines

# The parameters of a plane row: row(plane, insts, inst, key, ev, now, out, queue, note, created).
ROW_PARAMS = ("plane", "insts", "inst", "key", "ev", "now", "out", "queue", "note", "created")
# The most states of a target written in at one wire (each costs a comparison on the way to the next).
_MAX_STATES = 2
# The longest target row written in at a wire.
_MAX_LINES = 200


def inline_wire(w: Wire, action: str, scope: dict[str, Any], tag: str, action_field: Callable[[str], str] | None,
                targets: dict[tuple[str, type[Event]], dict[str, Any]], holding: dict[str, frozenset[str]],
                last: bool) -> list[str] | None:
    """The lines (not indented) that carry out wire ``w`` with its target's
    row written in for the states where that may be, queueing otherwise; or
    None where no state's row may be (the caller queues, ``wire_lines``).
    ``targets``: (kind, event class) -> that kind's rows for the event, by
    state in table order (their ``written`` text); ``holding``: kind -> its
    states that hold a resource (a machine holding one is up and in use:
    where its events usually find it, so those are written in first);
    ``last``: nothing after the wire in the calling row reaches the world
    or the queue.  A fan-out (``Requesters``) is written in only at the
    end of its row and for one requester."""
    if not built_from_fields(w.event) or (isinstance(w.target, Requesters) and not last):
        return None
    kinds = [k for k, e in targets if e is w.event and (isinstance(w.target, Requesters) or k == w.target)]
    scope[f"EV{tag}"] = w.event
    prelude, exprs = wire_fields(w, action, scope, tag, action_field)
    locals_ = {field: f"ev{tag}_{field}" for field in exprs}
    target, key_local = f"tgt{tag}", locals_[w.event.key_field]
    built = f"EV{tag}({event_arguments(w, locals_)})"
    branches: list[tuple[str, str, list[str]]] = []  # (kind, state, statements)
    for kind in kinds:
        rows = targets[(kind, w.event)]
        names = _Names(target, key_local, f"plane.instances[{kind!r}]", locals_, built)
        found = 0
        for state in sorted(rows, key=lambda s: s not in holding.get(kind, ())):
            written = getattr(rows[state], "written", None)
            statements = None if written is None else _written_in(
                written.body, written.names, scope, f"I{tag}_{len(branches)}_", names, quiet=not last)
            if statements is not None:
                branches.append((kind, state, statements))
                found += 1
            if found == _MAX_STATES:
                break
    if not branches:
        return None
    bind = [f"{locals_[f]} = {e}" for f, e in exprs.items() if f != w.event.key_field]
    if isinstance(w.target, Requesters):
        # One requester, at the row's end: its wake-up written in where its row is.
        req, reqs = f"req{tag}", f"reqs{tag}"
        lines = [f"{reqs} = {action_reader(action, action_field)(w.target.field)}",
                 f"{target} = None",
                 f"if len({reqs}) == 1 and not queue:",
                 f"    {req} = {reqs}[0]",
                 f"    {key_local} = {exprs[w.event.key_field]}",
                 f"    {target} = plane.instances.get({req}[0], EMPTY{tag}).get({key_local})"]
        scope[f"EMPTY{tag}"] = {}
        tests = [f"{target} is not None and {req}[0] == {kind!r} and {target}.state == {state!r}"
                 for kind, state, _ in branches]
        bind = prelude + bind
    else:
        scope[f"KIND{tag}"] = w.target
        state_local = f"st{tag}"
        lines = prelude + [f"{key_local} = {exprs[w.event.key_field]}",
                           f"{target} = plane.instances[KIND{tag}].get({key_local})",
                           f"{state_local} = None if {target} is None or queue else {target}.state"]
        tests = [f"{state_local} == {state!r}" for _, state, _ in branches]
    for k, ((_, _, statements), test) in enumerate(zip(branches, tests)):
        lines.append(f"{'if' if k == 0 else 'elif'} {test}:")
        lines += ["    " + line for line in bind + statements]
    lines.append("else:")
    lines += ["    " + line for line in wire_lines(w, action, scope, tag, action_field)]
    return lines


class _Names(NamedTuple):
    """What a written-in row's arguments become at the wire."""

    inst: str  # the target instance's local
    key: str  # its key's local
    insts: str  # the expression of its kind's instances
    fields: dict[str, str]  # event field -> the local holding it
    event: str  # the expression that builds the event (for a row that passes it on)


def _written_in(body: list[str], names: dict[str, Any], scope: dict[str, Any], prefix: str, at: _Names,
                quiet: bool) -> list[str] | None:
    """The statements of a plane row (its ``WrittenRow`` text) to run at a
    wire, over the wire's locals ``at``; its scope names bound in ``scope``
    under ``prefix``, as are its own locals.  None where the row cannot be
    written in (see the module's doc), or, with ``quiet``, where it appends
    to out or the queue, drops an instance or returns before its end."""
    template = _template(tuple(body), quiet)
    if template is None:
        return None
    text, slots = template
    values = []
    for what, name in slots:
        if what == "field":
            local = at.fields.get(name)
            if local is None:
                return None  # a field the wire leaves to its default: not written in
            values.append(local)
        elif what == "scope":
            if name not in names:
                return None  # not bound in the row's scope (cannot happen in a generated row): leave it alone
            scope[prefix + name] = names[name]
            values.append(prefix + name)
        elif what == "local":
            values.append(prefix + name)
        else:
            values.append(getattr(at, what))
    return text.format(*values).splitlines()


_SLOT = re.compile(r"__P(\d+)__")


@functools.lru_cache(maxsize=4096)  # row texts: one per compiled row of each machine set
def _template(body: tuple[str, ...], quiet: bool) -> tuple[str, list[tuple[str, str]]] | None:
    """A row's text as a format string with every name a wire fills in as
    a numbered field ``{n}``, and what each is: ("field", name) for
    ``ev.<name>``, ("scope", name), ("local", name), or the ``_Names``
    attribute it takes (inst, key, insts, event).  Made once per row text,
    filled per wire."""
    if len(body) > _MAX_LINES:
        return None  # the call it saves is a small part of such a row's cost; its text, of compiling
    text = "\n".join(body)
    if "__P" in text:
        return None  # a name that looks like a slot: leave the row alone
    function = ast.parse(text).body[0]
    assert isinstance(function, ast.FunctionDef)
    statements = _WithoutNotes().visit(function).body
    if quiet:
        if not statements or not isinstance(statements[-1], ast.Return):
            return None
        statements = statements[:-1]
    # One walk: what refuses the row, what is not quiet, the names it stores and reads.
    local: set[str] = set()
    read: set[str] = set()
    for s in statements:
        for n in ast.walk(s):
            if isinstance(n, ast.Name):
                (local if isinstance(n.ctx, ast.Store) else read).add(n.id)
                if quiet and n.id in ("out", "queue", "insts"):
                    return None  # appends to out or the queue, or drops an instance
            elif isinstance(n, _REFUSED) or (quiet and isinstance(n, (ast.Delete, ast.Return))):
                return None
    local -= _PARAMS
    rewriter = _Rewriter(read - local - _PARAMS - _BUILTINS, local)
    statements = [rewriter.visit(s) for s in statements]
    lines = [line for s in statements for line in ast.unparse(ast.fix_missing_locations(s)).splitlines()]
    # A format string: the text's own braces doubled, each slot ``{n}``, filled in C.
    text = "\n".join(lines or ["pass"]).replace("{", "{{").replace("}", "}}")
    return _SLOT.sub(r"{\1}", text), rewriter.slots


_PARAMS = frozenset(ROW_PARAMS)
_BUILTINS = frozenset(dir(builtins))
# What a written-in row may not hold: a raise (a protocol error closes the
# instance through its dispatcher), a handler, or a scope of its own.
_REFUSED = (ast.Raise, ast.Try, ast.Global, ast.Nonlocal, ast.Lambda, ast.FunctionDef, ast.Yield, ast.Await)


class _WithoutNotes(ast.NodeTransformer):
    """Drops ``if note: plane._top = ...`` (the recording branch, never
    taken at a wire) wherever it is."""

    def visit_If(self, node: ast.If) -> Any:
        if isinstance(node.test, ast.Name) and node.test.id == "note":
            return node.orelse or None
        self.generic_visit(node)
        return node


class _Rewriter(ast.NodeTransformer):
    """Replaces the names a wire fills in by numbered slots (see _template)."""

    def __init__(self, scope_names: set[str], local: set[str]):
        self.scope_names, self.local = scope_names, local
        self.slots: list[tuple[str, str]] = []
        self._numbers: dict[tuple[str, str], int] = {}

    def _slot(self, what: str, name: str, node: ast.AST) -> ast.AST:
        n = self._numbers.get((what, name))
        if n is None:
            n = self._numbers[(what, name)] = len(self.slots)
            self.slots.append((what, name))
        ctx = getattr(node, "ctx", ast.Load())
        return ast.copy_location(ast.Name(f"__P{n}__", ctx), node)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if isinstance(node.value, ast.Name) and node.value.id == "ev":
            return self._slot("field", node.attr, node)  # a property is refused when filled (not a field)
        self.generic_visit(node)
        return node

    def visit_Name(self, node: ast.Name) -> ast.AST:
        name = node.id
        if name in ("note", "created"):  # the wire's target exists; only the stimulus's own row notes
            return ast.copy_location(ast.Constant(False), node)
        if name in ("inst", "key", "insts"):
            return self._slot(name, "", node)
        if name == "ev":
            return self._slot("event", "", node)
        if name in self.scope_names:
            return self._slot("scope", name, node)
        if name in self.local:
            return self._slot("local", name, node)
        return node
