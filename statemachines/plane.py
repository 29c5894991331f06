"""The ControlPlane: every machine of one instance (P or D), composed.

Sans-I/O, like dask's WorkerState: ``handle(event, now)`` and
``fire_due(now)`` return the actions the world must execute; nothing else
leaves.  The plane routes events by machine kind and id, creates a machine
on its creating event, discards it when it reaches a terminal state, and
executes internal actions itself (timers, heartbeat registration, and the
cross-machine wires declared in ``composition``, see ``wire_executor``),
feeding the resulting events to the other machines in FIFO order within
the same call.  Which event creates which machine is each spec's
``created_by``.  One timer heap serves every machine.

Late, duplicate and unknown-id events are counted ignores; an event the
table declares a protocol error is counted and fails the machine closed
through its ordinary release path.  Neither ever raises out of ``handle``.

Every event takes one path (``_dispatch``): route it to its instance, look
its row up in the machine's dict and interpret it (``machine.run``: the
table's own guard, effect and builders, called where they are defined),
then ``_finish``: timers, recording, ended instances, sources, actions.

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
from .base import Action, ArmTimer, CancelTimer, Event, TimerFired, runs_code_when_built
from .composition import WIRES
from .config import PlaneConfig
from .heartbeats import Heartbeats
from .machines import MACHINES
from .machines.remote_engine import Requesters
from .observe import Observer, Step, Stimulus, stimulus_step
from .stats import (
    NONFINITE_DEADLINE, PROTOCOL_VIOLATION, SOURCE_NOT_HELD, UNKNOWN_ID, UNKNOWN_KIND, Anomaly, FailClosed, Final,
    Ignored, SourceEnded, StatKeys,
)
from .machine import IGNORED, Machine, ProtocolViolation, run
from .spec import Source, transitions_of
from .validate import validate_sources
from .validate_composition import creators, validate_composition
from .wire_executor import wire_executor



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
        # The heap a compaction is moving live entries out of, a few per push
        # (``_compact_timers``), or None; its head competes with _timers'.
        self._draining: list[tuple[float, int, str, Any]] | None = None
        self._seq = 0
        # The heap is compacted (superseded entries dropped) when it grows past this.
        self._compact_at = _MIN_COMPACT
        # Keyed by the records of ``stats`` (and "heartbeats_sent").
        self.stats: Counter = Counter()
        self._stat_key = _STAT_KEYS
        # Event class -> (kind, or "" when routed by the event's ``kind``; the key getter).
        self._routes: dict[type, tuple[str, Callable]] = {}
        # What _dispatch reads of each kind (no instance: clones share it).
        keys = self._stat_key
        self._kinds: dict[str, _Kind] = {
            kind: _Kind(kind, m, self._sources.get(kind), self._users.get(kind), keys)
            for kind, m in self.machines.items()}
        # Recent anomalies (unknown ids, protocol violations) for the embedder to log.
        self.anomalies: deque = deque(maxlen=256)
        self._set_observers((), None)
        self._top: Stimulus | None = None  # the stimulus being handled, logged once its effects are known
        self._queue: list[Event] = []  # internal events; empty between calls (see handle)

    # ------------------------------------------------------------ observers
    @property
    def observers(self) -> tuple[Observer, ...]:
        """Everything that sees the plane's steps, in the order added: one
        Step per top-level stimulus (the event log, a worker's failure
        reasons, a tally); none costs nothing.  One with a ``capture``
        method is handed each stimulus unbuilt instead (see observe.py)."""
        return self._observers

    def observe(self, observer: Observer) -> Observer:
        """Add ``observer`` (after the ones already there); returns it."""
        self._set_observers(self._observers + (observer,), self._recorder)
        return observer

    def unobserve(self, observer: Observer) -> None:
        """Remove ``observer``; one that is not there is no error."""
        rest = tuple(o for o in self._observers if o is not observer)
        self._set_observers(rest, None if observer is self._recorder else self._recorder)

    @property
    def recorder(self) -> Observer | None:
        """The event log's observer (replay and counterexamples read it): one
        of ``observers``, which setting it replaces (None: removes)."""
        return self._recorder

    @recorder.setter
    def recorder(self, observer: Observer | None) -> None:
        rest = tuple(o for o in self._observers if o is not self._recorder)
        self._set_observers(rest if observer is None else rest + (observer,), observer)

    def _set_observers(self, observers: tuple[Observer, ...], recorder: Observer | None) -> None:
        self._observers = observers
        self._recorder = recorder
        # Split once here, not per stimulus: who takes the stimulus unbuilt,
        # who a Step (built once for all of them).
        self._captures: tuple[Callable[[Stimulus, list | None], None], ...] = tuple(
            o.capture for o in observers if callable(getattr(o, "capture", None)))  # type: ignore[attr-defined]
        self._steppers: tuple[Observer, ...] = tuple(
            o for o in observers if not callable(getattr(o, "capture", None)))

    def _tell(self, step: Step) -> None:
        """A step built by the plane itself (a refused stimulus): to every observer."""
        for observer in self._observers:
            observer(step)

    # ------------------------------------------------------------------ input
    def handle(self, event: Event, now: float) -> list[Action]:
        """Feed one external stimulus; returns the actions for the world.
        Raises NonFiniteTime, and does nothing, when ``now`` is not finite."""
        if not _isfinite(now):
            _check_now(now)
        out: list[Action] = []
        # Internal events, FIFO.  The plane's list is empty between calls and
        # most stimuli queue nothing, so none is made per call: one that
        # fills is this call's, and a fresh one takes its place.
        queue = self._queue
        note = bool(self._observers)  # _finish notes the stimulus for its log line
        dispatch = self._dispatch
        try:
            dispatch(event, now, out, queue, note)
        except BaseException:
            queue.clear()  # a row that raised (a bug) leaves nothing queued for the next call
            raise
        if queue:
            self._queue = []
            for internal in queue:  # the list grows while it is walked: FIFO
                dispatch(internal, now, out, queue, False)
        if note:
            top, self._top = self._top, None
            if top is not None:  # None: a refused stimulus, handed to the recorder as a Step already
                # A cascade's effects follow the stimulus's own in out: out is
                # passed whenever it holds anything.
                if self._captures:  # the caller's list, copied once: a capture may keep it (none changes it)
                    kept = out[:] if out else None
                    for capture in self._captures:
                        capture(top, kept)
                if self._steppers:  # stimulus_step keeps slices of out, not out
                    step = stimulus_step(top, out if out else None)
                    for observer in self._steppers:
                        observer(step)
        return out

    def next_deadline(self) -> float | None:
        """The earliest armed timer, or None."""
        while True:
            heap = self._head()
            if heap is None:
                return None
            if self._due(heap) is not None:
                return heap[0][0]

    def fire_due(self, now: float) -> list[Action]:
        """Fire every timer due at ``now``; returns the actions for the world."""
        _check_now(now)
        out: list[Action] = []
        while True:
            heap = self._head()  # anew each time: a re-arm or a handle() may compact
            if heap is None or heap[0][0] > now:
                break
            inst = self._due(heap)
            if inst is None:
                continue
            at, _, kind, key = heapq.heappop(heap)
            inst.timer_at = None
            acts = self.handle(TimerFired(kind, key, at), now)
            for a in acts:
                if a.__class__ is A.SendHeartbeat:
                    self.stats["heartbeats_sent"] += 1
            out.extend(acts)
        return out

    def clone(self) -> "ControlPlane":
        """A copy of the semantic state (instances, timers, heartbeats), not
        of stats, anomalies or the recorder; much faster than deepcopy (the
        explorer clones a plane per explored move, so this skips __init__:
        the wiring and the caches keyed by machines and event classes are
        read-only once built and shared)."""
        q = ControlPlane.__new__(ControlPlane)
        q.config, q.machines = self.config, self.machines
        q._sources, q._users, q._creators, q._internal = self._sources, self._users, self._creators, self._internal
        q._stat_key, q._routes, q._kinds = self._stat_key, self._routes, self._kinds
        copiers = _COPIERS
        # (an empty kind's dict made without running the inner comprehension: most kinds are empty)
        q.instances = {kind: {key: copiers[i.__class__](i) for key, i in insts.items()} if insts else {}
                       for kind, insts in self.instances.items()}
        q.heartbeats = self.heartbeats.over(q.instances.get("heartbeat", {}))
        q._timers = list(self._timers)
        q._draining = None if self._draining is None else list(self._draining)
        q._seq = self._seq
        q._compact_at = self._compact_at
        q.stats = Counter.__new__(Counter)  # empty; Counter() runs Python __init__ and update (4x the cost)
        q.anomalies = deque(maxlen=256)
        q._observers = q._captures = q._steppers = ()  # (as _set_observers((), None), without its call)
        q._recorder = None
        q._top = None
        q._queue = []
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
    def _dispatch(self, event: Event, now: float, out: list, queue: list, note: bool) -> None:
        """Route one event to its instance and apply the instance's row.
        ``note``: the event is the top-level stimulus and a recorder is
        attached, so its step is noted for the log line."""
        # Route: the event class names its machine kind (internal wake-ups
        # carry it as ``kind``) and which field holds the instance id.
        cls = event.__class__
        route = self._routes.get(cls)
        if route is None:
            route = self._routes[cls] = (cls.machine, operator.attrgetter(cls.key_field))
        kind = route[0] or event.kind  # type: ignore[attr-defined]  # an event routed by kind has one
        key = route[1](event)
        k = self._kinds.get(kind)
        if k is None:
            self._anomaly(UNKNOWN_KIND, kind, key, event)
            if note:
                self._tell(Step(event, now, kind, key, None, None, IGNORED))
            return
        insts = self.instances[kind]
        inst = insts.get(key)
        created = inst is None
        if inst is None:
            if self._creators.get(cls) != kind:
                self._refuse_uncreated(event, kind, key, UNKNOWN_ID, "", now, out, note)
                return
            inst = insts[key] = k.machine.new(key)
        before, old_deadline = inst.state, inst.deadline
        applied = event
        if k.source is not None:
            source, entries = k.source
            if (before in source.needs or (before, cls) in entries) and not self._source_held(source, key):
                # The resource is gone or was never held: a machine that
                # needs it ends now, one about to take it never does.
                if created:
                    del insts[key]
                    self._refuse_uncreated(event, kind, key, SOURCE_NOT_HELD, source.kind, now, out, note)
                    return
                applied = self._source_ended(source, kind, key, cls)
        try:
            rows = k.rows
            row = None if rows is None else rows.get(before, _NO_ROWS).get(applied.__class__)
            if row is None:  # a wrapped machine (observed, reference), or an event outside the alphabet
                acts = k.machine.apply(inst, applied, self.config, now)
            else:  # Machine.apply without its frame
                acts = run(k.machine, row, inst, applied, self.config, now)
        except ProtocolViolation as exc:
            self._anomaly(PROTOCOL_VIOLATION, kind, key, event, exc.reason)
            acts = self._fail_closed(k.machine, inst, now)
            refund = event.refund()
            if refund is not None:
                acts = [*acts, refund]
        else:
            if applied is not event:
                refund = event.refund()
                if refund is not None:
                    acts = [*acts, refund]
        self._finish(k, inst, key, event, acts, before, old_deadline, created, now, out, queue, note)

    def _finish(self, k: "_Kind", inst: Any, key: Any, event: Event, acts: Any, before: str,
                old_deadline: float | None, created: bool, now: float, out: list, queue: list, note: bool) -> None:
        """What the plane does after a machine handled ``event``: count an
        ignore, arm the new deadline, note the step for the recorder, drop
        an ended instance, end its source's users, run the actions."""
        kind, cls = k.name, event.__class__
        if acts is IGNORED:
            self.stats[k.ignored_key(before, cls)] += 1
        deadline = inst.deadline
        if deadline is not None and deadline != old_deadline:
            if not _isfinite(deadline):
                deadline = self._nonfinite_deadline(kind, key, event, inst, now)
            self._push_timer(inst, deadline, kind, key)
        if note:
            # The stimulus, kept for its log line as parts (``observe.Stimulus``): ``handle``
            # hands it to the recorder once its effects are known; the timer action and the
            # line's action list are built only where a recorder needs them.
            self._top = (event, now, kind, key, before, inst.state, acts, old_deadline, deadline)
        state = inst.state
        insts = self.instances[kind]
        if state in k.terminal:
            del insts[key]
            self.stats[k.final_key(state)] += 1
        elif created and state == k.initial:
            del insts[key]  # the creating event was refused: keep no empty machine
        if k.users is not None and state != before:
            for user_kind, src in k.users:
                if before in src.held and state not in src.held and key in self.instances[user_kind]:
                    queue.append(self._source_ended(src, user_kind, key, cls))
        internal = self._internal
        for a in acts:
            run = internal.get(a.__class__)
            if run is None:
                out.append(a)
            else:
                run(self, a, now, queue)

    def _nonfinite_deadline(self, kind: str, key: Any, event: Event, inst: Any, now: float) -> float:
        """A deadline that is not a number (a NaN or infinite duration in an
        event) would never fire, or break the heap: the machine times out
        now, through its ordinary release path."""
        self._anomaly(NONFINITE_DEADLINE, kind, key, event, repr(inst.deadline))
        inst.deadline = now
        return now

    def _refuse_uncreated(self, event: Event, kind: str, key: Any, what: str, detail: str, now: float,
                          out: list, note: bool) -> None:
        """An event that addresses no instance and may not create one: a
        counted anomaly.  What the event carried goes back (e.g. a handshake
        that lands after its engine was evicted removes the agent it added)."""
        self._anomaly(what, kind, key, event, detail)
        refund = event.refund()
        acts = IGNORED if refund is None else [refund]
        out.extend(acts)
        if note:
            # Logged too, so a log holds every stimulus; no instance: no states.
            self._tell(Step(event, now, kind, key, None, None, acts))

    def _fail_closed(self, machine: Machine, inst, now: float) -> list[Action] | tuple[()]:
        fc = machine.spec.fail_closed_event
        if fc is None or inst.state in machine.terminal_states or inst.state == machine.spec.initial:
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
        pass  # lazy deletion: an entry no longer its instance's live one is skipped (_due)

    # Internal actions the plane runs itself; the wired ones are added per plane.
    _own_internal: dict = {
        ArmTimer: _do_arm, CancelTimer: _do_cancel,
    }

    def _arm(self, at: float, kind: str, key: Any) -> None:
        # An armed time that is not the instance's deadline would never fire.
        inst = self.instances[kind].get(key)
        if inst is not None and inst.deadline == at:
            self._push_timer(inst, at, kind, key)

    def _push_timer(self, inst: Any, deadline: float, kind: str, key: Any) -> None:
        """The instance's new deadline: a heap entry unless its live entry
        comes due no later (that one re-arms at the deadline when it does;
        ``_due``)."""
        at = inst.timer_at
        if at is None or deadline < at:
            inst.timer_at = deadline
            self._seq += 1
            timers = self._timers
            _heappush(timers, (deadline, self._seq, kind, key))
            if len(timers) > self._compact_at:
                self._compact_timers()

    def timer_entries(self) -> list[tuple[float, int, str, Any]]:
        """Every entry of the timer heap, superseded ones included: (at, seq,
        kind, key).  For tests and benchmarks; nothing reads it on a path."""
        return self._timers + (self._draining or [])

    def _head(self) -> list | None:
        """The heap whose head is the earliest entry (the one being drained
        counts too), or None when both are empty."""
        timers, draining = self._timers, self._draining
        if draining and (not timers or draining[0] < timers[0]):
            return draining
        return timers or None

    def _due(self, heap: list) -> Any:
        """The instance whose deadline the head of ``heap`` is, or None after
        dropping the head: superseded (its instance ended, or a later entry
        took over), no deadline any more, or one that moved later (then
        re-armed at it)."""
        at, _, kind, key = heap[0]
        inst = self.instances[kind].get(key)
        if inst is None or inst.timer_at != at:
            heapq.heappop(heap)
            return None
        deadline = inst.deadline
        if deadline == at:
            return inst
        heapq.heappop(heap)
        inst.timer_at = None
        if deadline is not None:
            self._push_timer(inst, deadline, kind, key)
        return None

    def _compact_timers(self) -> None:
        """Drop superseded entries (their instance ended, or a deadline moved
        earlier): lazy deletion otherwise keeps each until it would have come
        due, 30-120 s on.  When the heap has doubled since the last
        compaction, it is set aside to drain and a fresh one takes the
        pushes; until it is empty, every push (the rows call this while
        ``_compact_at`` is -1) moves the live ones among a few of its last
        entries over (the rest of a heap's list stays a heap).  No step pays
        for the whole heap at once, and it costs O(1) per push."""
        draining = self._draining
        if draining is None:
            draining = self._draining = self._timers
            self._timers = []
            self._compact_at = -1
        instances, timers = self.instances, self._timers
        for _ in range(_DRAIN_PER_PUSH):
            if not draining:
                break
            entry = draining.pop()
            inst = instances[entry[2]].get(entry[3])  # _due's first test, inlined
            if inst is not None and inst.timer_at == entry[0]:
                _heappush(timers, entry)
        if not draining:
            self._draining = None
            self._compact_at = max(_MIN_COMPACT, 2 * len(timers))


# The smallest heap size at which superseded timer entries are compacted.
_MIN_COMPACT = 4096
# Entries a compaction moves per push: more than one, so a drain ends before
# the pushes it takes have doubled the fresh heap.
_DRAIN_PER_PUSH = 8
_isfinite = math.isfinite
_heappush = heapq.heappush
_NO_ROWS: dict = {}
# The keys of every plane's stats, interned once for all.
_STAT_KEYS = StatKeys()


class _Kind:
    """What the general path reads of one machine kind, gathered once per
    plane and shared by its clones (nothing in it changes with the instances)."""

    __slots__ = ("name", "machine", "rows", "terminal", "initial", "source", "users", "_keys", "_final",
                 "_ignored")

    def __init__(self, name: str, machine: Any, source: Any, users: Any, keys: StatKeys):
        self.name = name
        self.machine = machine
        self.terminal = machine.terminal_states
        self.initial = machine.spec.initial
        # The compiled machine's rows, interpreted without Machine.apply's frame;
        # None for any other machine (an observed or reference one): its apply is called.
        self.rows = machine.rows if type(machine) is Machine else None
        self.source = source  # (Source, the pairs entering its needs), or None
        self.users = users  # ((user kind, Source), ...), or None
        self._keys = keys
        self._final: dict[str, Any] = {}
        self._ignored: dict[tuple[str, type], Any] = {}

    def final_key(self, state: str) -> Any:
        key = self._final.get(state)
        if key is None:
            key = self._final[state] = self._keys(Final, self.name, state)
        return key

    def ignored_key(self, state: str, event: type) -> Any:
        key = self._ignored.get((state, event))
        if key is None:
            key = self._ignored[(state, event)] = self._keys(Ignored, self.name, state, event.__name__)
        return key


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
    internal.update((w.action, wire_executor(w)) for w in WIRES)
    return creators(specs), internal


class _Copiers(dict):
    """Instance class -> its generated copier (``_instance_copier``), made on
    first use: ``_COPIERS[inst.__class__](inst)`` copies an instance, with
    fresh containers (refs, waiters) so the copy's transitions never touch
    the original."""

    def __missing__(self, cls: type) -> Callable[[Any], Any]:
        copier = self[cls] = _instance_copier(cls)
        return copier


_COPIERS = _Copiers()
_CONTAINERS = (set, list, dict, Requesters)
# Field annotations whose values are never changed in place: shared by the copy.
_IMMUTABLE_TYPES = frozenset({"str", "int", "float", "bool", "tuple", "frozenset", "float | None", "str | None",
                              "int | None"})


def _instance_copier(cls: type) -> Callable[[Any], Any]:
    """A function that copies an instance of ``cls`` field by field: what
    ``attrs.evolve`` did, without its per-call introspection (the explorer
    copies a few instances per explored move).  A field of any annotation
    but the immutable ones (Any, set, list, dict, Requesters) gets a fresh
    container (its ``copy()``) when it holds one.  A class built from its
    fields alone (every instance class here) is copied through its own
    ``__init__`` by position, which assigns the slots in one call."""
    fields = attrs.fields(cls)
    names = tuple(a.name for a in fields)
    fresh = tuple(a.name for a in fields if a.type not in _IMMUTABLE_TYPES)
    read_all = operator.attrgetter(*names) if len(names) > 1 else (lambda inst: (getattr(inst, names[0]),))
    containers = _CONTAINERS
    by_init = not runs_code_when_built(cls) and all(
        a.init and a.converter is None and a.validator is None and not a.kw_only and a.alias == a.name
        for a in fields)
    new = object.__new__

    def copy(inst: Any) -> Any:
        if by_init:
            c = cls(*read_all(inst))
        else:
            c = new(cls)
            for name, v in zip(names, read_all(inst)):
                setattr(c, name, v)
        for name in fresh:
            v = getattr(inst, name)
            if v.__class__ in containers:
                setattr(c, name, v.copy())
        return c

    return copy


def _fail_closed_event(cls: type[Event], kind: str, key: Any) -> Event:
    field = cls.key_field
    return cls(**{field: key})
