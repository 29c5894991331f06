"""Row helpers so a machine's table reads as one list of facts.

``on(src, Event, dest, *Actions, when=guard, do=effect)`` is a transition;
``ignore`` and ``error`` declare the other two outcomes.  ``src`` and the
event may be lists, which expand to one row per pair.  A guard's docstring
is its label in the diagrams.
"""
from __future__ import annotations

from typing import Iterable

from .spec import Ignore, ProtocolError, Transition


def _many(x) -> tuple:
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def on(src, event, dest, *actions, when=None, do=None, acquires=()) -> list[Transition]:
    doc = (when.__doc__ or when.__name__).strip() if when is not None else ""
    return [
        Transition(s, e, dest, guard=when, guard_doc=doc, effect=do, actions=tuple(actions), acquires=acquires)
        for s in _many(src)
        for e in _many(event)
    ]


def ignore(src, event, reason: str) -> list[Ignore]:
    return [Ignore(s, e, reason) for s in _many(src) for e in _many(event)]


def error(src, event, reason: str) -> list[ProtocolError]:
    return [ProtocolError(s, e, reason) for s in _many(src) for e in _many(event)]


def rows(*groups: Iterable) -> tuple:
    return tuple(r for g in groups for r in g)
