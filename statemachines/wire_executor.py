"""How the plane carries out a wire of ``composition``: an internal action
becomes the event(s) its ``Wire`` declares, appended to the plane's FIFO
queue of internal events.

``wire_executor(w)`` reads the wire once and returns
``run(plane, action, now, queue)``; the plane keeps one per internal action
class.  The event is built with the fields the wire names, each read from
where the wire says (the action, the plane's config, a constant, the
target instance, the requester, the heartbeat chain).
"""
from __future__ import annotations

from typing import Any, Callable

from .base import Action, Event
from .base import fields as fields_of
from .composition import (
    ActionField, ConfigField, Const, EngineField, HeartbeatChain, Requesters, RequesterKey, RequesterKind, TargetField, Wire,
)

# A field's reader: (action, plane, target instance, requester, heartbeat chain) -> its value.
_Reader = Callable[[Action, Any, Any, Any, Any], Any]
# run(plane, action, now, queue): queues the wire's event(s).
Executor = Callable[[Any, Action, float, list], None]


def _reader(source: Any) -> _Reader:
    if isinstance(source, ActionField):
        name = source.name
        return lambda a, plane, tgt, req, chain: getattr(a, name)
    if isinstance(source, ConfigField):
        name = source.name
        return lambda a, plane, tgt, req, chain: getattr(plane.config, name)
    if isinstance(source, Const):
        value = source.value
        return lambda a, plane, tgt, req, chain: value
    if isinstance(source, TargetField):
        name = source.name
        return lambda a, plane, tgt, req, chain: getattr(tgt, name)
    if isinstance(source, RequesterKind):
        return lambda a, plane, tgt, req, chain: req[0]
    if isinstance(source, RequesterKey):
        return lambda a, plane, tgt, req, chain: req[1]
    if isinstance(source, HeartbeatChain):
        index = ("since", "last").index(source.which)
        return lambda a, plane, tgt, req, chain: chain[index]
    if isinstance(source, EngineField):
        name = source.name

        def read_engine(a, plane, tgt, req, chain):
            engine = plane.instances["remote_engine"].get(a.engine_id)
            return None if engine is None else getattr(engine, name)

        return read_engine
    raise TypeError(f"unknown wire field source {source!r}")


def wire_executor(w: Wire) -> Executor:
    """The internal-action handler that carries out wire ``w``."""
    event: type[Event] = w.event
    sources = dict(w.fields)
    # The event's fields in order while the wire gives each and the class
    # takes them by position (a keyword call costs about twice), the rest by keyword.
    positional = []
    for f in fields_of(event):
        if f.kw_only or not f.init or f.name not in sources:
            break
        positional.append(_reader(sources[f.name]))
    by_position = tuple(positional)
    taken = {f.name for f in fields_of(event)[:len(by_position)]}
    by_keyword = tuple((field, _reader(source)) for field, source in w.fields if field not in taken)
    chained = any(isinstance(source, HeartbeatChain) for _, source in w.fields)
    key = _reader(sources[event.key_field]) if event.key_field in sources else None

    def build(a: Action, plane: Any, tgt: Any, req: Any, chain: Any) -> Event:
        args = [read(a, plane, tgt, req, chain) for read in by_position]
        if by_keyword:
            return event(*args, **{field: read(a, plane, tgt, req, chain) for field, read in by_keyword})
        return event(*args)

    # Only a chained wire reads the heartbeat chain (None for the others, without a call).
    def chain_of(plane: Any, a: Action) -> Any:
        return plane.heartbeats.chain(a.engine_id)  # type: ignore[attr-defined]

    if isinstance(w.target, Requesters):
        requesters = w.target.field

        def fan_out(plane: Any, a: Action, now: float, queue: list) -> None:
            chain = chain_of(plane, a) if chained else None
            for req in getattr(a, requesters):
                queue.append(build(a, plane, None, req, chain))

        return fan_out
    target = w.target
    if w.only_if_live or any(isinstance(source, TargetField) for _, source in w.fields):
        if key is None:
            raise TypeError(f"wire {w.action.__name__} names no {event.key_field} to find its target by")
        live_key = key

        def if_live(plane: Any, a: Action, now: float, queue: list) -> None:
            chain = chain_of(plane, a) if chained else None
            tgt = plane.instances[target].get(live_key(a, plane, None, None, chain))
            if tgt is not None:
                queue.append(build(a, plane, tgt, None, chain))

        return if_live

    def always(plane: Any, a: Action, now: float, queue: list) -> None:
        queue.append(build(a, plane, None, None, chain_of(plane, a) if chained else None))

    return always
