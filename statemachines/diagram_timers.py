"""What each state's timer waits for, read off the spec and a PlaneConfig.

The diagrams show every deadline with its default value, taken from the
code rather than written down beside it: a state's ``deadline`` function
and the effects that set the instance fields it reads are evaluated on a
probe instance at ``now = 0`` with the given config.  A config read is
traced (``_TracedConfig``), so a timer names the settings it depends on
(``recv_timeout``, ``lease_extension``, ...) with their values.

Evaluation only: nothing here is on the hot path and nothing is stored.
"""
from __future__ import annotations

import math
from typing import Any

import attrs

from .spec import Spec, Transition, transitions_of

# A time far from any default duration: moving a field this far moves a
# deadline that reads it, whether through +, min or max.
_FAR = 1e9
# Probe times: a field set relative to ``now`` moves with it.
_LATER = 1000.0


class _Stub:
    """An event whose every field is ``value`` (the effects are probed, not run)."""

    def __init__(self, value: Any):
        self._value = value

    def __getattr__(self, name: str) -> Any:
        return self._value


# Field values a stub event tries in turn: None (an optional field left out),
# then an empty sequence (for an effect that iterates one).
_STUBS = (_Stub(None), _Stub(()))


class _TracedConfig:
    """A PlaneConfig that records the names read through it, and doubles
    the one named ``bump`` (to see what depends on it)."""

    def __init__(self, config: Any, bump: str = ""):
        self._config = config
        self._bump = bump
        self.read: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name not in self.read:
            self.read.append(name)
        value = getattr(self._config, name)
        return value * 2 if name == self._bump else value


@attrs.frozen
class Setting:
    """A config value a timer depends on."""

    name: str
    value: float

    def __str__(self) -> str:
        return f"{self.name} {seconds(self.value)}"


@attrs.frozen
class FieldSetter:
    """An effect that sets a time field a deadline reads."""

    field: str
    effect: str
    events: tuple[str, ...]
    # The value set, relative to now (None: not relative to now).
    offset: float | None
    settings: tuple[Setting, ...]
    doc: str

    def describe(self) -> str:
        if self.offset is None:
            value = "a time"
        elif self.offset:
            value = f"now {'+' if self.offset > 0 else '-'} {seconds(abs(self.offset))}"
        else:
            value = "now"
        uses = f" ({', '.join(str(s) for s in self.settings)})" if self.settings else ""
        return f"{self.field} = {value}{uses} on {' | '.join(self.events)}"


@attrs.frozen
class StateTimer:
    """A state's deadline: the fields and settings it reads, and its default
    value relative to the time those fields were set."""

    state: str
    fields: tuple[str, ...]
    settings: tuple[Setting, ...]
    default: float

    def describe(self) -> str:
        inputs = list(self.fields) + [str(s) for s in self.settings]
        return f"timer {seconds(self.default)} ({', '.join(inputs)})"


def seconds(x: float) -> str:
    return f"{x:g} s"


def event_name(event: type) -> str:
    return "timeout" if event.__name__ == "TimerFired" else event.__name__


def _probe(spec: Spec, state: str, **fields: Any):
    inst = spec.instance_type(key="probe", state=state)
    for name, value in fields.items():
        setattr(inst, name, value)
    return inst


def _time_fields(spec: Spec) -> list[str]:
    inst = _probe(spec, spec.initial)
    return [f.name for f in attrs.fields(type(inst))
            if f.name not in ("key", "state") and isinstance(getattr(inst, f.name), float)]


def _entering(spec: Spec, state: str) -> Transition | None:
    """The first transition from another state into ``state`` that has an effect."""
    return next((t for t in transitions_of(spec) if t.dest == state and t.src != state and t.effect is not None),
                None)


def _run(effect, inst, config: Any, now: float) -> bool:
    for stub in _STUBS:
        try:
            effect(inst, stub, config, now)
            return True
        except (TypeError, AttributeError, ValueError):
            continue
    return False


def _in_source(t: Transition, spec: Spec, config: Any):
    """A probe instance in ``t.src`` as the effect that entered it left it."""
    inst = _probe(spec, t.src)
    before = _entering(spec, t.src)
    if before is not None:
        _run(before.effect, inst, config, 0.0)
    return inst


def _apply(t: Transition, spec: Spec, config: Any, now: float, bump: str = ""):
    """(instance, config names read) after ``t``'s effect on a probe in its
    source state; None when the effect needs event data the stubs cannot give."""
    inst = _in_source(t, spec, config)
    traced = _TracedConfig(config, bump)
    if not _run(t.effect, inst, traced, now):
        return None
    return inst, traced.read


def _settings(config: Any, names: list[str]) -> tuple[Setting, ...]:
    values = {n: getattr(config, n) for n in names}
    return tuple(Setting(n, float(v)) for n, v in values.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool))


def _depends_on(t: Transition, spec: Spec, config: Any, field: str, value: float, read: list[str]) -> list[str]:
    """The config names (of those read) whose doubling changes what ``t`` sets ``field`` to."""
    used = []
    for name in read:
        bumped = _apply(t, spec, config, 0.0, bump=name)
        if bumped is not None and getattr(bumped[0], field) != value:
            used.append(name)
    return used


def field_setters(spec: Spec, config: Any) -> list[FieldSetter]:
    """Every (effect, time field) the spec's effects set, merged over events."""
    found: dict[tuple[str, str], FieldSetter] = {}
    fields = _time_fields(spec)
    for t in transitions_of(spec):
        if t.effect is None:
            continue
        at0, at_later = _apply(t, spec, config, 0.0), _apply(t, spec, config, _LATER)
        if at0 is None or at_later is None:
            continue
        (inst, read), (later, _) = at0, at_later
        start = _in_source(t, spec, config)
        for name in fields:
            v0, v1 = getattr(inst, name), getattr(later, name)
            if not (isinstance(v0, float) and isinstance(v1, float)) or v1 == getattr(start, name):
                continue  # not a time, or not set by this effect
            # Set relative to now when it moves with now.
            offset = v0 if math.isclose(v1 - v0, _LATER) else None
            key = (t.effect.__name__, name)
            events = found[key].events if key in found else ()
            if event_name(t.event) not in events:
                events += (event_name(t.event),)
            settings = _settings(config, _depends_on(t, spec, config, name, v0, read))
            found[key] = FieldSetter(name, t.effect.__name__, events, offset, settings,
                                     " ".join((t.effect.__doc__ or "").split()))
    return list(found.values())


def state_timers(spec: Spec, config: Any) -> dict[str, StateTimer]:
    """State name -> its timer, for every state with a deadline."""
    setters = field_setters(spec, config)
    fields = _time_fields(spec)
    timers = {}
    for state in spec.states:
        deadline = state.deadline
        if deadline is None:
            continue
        # Each field as the effect entering the state sets it, else as the
        # first effect that sets it does.
        entering = _entering(spec, state.name)
        values = {f: 0.0 for f in fields}
        entered_by = getattr(entering.effect, "__name__", None) if entering is not None else None
        own = [s for s in setters if s.effect == entered_by]
        for s in [*reversed(setters), *own]:
            if s.offset is not None:
                values[s.field] = s.offset
        traced = _TracedConfig(config)
        default = deadline(_probe(spec, state.name, **values), traced, 0.0)
        # A field the deadline reads moves it when moved far either way (so
        # that one read through min or max shows too).
        read = [f for f in fields
                if any(deadline(_probe(spec, state.name, **{**values, f: values[f] + d}), config, 0.0) != default
                       for d in (_FAR, -_FAR))]
        timers[state.name] = StateTimer(state.name, tuple(read), _settings(config, traced.read), float(default))
    return timers
