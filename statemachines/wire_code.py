"""A wire of ``composition`` as generated code: how the plane carries out an internal action.

``wire_lines`` writes the statements that turn one internal action into the
event(s) its ``Wire`` declares, appended to the plane's FIFO queue of
internal events; the plane runs them as the action's executor
(``wire_executor``) and inlines them into its compiled rows
(``plane_rows``), so both paths carry out a wire from the same code.
"""
from __future__ import annotations

from typing import Any, Callable

from .base import fields as fields_of
from .machine import generated
from .composition import (
    ActionField, ConfigField, Const, HeartbeatChain, Requesters, RequesterKey, RequesterKind, TargetField, Wire,
)


def wire_lines(w: Wire, action: str, scope: dict[str, Any], tag: str,
               action_field: Callable[[str], str] | None = None) -> list[str]:
    """Statements (not indented) over ``plane``, ``queue`` and the action
    variable ``action`` that queue the wire's event(s).  The names they bind,
    in ``scope`` and as locals, end in ``tag`` so that several wires can be
    inlined into one function.  ``action_field`` (name -> expression) reads
    the action's fields from elsewhere (a row that never built the action:
    plane_rows); by default they are ``action``'s attributes."""
    scope[f"EV{tag}"] = w.event
    target, req = f"tgt{tag}", f"req{tag}"
    lines, exprs = wire_fields(w, action, scope, tag, action_field)
    call = f"EV{tag}({event_arguments(w, exprs)})"
    if isinstance(w.target, Requesters):
        lines += [f"for {req} in {action_reader(action, action_field)(w.target.field)}:",
                  f"    queue.append({call})"]
    elif w.only_if_live or any(isinstance(source, TargetField) for _, source in w.fields):
        scope[f"KIND{tag}"] = w.target
        lines += [f"{target} = plane.instances[KIND{tag}].get({exprs[w.event.key_field]})",
                  f"if {target} is not None:", f"    queue.append({call})"]
    else:
        lines.append(f"queue.append({call})")
    return lines


def wire_fields(w: Wire, action: str, scope: dict[str, Any], tag: str,
                action_field: Callable[[str], str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The lines binding what the wire's fields read (the heartbeat chain),
    and each field of its event as an expression over ``action`` (or
    ``action_field``), ``plane``, the target instance ``tgt<tag>`` and, for
    a fan-out, the requester ``req<tag>`` (see ``wire_lines``)."""
    target, req, chain = f"tgt{tag}", f"req{tag}", f"chain{tag}"
    field_of = action_reader(action, action_field)

    def expr(field: str, source: Any) -> str:
        if isinstance(source, ActionField):
            return field_of(source.name)
        if isinstance(source, ConfigField):
            return f"plane.config.{identifier(source.name)}"
        if isinstance(source, Const):
            scope[f"c{tag}_{field}"] = source.value
            return f"c{tag}_{field}"
        if isinstance(source, TargetField):
            return f"{target}.{identifier(source.name)}"
        if isinstance(source, RequesterKind):
            return f"{req}[0]"
        if isinstance(source, RequesterKey):
            return f"{req}[1]"
        if isinstance(source, HeartbeatChain):
            return f"{chain}[{('since', 'last').index(source.which)}]"
        raise TypeError(f"unknown wire field source {source!r}")

    lines = []
    if any(isinstance(source, HeartbeatChain) for _, source in w.fields):
        lines.append(f"{chain} = plane.heartbeats.chain({field_of('engine_id')})")
    return lines, {field: expr(field, source) for field, source in w.fields}


def action_reader(action: str, action_field: Callable[[str], str] | None) -> Callable[[str], str]:
    """Field name -> the expression reading it from the action: ``action_field``,
    or by default the attribute of the variable ``action``."""
    return action_field or (lambda name: f"{action}.{identifier(name)}")


def event_arguments(w: Wire, exprs: dict[str, str]) -> str:
    """The event's constructor arguments: its fields in order while the wire
    gives each and the class takes them by position (a positional call is
    about half the cost of a keyword one), the rest by keyword."""
    given = dict(exprs)
    args = []
    for f in fields_of(w.event):
        if f.kw_only or not f.init or f.name not in given:
            break
        args.append(given.pop(f.name))
    args += [f"{identifier(field)}={value}" for field, value in given.items()]
    return ", ".join(args)


def wire_executor(w: Wire) -> Callable:
    """The internal-action handler that carries out one wire:
    ``run(plane, action, now, queue)`` appends the wire's event(s) to the
    queue, the event built with its fields in one call."""
    scope: dict[str, Any] = {}
    body = ["def run(plane, a, now, queue):"] + ["    " + line for line in wire_lines(w, "a", scope, "")]
    return generated(body, scope, "run", f"{__file__}: {w.action.__name__}")  # field names checked as identifiers


def identifier(name: str) -> str:
    if not name.isidentifier():
        raise ValueError(f"field name {name!r} is not an identifier")
    return name
