"""Base types shared by every machine: events, actions, instances, timers.

Actions are frozen msgspec Structs (cheaper to build: one is built per
emitted row entry); events are attrs slots classes, except those the plane
builds itself per dispatch, frozen Structs too (``StructEvent``); none is
mutated once built.  ``fields`` reads either kind's fields alike.  Each class says, as
class variables, which resources it acquires or releases; the definition-time
validator uses these to prove that every path to a terminal state releases
everything a state holds.

Every subclass registers itself under its module and name (``declared``), so
the event log's name tables are built from the definitions, not kept by hand.
A class that is never an event or action itself (a common base) says
``abstract = True`` in its own body.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, TypeVar

import attrs
import msgspec


# base class -> module -> class name -> class, in definition order.
_DECLARED: dict[type, dict[str, dict[str, type[Any]]]] = {}

_T = TypeVar("_T")


def _register(base: type, cls: type) -> None:
    # attrs' slots classes are rebuilt under the same name: the rebuilt
    # (final) class replaces the first one.
    if not cls.__dict__.get("abstract", False):
        _DECLARED.setdefault(base, {}).setdefault(cls.__module__, {})[cls.__name__] = cls


def declared(base: type[_T], *modules: str) -> dict[str, type[_T]]:
    """Name -> class of every non-abstract subclass of ``base`` (``Event`` or
    ``Action``) defined in ``modules``."""
    by_module = _DECLARED.get(base, {})
    return {name: cls for m in modules for name, cls in by_module.get(m, {}).items()}


class Event:
    """A stimulus.  Subclasses are attrs slots classes (``@attrs.define(slots=True, unsafe_hash=True)``),
    or frozen Structs through ``StructEvent`` where the plane builds them on every request.

    ``machine`` names the machine kind the plane routes it to and ``key_field``
    the attribute holding that machine's id.
    """

    __slots__ = ()
    machine: ClassVar[str] = ""
    key_field: ClassVar[str] = "request_id"
    # Resources handed to the machine by the event itself (e.g. blocks the
    # scheduler allocated) and obligations the event discharges (an abort
    # discharges the duty to report a recv the scheduler no longer awaits).
    acquires: ClassVar[frozenset[str]] = frozenset()
    releases: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(Event, cls)

    def refund(self) -> "Action | None":
        """The action that gives back what this event carried when the plane
        refuses it (unknown id, protocol error).  Required of every event
        that acquires something and that some state refuses."""
        return None


class StructEvent(msgspec.Struct, Event, frozen=True, gc=False):
    """The base of the events the plane itself builds per dispatch (its wires'
    events, TimerFired): a frozen Struct, built in C like an action, with the
    plain fields an attrs event would have (no converters or validators)."""

    abstract: ClassVar[bool] = True


class Action(msgspec.Struct, frozen=True, gc=False):
    """An instruction for the world (transport, scheduler) or for the plane.

    A frozen Struct: built in C, hashable, compared by class and fields.
    ``gc=False``: an action holds strings, numbers and tuples of them, never
    a container that could close a reference cycle, so the collector need
    not track the millions built."""

    acquires: ClassVar[frozenset[str]] = frozenset()
    releases: ClassVar[frozenset[str]] = frozenset()
    # Internal actions are executed by the ControlPlane itself (timers,
    # engine references, heartbeat registration) and never reach a transport.
    internal: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(Action, cls)


@attrs.define(slots=True)
class Instance:
    """Per-machine-instance data.  Subclasses add their own fields.

    Mutable on purpose: a transition updates a few slots in place instead of
    allocating a new object per event.

    ``timer_at`` is the plane's, not the table's: when its one live timer
    entry comes due (None: it has none).  A deadline that moves later keeps
    that entry, which re-arms at the deadline when it comes due, so a lease
    extended on every heartbeat is one entry, not one per heartbeat.
    """

    key: Any
    state: str
    deadline: float | None = None
    timer_at: float | None = None


class TimerFired(StructEvent, frozen=True):
    """A deadline armed by ``ArmTimer`` came due.  ``at`` identifies which arm.
    Built by the plane for every timer it fires: a Struct, like its wires' events."""

    kind: str
    key: Any
    at: float
    machine: ClassVar[str] = ""  # routed by ``kind``
    key_field: ClassVar[str] = "key"


class ArmTimer(Action, frozen=True):
    kind: str
    key: Any
    at: float
    internal: ClassVar[bool] = True


class CancelTimer(Action, frozen=True):
    kind: str
    key: Any
    internal: ClassVar[bool] = True


def resources(*names: str) -> frozenset[str]:
    return frozenset(names)


def is_finite_number(x: Any) -> bool:
    """A real, finite number (not a bool, not None, not NaN or +-inf): what
    every time, offset and deadline crossing into the core must be."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@attrs.frozen
class StructField:
    """The part of ``attrs.Attribute`` the framework reads, for a Struct's field
    (a Struct field has no converter, validator or alias, and is positional)."""

    name: str
    type: str
    default: Any = attrs.NOTHING
    converter: None = None
    validator: None = None
    kw_only: bool = False
    init: bool = True

    @property
    def alias(self) -> str:
        return self.name


_STRUCT_FIELDS: dict[type, tuple[StructField, ...]] = {}


def fields(cls: type) -> tuple[Any, ...]:
    """The fields of an event or action class, in order: ``attrs.fields`` for
    an attrs class, ``StructField`` records for a msgspec Struct (its
    annotations as written: strings, as attrs keeps them here)."""
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        return attrs.fields(cls)  # type: ignore[arg-type]  # an attrs class, which type cannot say
    known = _STRUCT_FIELDS.get(cls)
    if known is None:
        annotations: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            annotations.update(klass.__dict__.get("__annotations__", {}))
        names, defaults = cls.__struct_fields__, cls.__struct_defaults__
        first_default = len(names) - len(defaults)
        known = _STRUCT_FIELDS[cls] = tuple(
            StructField(name, annotations[name],
                        _as_attrs_default(defaults[i - first_default]) if i >= first_default else attrs.NOTHING)
            for i, name in enumerate(names))
    return known


def runs_code_when_built(cls: type) -> bool:
    """Whether building ``cls`` runs a hook of its own (attrs' pre/post-init, a
    Struct's ``__post_init__``): then only building it tells what it accepts."""
    return any(hasattr(cls, hook) for hook in ("__attrs_pre_init__", "__attrs_post_init__", "__post_init__"))


def built_from_fields(cls: type) -> bool:
    """Whether ``cls`` is built from its fields alone: no hook (see
    ``runs_code_when_built``), converter or validator runs when it is, so
    its fields can stand in for an instance not yet built."""
    return not runs_code_when_built(cls) and all(
        f.init and f.converter is None and f.validator is None for f in fields(cls))


def _as_attrs_default(default: Any) -> Any:
    # A Struct field's default_factory reads as attrs' Factory, which readers of defaults already handle.
    factory = getattr(default, "factory", None) if type(default).__module__ == "msgspec._core" else None
    return attrs.Factory(factory) if factory is not None else default
