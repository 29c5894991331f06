"""The ControlPlane: every machine of one instance (P or D), composed.

Sans-I/O, like dask's WorkerState: ``handle(event, now)`` and
``fire_due(now)`` return the actions the world must execute; nothing else
leaves.  The plane routes events by machine kind and id, creates a machine
on its creating event, discards it when it reaches a terminal state, and
executes internal actions itself (timers, heartbeat registration, and the
cross-machine wires declared in ``composition``), feeding the resulting
events to the other machines in FIFO order within the same call.  Which
event creates which machine is each spec's ``created_by``.  One timer heap
serves every machine.

Late, duplicate and unknown-id events are counted ignores; an event the
table declares a protocol error is counted and fails the machine closed
through its ordinary release path.  Neither ever raises out of ``handle``.

A machine that uses another machine's resource (``Spec.source``: a push
WRITEs from its lease's blocks) lives only while that resource is held: the
plane feeds it the source's end event when the source leaves its held
states, and instead of any event that it would handle in a state that needs
the source, or that would move it into one, while the source is not held
(an instance about to be created that way is not created).
"""
from __future__ import annotations

import functools
import heapq
import math
import operator
from collections import Counter, deque
from typing import Any, Callable

import attrs

from . import actions as A
from .base import Action, ArmTimer, CancelTimer, Event, TimerFired
from .composition import (
    WIRES, ActionField, ConfigField, Const, HeartbeatChain, Requesters, RequesterKey, RequesterKind, TargetField,
    Wire,
)
from .config import PlaneConfig
from .heartbeats import Heartbeats
from .machines import MACHINES
from .observe import Observer, Step
from .stats import (
    NONFINITE_DEADLINE, PROTOCOL_VIOLATION, SOURCE_NOT_HELD, UNKNOWN_ID, UNKNOWN_KIND, Anomaly, FailClosed, Final,
    Ignored, SourceEnded, StatKeys,
)
from .machine import IGNORED, Machine, ProtocolViolation, timer_action
from .spec import Source, transitions_of
from .validate import validate_sources
from .validate_composition import creators, validate_composition



class NonFiniteTime(ValueError):
    """``now`` passed to the plane is NaN or infinite: every deadline and
    gate would compare false.  The embedder's clock is broken; nothing is
    changed."""


def _check_now(now) -> None:
    if not math.isfinite(now):
        raise NonFiniteTime(f"now must be a finite number of seconds, got {now!r}")


class ControlPlane:
    def __init__(self, config: PlaneConfig | None = None, machines: dict[str, Machine] | None = None):
        self.config = config or PlaneConfig()
        self.machines = dict(machines or MACHINES)
        # kind -> (the Source it uses, the pairs entering its needs);
        # source kind -> ((user kind, Source), ...)
        self._sources, self._users = _source_wiring(tuple(self.machines.items()))
        # Event class -> the kind it creates; internal action class -> its executor.
        self._creators, self._internal = _composition(tuple(self.machines.items()))
        self.instances: dict[str, dict[Any, Any]] = {kind: {} for kind in self.machines}
        # What the heartbeat batches hold, for the driver and the explorer.
        self.heartbeats = Heartbeats(self.instances.get("heartbeat", {}), self.config)
        self._timers: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        # Keyed by the records of ``stats`` (and "heartbeats_sent").
        self.stats: Counter = Counter()
        self._stat_key = StatKeys()
        # Recent anomalies (unknown ids, protocol violations) for the embedder to log.
        self.anomalies: deque = deque(maxlen=256)
        # Sees one Step per top-level stimulus (the event log); None costs nothing.
        self.recorder: Observer | None = None
        self._top: tuple | None = None  # the stimulus being handled, logged once its effects are known

    # ------------------------------------------------------------------ input
    def handle(self, event: Event, now: float) -> list[Action]:
        """Feed one external stimulus; returns the actions for the world.
        Raises NonFiniteTime, and does nothing, when ``now`` is not finite."""
        _check_now(now)
        out: list[Action] = []
        queue: list[Event] = []  # internal events, FIFO by index (no deque per call)
        self._dispatch(event, now, out, queue, True)
        i = 0
        while i < len(queue):
            self._dispatch(queue[i], now, out, queue, False)
            i += 1
        if self._top is not None and self.recorder is not None:  # _top is only set while recording
            # The log line of this stimulus: the addressed machine's own
            # actions, then the external effects of the internal events they
            # set off, so replay also checks what other machines did.
            event, kind, key, before, after, own, n_own = self._top
            self._top = None
            self.recorder(Step(event, now, kind, key, before, after, own + out[n_own:]))
        return out

    def next_deadline(self) -> float | None:
        """The earliest armed timer, or None."""
        timers = self._timers
        while timers and not self._timer_live(timers[0]):
            heapq.heappop(timers)
        return timers[0][0] if timers else None

    def fire_due(self, now: float) -> list[Action]:
        """Fire every timer due at ``now``; returns the actions for the world."""
        _check_now(now)
        out: list[Action] = []
        timers = self._timers
        while timers and timers[0][0] <= now:
            entry = heapq.heappop(timers)
            if not self._timer_live(entry):
                continue
            at, _, kind, key = entry
            acts = self.handle(TimerFired(kind, key, at), now)
            for a in acts:
                if a.__class__ is A.SendHeartbeat:
                    self.stats["heartbeats_sent"] += 1
            out.extend(acts)
        return out

    def clone(self) -> "ControlPlane":
        """A copy of the semantic state (instances, timers, heartbeats), not
        of stats, anomalies or the recorder; much faster than deepcopy (the
        explorer clones a plane per explored move)."""
        q = ControlPlane(self.config, self.machines)
        q.instances = {kind: {key: _copy_instance(i) for key, i in insts.items()}
                       for kind, insts in self.instances.items()}
        q.heartbeats = Heartbeats(q.instances.get("heartbeat", {}), q.config)
        q._timers = list(self._timers)
        q._seq = self._seq
        return q

    # ---------------------------------------------------------------- queries
    def get(self, kind: str, key: Any):
        return self.instances[kind].get(key)

    def live(self) -> dict[str, int]:
        return {kind: len(insts) for kind, insts in self.instances.items()}

    def held(self) -> list[tuple[str, Any, str, tuple[str, ...]]]:
        """Every live machine that holds a resource: the leak report."""
        report = []
        for kind, insts in self.instances.items():
            states = self.machines[kind].states
            for key, inst in insts.items():
                holds = states[inst.state].holds
                if holds:
                    report.append((kind, key, inst.state, tuple(sorted(holds))))
        return report

    # --------------------------------------------------------------- dispatch
    def _dispatch(self, event: Event, now: float, out: list, queue: list, top: bool) -> None:
        # Route: the event class names its machine kind (internal wake-ups
        # carry it as ``kind``) and which field holds the instance id.
        cls = type(event)
        kind = cls.machine or event.kind  # type: ignore[attr-defined]  # an event routed by kind has one
        key = getattr(event, cls.key_field)
        insts = self.instances.get(kind)
        if insts is None:
            self._anomaly(UNKNOWN_KIND, kind, key, event)
            if top and self.recorder is not None:
                self.recorder(Step(event, now, kind, key, None, None, IGNORED))
            return
        machine = self.machines[kind]
        inst = insts.get(key)
        created = inst is None
        if inst is None:
            if self._creators.get(cls) != kind:
                self._refuse_uncreated(event, kind, key, UNKNOWN_ID, "", now, out, top)
                return
            inst = insts[key] = machine.new(key)
        before, old_deadline = inst.state, inst.deadline
        applied = event
        wired = self._sources.get(kind)
        if wired is not None:
            source, entries = wired
            if (before in source.needs or (before, cls) in entries) and not self._source_held(source, key):
                # The resource is gone or was never held: a machine that
                # needs it ends now, one about to take it never does.
                if created:
                    del insts[key]
                    self._refuse_uncreated(event, kind, key, SOURCE_NOT_HELD, source.kind, now, out, top)
                    return
                applied = self._source_ended(source, kind, key, cls)
        try:
            acts = machine.apply(inst, applied, self.config, now)
        except ProtocolViolation as exc:
            self._anomaly(PROTOCOL_VIOLATION, kind, key, event, exc.reason)
            acts = self._fail_closed(machine, inst, now)
            refund = event.refund()
            if refund is not None:
                acts = [*acts, refund]
        else:
            if applied is not event:
                refund = event.refund()
                if refund is not None:
                    acts = [*acts, refund]
        if acts is IGNORED:
            self.stats[self._stat_key(Ignored, kind, before, cls.__name__)] += 1
        deadline = inst.deadline
        if deadline is not None and deadline != old_deadline:
            if not math.isfinite(deadline):
                # A deadline that is not a number (a NaN or infinite duration
                # in an event) would never fire, or break the heap: the
                # machine times out now, through its ordinary release path.
                self._anomaly(NONFINITE_DEADLINE, kind, key, event, repr(deadline))
                deadline = inst.deadline = now
            self._seq += 1
            heapq.heappush(self._timers, (deadline, self._seq, kind, key))
        if top and self.recorder is not None:
            timer = timer_action(kind, key, old_deadline, deadline)
            own = [*acts] if timer is None else [*acts, timer]
            self._top = (event, kind, key, before, inst.state, own, len(out) + sum(
                1 for a in acts if not a.internal))
        if inst.state in machine.terminal_states:
            del insts[key]
            self.stats[self._stat_key(Final, kind, inst.state)] += 1
        elif created and inst.state == machine.spec.initial:
            del insts[key]  # the creating event was refused: keep no empty machine
        users = self._users.get(kind)
        if users is not None and inst.state != before:
            for user_kind, src in users:
                if before in src.held and inst.state not in src.held and key in self.instances[user_kind]:
                    queue.append(self._source_ended(src, user_kind, key, cls))
        internal = self._internal
        for a in acts:
            if a.internal:
                internal[a.__class__](self, a, now, queue)
            else:
                out.append(a)

    def _refuse_uncreated(self, event: Event, kind: str, key: Any, what: str, detail: str, now: float,
                          out: list, top: bool) -> None:
        """An event that addresses no instance and may not create one: a
        counted anomaly.  What the event carried goes back (e.g. a handshake
        that lands after its engine was evicted removes the agent it added)."""
        self._anomaly(what, kind, key, event, detail)
        refund = event.refund()
        acts = IGNORED if refund is None else [refund]
        out.extend(acts)
        if top and self.recorder is not None:
            # Logged too, so a log holds every stimulus; no instance: no states.
            self.recorder(Step(event, now, kind, key, None, None, acts))

    def _fail_closed(self, machine: Machine, inst, now: float) -> list[Action] | tuple[()]:
        fc = machine.spec.fail_closed_event
        if fc is None or machine.is_terminal(inst) or inst.state == machine.spec.initial:
            return []
        self.stats[self._stat_key(FailClosed, machine.name)] += 1
        return machine.apply(inst, _fail_closed_event(fc, machine.name, inst.key), self.config, now)

    def _source_held(self, source: Source, key: Any) -> bool:
        inst = self.instances[source.kind].get(key)
        return inst is not None and inst.state in source.held

    def _source_ended(self, source: Source, kind: str, key: Any, cause: type) -> Event:
        inst = self.instances[source.kind].get(key)
        self.stats[self._stat_key(SourceEnded, kind, cause.__name__)] += 1
        # ``Source.ended`` has these fields by its contract (see Source).
        return source.ended(kind=kind, request_id=key,  # type: ignore[call-arg]
                            source_state=None if inst is None else inst.state)

    def _anomaly(self, what: str, kind: str, key: Any, event: Event, detail: str = "") -> None:
        self.stats[self._stat_key(Anomaly, what, kind, type(event).__name__)] += 1
        self.anomalies.append((what, kind, key, type(event).__name__, detail))

    # -------------------------------------------------------- internal actions
    def _do_arm(self, a: ArmTimer, now: float, queue: list) -> None:
        self._arm(a.at, a.kind, a.key)

    def _do_cancel(self, a: CancelTimer, now: float, queue: list) -> None:
        pass  # lazy deletion: a popped entry whose deadline moved is skipped

    # Internal actions the plane runs itself; the wired ones are added per plane.
    _own_internal: dict = {
        ArmTimer: _do_arm, CancelTimer: _do_cancel,
    }

    def _arm(self, at: float, kind: str, key: Any) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (at, self._seq, kind, key))

    def _timer_live(self, entry) -> bool:
        at, _, kind, key = entry
        inst = self.instances[kind].get(key)
        return inst is not None and inst.deadline == at


@functools.lru_cache(maxsize=64)
def _source_wiring(machines: tuple) -> tuple[dict, dict]:
    """Who uses whose resource, checked once per set of machines (the
    explorer builds a plane per explored move)."""
    specs = {kind: m.spec for kind, m in machines}
    validate_sources(specs)
    sources: dict[str, tuple[Source, frozenset[tuple[str, type[Event]]]]] = {}
    users: dict[str, tuple[tuple[str, Source], ...]] = {}
    for kind, spec in specs.items():
        src = spec.source
        if src is None:
            continue
        # (state, event) pairs that may enter a state needing the source from
        # one that does not: checked before they are applied.
        entries = frozenset((t.src, t.event) for t in transitions_of(spec)
                            if t.dest in src.needs and t.src not in src.needs)
        sources[kind] = (src, entries)
        users[src.kind] = users.get(src.kind, ()) + ((kind, src),)
    return sources, users


@functools.lru_cache(maxsize=64)
def _composition(machines: tuple) -> tuple[dict, dict]:
    """Creating events and the executor of every internal action, checked
    once per set of machines."""
    specs = {kind: m.spec for kind, m in machines}
    validate_composition(specs)
    internal = dict(ControlPlane._own_internal)
    internal.update((w.action, _wire_executor(w)) for w in WIRES)
    return creators(specs), internal


def _field_getter(source) -> Callable:
    """getter(plane, action, target instance, requester) for one field of a wire."""
    if isinstance(source, ActionField):
        name = source.name
        return lambda plane, a, inst, req: getattr(a, name)
    if isinstance(source, ConfigField):
        name = source.name
        return lambda plane, a, inst, req: getattr(plane.config, name)
    if isinstance(source, Const):
        value = source.value
        return lambda plane, a, inst, req: value
    if isinstance(source, TargetField):
        name = source.name
        return lambda plane, a, inst, req: getattr(inst, name)
    if isinstance(source, RequesterKind):
        return lambda plane, a, inst, req: req[0]
    if isinstance(source, RequesterKey):
        return lambda plane, a, inst, req: req[1]
    if isinstance(source, HeartbeatChain):
        index = ("since", "last").index(source.which)
        return lambda plane, a, inst, req: plane.heartbeats.chain(a.engine_id)[index]
    raise TypeError(f"unknown wire field source {source!r}")


def _tuple_getter(names: tuple[str, ...]) -> Callable:
    """getter(obj) -> the tuple of those attributes (one C call for several)."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        get = operator.attrgetter(names[0])
        return lambda obj: (get(obj),)
    return lambda obj: ()


def _keyword_maker(cls: type, names: tuple[str, ...]) -> Callable:
    """make(v0, v1, ...) -> cls(name0=v0, name1=v1, ...).

    Events take keyword arguments only; building the keyword dict per call
    (``cls(**dict(zip(names, values)))``) cost about as much as the event.
    The maker is compiled once per wire from the event's own field names,
    the way attrs compiles ``__init__``."""
    for name in names:
        if not name.isidentifier():
            raise ValueError(f"{cls.__name__}: field name {name!r} is not an identifier")
    params = ", ".join(f"v{i}" for i in range(len(names)))
    call = ", ".join(f"{name}=v{i}" for i, name in enumerate(names))
    return eval(f"lambda {params}: cls({call})", {"cls": cls})  # noqa: S307 (names checked above)


def _wire_executor(w: Wire) -> Callable:
    """The internal-action handler that carries out one wire."""
    cls = w.event
    # Fields copied from the action are read in one C call (the common case,
    # and this runs for most internal actions); the rest through getters.
    copied = tuple((field, source.name) for field, source in w.fields if isinstance(source, ActionField))
    read_copied = _tuple_getter(tuple(name for _, name in copied))
    others = tuple((field, _field_getter(source)) for field, source in w.fields
                   if not isinstance(source, ActionField))
    getters = tuple(get for _, get in others)
    make = _keyword_maker(cls, tuple(field for field, _ in copied) + tuple(field for field, _ in others))
    if isinstance(w.target, Requesters):
        requesters = w.target.field

        def fan_out(plane: ControlPlane, a: Action, now: float, queue: list) -> None:
            values = read_copied(a)
            for req in getattr(a, requesters):
                queue.append(make(*values, *[get(plane, a, None, req) for get in getters]))

        return fan_out
    kind = w.target
    key_of = _field_getter(dict(w.fields)[cls.key_field])
    needs_target = w.only_if_live or any(isinstance(source, TargetField) for _, source in w.fields)
    if not needs_target and not getters:
        def copy(plane: ControlPlane, a: Action, now: float, queue: list) -> None:
            queue.append(make(*read_copied(a)))

        return copy

    if not getters:  # only if the target is live: e.g. releasing an engine
        def copy_if_live(plane: ControlPlane, a: Action, now: float, queue: list) -> None:
            if key_of(plane, a, None, None) in plane.instances[kind]:
                queue.append(make(*read_copied(a)))

        return copy_if_live

    def deliver(plane: ControlPlane, a: Action, now: float, queue: list) -> None:
        inst = None
        if needs_target:
            inst = plane.instances[kind].get(key_of(plane, a, None, None))
            if inst is None:
                return
        queue.append(make(*read_copied(a), *[get(plane, a, inst, None) for get in getters]))

    return deliver


def _copy_instance(inst):
    """Copy an attrs instance, with fresh containers (refs, waiters) so the
    copy's transitions never touch the original."""
    copy = attrs.evolve(inst)
    for a in attrs.fields(type(inst)):
        value = getattr(copy, a.name)
        if type(value) in (set, list, dict):
            setattr(copy, a.name, type(value)(value))
    return copy


def _fail_closed_event(cls: type[Event], kind: str, key: Any) -> Event:
    field = cls.key_field
    return cls(**{field: key})
