"""The ControlPlane: every machine of one instance (P or D), composed.

Sans-I/O, like dask's WorkerState: ``handle(event, now)`` and
``fire_due(now)`` return the actions the world must execute; nothing else
leaves.  The plane routes events by machine kind and id, creates a machine
on its creating event, discards it when it reaches a terminal state, and
executes internal actions itself (timers, engine references, heartbeat
registration), feeding the resulting events to the other machines in FIFO
order within the same call.  One timer heap serves every machine.

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
from collections import Counter, deque
from typing import Any, Callable, Iterable

import attrs

from . import actions as A
from . import events as E
from .base import Action, ArmTimer, CancelTimer, Event, TimerFired
from .config import PlaneConfig
from .heartbeats import Heartbeats
from .machines import MACHINES
from .spec import IGNORED, Machine, ProtocolViolation, Source, timer_action, transitions_of
from .validate import validate_sources

# Events that create a machine when no instance with their id exists.
CREATORS: dict[type, str] = {
    E.NewRequest: "decode_request",
    E.LeaseGranted: "lease",
    E.PushRegistered: "push_write",
    E.PushReady: "push_write",
    E.EngineAcquire: "remote_engine",
    E.HeartbeatRegister: "heartbeat",
}

# Observer of every stimulus handled: (event, now, label, state_before,
# state_after, actions).  Used by the event log; None costs nothing.
Recorder = Callable[[Event, float, str, str | None, str | None, list], None]


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
        self.instances: dict[str, dict[Any, Any]] = {kind: {} for kind in self.machines}
        # What the heartbeat batches hold, for the driver and the explorer.
        self.heartbeats = Heartbeats(self.instances.get("heartbeat", {}), self.config)
        self._timers: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.stats: Counter = Counter()
        # Recent anomalies (unknown ids, protocol violations) for the embedder to log.
        self.anomalies: deque = deque(maxlen=256)
        self.recorder: Recorder | None = None
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
        if self._top is not None:
            # The log line of this stimulus: the addressed machine's own
            # actions, then the external effects of the internal events they
            # set off, so replay also checks what other machines did.
            event, label, before, after, own, n_own = self._top
            self._top = None
            self.recorder(event, now, label, before, after, own + out[n_own:])
        return out

    def handle_all(self, events: Iterable[Event], now: float) -> list[Action]:
        out: list[Action] = []
        for ev in events:
            out.extend(self.handle(ev, now))
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
        kind = cls.machine or event.kind
        key = getattr(event, cls.key_field)
        insts = self.instances.get(kind)
        if insts is None:
            self._anomaly("unknown_kind", kind, key, event)
            if top and self.recorder is not None:
                self.recorder(event, now, f"{kind}:{key}", None, None, IGNORED)
            return
        machine = self.machines[kind]
        inst = insts.get(key)
        created = inst is None
        if created:
            if CREATORS.get(cls) != kind:
                self._refuse_uncreated(event, kind, key, "unknown_id", "", now, out, top)
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
                    self._refuse_uncreated(event, kind, key, "source_not_held", source.kind, now, out, top)
                    return
                applied = self._source_ended(source, kind, key, cls)
        try:
            acts = machine.apply(inst, applied, self.config, now)
        except ProtocolViolation as exc:
            self._anomaly("protocol_violation", kind, key, event, exc.reason)
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
            self.stats[f"ignored:{kind}:{before}:{cls.__name__}"] += 1
        deadline = inst.deadline
        if deadline is not None and deadline != old_deadline:
            if not math.isfinite(deadline):
                # A deadline that is not a number (a NaN or infinite duration
                # in an event) would never fire, or break the heap: the
                # machine times out now, through its ordinary release path.
                self._anomaly("nonfinite_deadline", kind, key, event, repr(deadline))
                deadline = inst.deadline = now
            self._seq += 1
            heapq.heappush(self._timers, (deadline, self._seq, kind, key))
        if top and self.recorder is not None:
            timer = timer_action(kind, key, old_deadline, deadline)
            own = [*acts] if timer is None else [*acts, timer]
            self._top = (event, f"{kind}:{key}", before, inst.state, own, len(out) + sum(
                1 for a in acts if not a.internal))
        if inst.state in machine.terminal_states:
            del insts[key]
            self.stats[f"final:{kind}:{inst.state}"] += 1
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
            self.recorder(event, now, f"{kind}:{key}", None, None, acts)

    def _fail_closed(self, machine: Machine, inst, now: float) -> list:
        fc = machine.spec.fail_closed_event
        if fc is None or machine.is_terminal(inst) or inst.state == machine.spec.initial:
            return []
        self.stats[f"fail_closed:{machine.name}"] += 1
        return machine.apply(inst, _fail_closed_event(fc, machine.name, inst.key), self.config, now)

    def _source_held(self, source: Source, key: Any) -> bool:
        inst = self.instances[source.kind].get(key)
        return inst is not None and inst.state in source.held

    def _source_ended(self, source: Source, kind: str, key: Any, cause: type) -> Event:
        inst = self.instances[source.kind].get(key)
        self.stats[f"source_ended:{kind}:{cause.__name__}"] += 1
        return source.ended(kind=kind, request_id=key, source_state=None if inst is None else inst.state)

    def _anomaly(self, what: str, kind: str, key: Any, event: Event, detail: str = "") -> None:
        self.stats[f"{what}:{kind}:{type(event).__name__}"] += 1
        self.anomalies.append((what, kind, key, type(event).__name__, detail))

    # -------------------------------------------------------- internal actions
    def _execute_internal(self, a: Action, now: float, queue: list) -> None:
        handler = self._internal.get(type(a))
        if handler is None:  # a new internal action without a handler is a bug
            raise TypeError(f"no handler for internal action {type(a).__name__}")
        handler(self, a, now, queue)

    def _do_arm(self, a: ArmTimer, now: float, queue: list) -> None:
        self._arm(a.at, a.kind, a.key)

    def _do_cancel(self, a: CancelTimer, now: float, queue: list) -> None:
        pass  # lazy deletion: a popped entry whose deadline moved is skipped

    def _do_start_heartbeat(self, a: A.StartHeartbeat, now: float, queue: list) -> None:
        queue.append(E.HeartbeatRegister(engine_id=a.engine_id, request_id=a.remote_request_id, ranks=a.ranks))

    def _do_stop_heartbeat(self, a: A.StopHeartbeat, now: float, queue: list) -> None:
        if a.engine_id in self.instances["heartbeat"]:
            queue.append(E.HeartbeatUnregister(engine_id=a.engine_id, request_id=a.remote_request_id))

    def _do_acquire(self, a: A.AcquireEngine, now: float, queue: list) -> None:
        queue.append(E.EngineAcquire(engine_id=a.engine_id, requester_kind=a.kind, requester_key=a.key))

    def _do_release(self, a: A.ReleaseEngine, now: float, queue: list) -> None:
        if a.engine_id in self.instances["remote_engine"]:
            queue.append(E.EngineRelease(engine_id=a.engine_id, requester_kind=a.kind, requester_key=a.key))

    def _do_activity(self, a: A.NoteActivity, now: float, queue: list) -> None:
        if a.engine_id in self.instances["remote_engine"]:
            queue.append(E.EngineActivity(engine_id=a.engine_id))

    def _do_wake(self, a: A.WakeRequesters, now: float, queue: list) -> None:
        since, last = self.heartbeats.chain(a.engine_id)
        for kind, key in a.requesters:
            queue.append(E.EngineReady(kind=kind, request_id=key, engine_id=a.engine_id, clock_offset=a.clock_offset,
                                       heartbeat_at=last, heartbeats_since=since))

    def _do_fail(self, a: A.FailRequesters, now: float, queue: list) -> None:
        for kind, key in a.requesters:
            queue.append(E.EngineLost(kind=kind, request_id=key, engine_id=a.engine_id, reason=a.reason))

    def _do_grant_hold(self, a: A.GrantHold, now: float, queue: list) -> None:
        queue.append(E.LeaseGranted(request_id=a.request_id, block_ids=a.block_ids, expected_consumers=1,
                                    duration=self.config.decoder_kv_blocks_ttl, renewable=False))

    def _do_consume(self, a: A.ConsumeLease, now: float, queue: list) -> None:
        lease = self.instances["lease"].get(a.request_id)
        if lease is not None:
            queue.append(E.ConsumerDone(request_id=a.request_id, consumer=a.consumer,
                                        expected_consumers=lease.expected_consumers))

    _internal: dict = {
        ArmTimer: _do_arm, CancelTimer: _do_cancel,
        A.StartHeartbeat: _do_start_heartbeat, A.StopHeartbeat: _do_stop_heartbeat,
        A.AcquireEngine: _do_acquire, A.ReleaseEngine: _do_release, A.NoteActivity: _do_activity,
        A.WakeRequesters: _do_wake, A.FailRequesters: _do_fail,
        A.GrantHold: _do_grant_hold, A.ConsumeLease: _do_consume,
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
    sources, users = {}, {}
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


def _copy_instance(inst):
    """Copy an attrs instance, with fresh containers (refs, waiters) so the
    copy's transitions never touch the original."""
    copy = attrs.evolve(inst)
    for a in attrs.fields(type(inst)):
        value = getattr(copy, a.name)
        if type(value) in (set, list, dict):
            setattr(copy, a.name, type(value)(value))
    return copy


def _fail_closed_event(cls: type, kind: str, key: Any) -> Event:
    field = cls.key_field
    return cls(**{field: key})
