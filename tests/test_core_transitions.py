"""Every row of every machine's table, exercised through Machine.handle.

For each Transition row: drive a fresh instance into the row's source state
with real events, build an event that makes the row's guard the first true
one, fire it, and check the destination, the emitted action types (the row's
declared actions, then ArmTimer/CancelTimer as the destination's deadline
requires) and that a destination deadline lies in the future.  Every Ignore
returns IGNORED and leaves the instance untouched; every ProtocolError raises
ProtocolViolation and leaves it untouched.  A coverage test checks that the
rows exercised are exactly the rows in the compiled tables, so a new row
without a recipe here fails.
"""
from __future__ import annotations

import copy

import pytest

from kvplane.statemachines import events as E
from kvplane.statemachines.actions import ReportRecv
from kvplane.statemachines.base import ArmTimer, CancelTimer, TimerFired
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.machines import MACHINES
from kvplane.statemachines.machine import IGNORED, ProtocolViolation
from kvplane.statemachines.spec import Ignore, ProtocolError, Transition

CFG = PlaneConfig()
KEYS = {"decode_request": "r1", "lease": "p1", "remote_engine": "P0", "push_write": "p1", "heartbeat": "P0"}


class Drive:
    """One instance of one machine, moved by real events through Machine.handle."""

    def __init__(self, kind: str):
        self.machine = MACHINES[kind]
        self.inst = self.machine.new(KEYS[kind])
        self.now = 0.0

    def __call__(self, event, dt: float = 1.0):
        self.now += dt
        acts = self.machine.handle(self.inst, event, CFG, self.now)
        assert acts is not IGNORED, f"path event {type(event).__name__} was ignored in {self.inst.state}"
        return acts

    def timer(self):
        at = self.inst.deadline
        assert at is not None, f"{self.inst.state} has no deadline"
        self.now = at
        return self.machine.handle(self.inst, TimerFired(self.machine.name, self.inst.key, at), CFG, at)


# --------------------------------------------------------------- paths to states
def decode_path(state, *, full=False, push=False, remote_expiry=None, incarnation=None):
    d = Drive("decode_request")
    if state == "NEW":
        return d
    push = push or state == "AWAITING_PUSH"
    d(E.NewRequest(request_id="r1", engine_id="P0", remote_request_id="p1", remote_block_ids=(7, 8),
                   remote_ranks=(0, 1), remote_expiry=remote_expiry, push=push, remote_incarnation=incarnation))
    if state == "HEARTBEATING":
        return d
    if state in ("NOTIFY_ONLY", "NOTIFYING"):
        d(E.BlocksAllocated(request_id="r1", num_remote_tokens=0, awaiting=False))
        if state == "NOTIFYING":
            d(E.StartLoad(request_id="r1"))
        return d
    zero = full or state == "FULL_PREFIX_HIT"
    d(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=0 if zero else 32, awaiting=True))
    if state in ("WAITING_FOR_REMOTE_KVS", "FULL_PREFIX_HIT"):
        return d
    d(E.StartLoad(request_id="r1"))
    if state == "HANDSHAKING":
        return d
    d(E.EngineReady(kind="decode_request", request_id="r1", engine_id="P0"))
    if state in ("READING", "AWAITING_PUSH"):
        return d
    d(E.ReadFailed(request_id="r1") if state == "RECV_FAILED" else E.ReadDone(request_id="r1"))
    if state == "RUNNING":
        d(E.RequestRunning(request_id="r1"))
    return d


def lease_path(state, *, consumers=2, renewable=True, bind=()):
    """``bind``: senders whose heartbeats bind the lease on the way."""
    d = Drive("lease")
    if state == "PREFILLING":
        return d
    d(E.LeaseGranted(request_id="p1", block_ids=(3, 4), expected_consumers=consumers, renewable=renewable), dt=0.0)
    if state == "PARTIALLY_READ":
        d(E.ConsumerDone(request_id="p1", consumer="c1", expected_consumers=consumers))
    for sender in bind:
        d(E.LeaseHeartbeat(request_id="p1", sender=sender), dt=0.0)
    return d


def engine_path(state, *, backoff_over=False, released=False):
    d = Drive("remote_engine")
    if state == "UNKNOWN":
        return d
    d(E.EngineAcquire(engine_id="P0", requester_kind="decode_request", requester_key="r1"))
    if state == "HANDSHAKE_FAILED":
        d(E.HandshakeFailed(engine_id="P0"))
        if backoff_over:
            d.now = d.inst.retry_at  # the event comes half a second after the backoff
    elif state in ("CONNECTED", "STALE"):
        d(E.HandshakeOk(engine_id="P0", samples=((0.25, 0.001),)))
        if state == "STALE":
            d.timer()
    if released:
        d(E.EngineRelease(engine_id="P0", requester_kind="decode_request", requester_key="r1"))
    return d


def push_path(state, *, remote_deadline=None):
    d = Drive("push_write")
    if state in ("REGISTERED", "CONNECTING", "WRITING"):
        d(E.PushRegistered(request_id="p1", engine_id="D0", remote_request_id="r1", remote_block_ids=(9,),
                           remote_deadline=remote_deadline))
    if state in ("AWAITING_REG", "CONNECTING", "WRITING"):
        d(E.PushReady(request_id="p1", block_ids=(3, 4)))
    if state == "WRITING":
        d(E.EngineReady(kind="push_write", request_id="p1", engine_id="D0"))
    return d


def heartbeat_path(state, *, empty=False):
    d = Drive("heartbeat")
    if state == "NEW":
        return d
    d(E.HeartbeatRegister(engine_id="P0", request_id="p1", ranks=(0, 1)))
    if state == "UNREFERENCED":
        d(E.EngineLost(kind="heartbeat", request_id="P0", engine_id="P0", reason="evicted"))
    if empty:
        d(E.HeartbeatUnregister(engine_id="P0", request_id="p1"))
    return d


PATHS = {"decode_request": decode_path, "lease": lease_path, "remote_engine": engine_path, "push_write": push_path,
         "heartbeat": heartbeat_path}


# ----------------------------------------------------------- default events
def default_event(kind, ev_type, inst):
    key = inst.key
    if ev_type is TimerFired:
        return TimerFired(kind, key, inst.deadline if inst.deadline is not None else 0.0)
    if kind == "remote_engine":
        req = dict(requester_kind="decode_request", requester_key="r1")
        return {
            E.EngineAcquire: lambda: E.EngineAcquire(engine_id=key, requester_kind="decode_request", requester_key="r2"),
            E.EngineRelease: lambda: E.EngineRelease(engine_id=key, **req),
            E.HandshakeOk: lambda: E.HandshakeOk(engine_id=key, samples=((0.5, 0.002),)),
            E.HandshakeFailed: lambda: E.HandshakeFailed(engine_id=key, reason="refused"),
            E.EngineActivity: lambda: E.EngineActivity(engine_id=key),
            E.PeerDisconnected: lambda: E.PeerDisconnected(engine_id=key, reason="gone"),
        }[ev_type]()
    return {
        E.NewRequest: lambda: E.NewRequest(request_id=key, engine_id="P0", remote_request_id="p1"),
        E.BlocksAllocated: lambda: E.BlocksAllocated(request_id=key, block_ids=(1, 2), num_remote_tokens=32),
        E.StartLoad: lambda: E.StartLoad(request_id=key),
        E.EngineReady: lambda: E.EngineReady(kind=kind, request_id=key, engine_id="P0"),
        E.EngineLost: lambda: E.EngineLost(kind=kind, request_id=key, engine_id="P0", reason="evicted"),
        E.ReadDone: lambda: E.ReadDone(request_id=key),
        E.ReadFailed: lambda: E.ReadFailed(request_id=key, reason="remote error"),
        E.PushDone: lambda: E.PushDone(request_id=key),
        E.RequestRunning: lambda: E.RequestRunning(request_id=key),
        E.RequestFinished: lambda: E.RequestFinished(request_id=key),
        E.Abort: lambda: E.Abort(request_id=key),
        E.LeaseGranted: lambda: E.LeaseGranted(request_id=key, block_ids=(5,)),
        E.LeaseHeartbeat: lambda: E.LeaseHeartbeat(request_id=key),
        E.ConsumerDone: lambda: E.ConsumerDone(request_id=key, consumer="c9",
                                               expected_consumers=getattr(inst, "expected_consumers", 1)),
        E.LeaseAbort: lambda: E.LeaseAbort(request_id=key),
        E.PushRegistered: lambda: E.PushRegistered(request_id=key, engine_id="D0", remote_request_id="r1"),
        E.PushReady: lambda: E.PushReady(request_id=key, block_ids=(3, 4)),
        E.WriteDone: lambda: E.WriteDone(request_id=key),
        E.WriteFailed: lambda: E.WriteFailed(request_id=key, reason="remote error"),
        E.PushAbort: lambda: E.PushAbort(request_id=key),
        E.SourceEnded: lambda: E.SourceEnded(kind=kind, request_id=key, source_state="EXPIRED"),
        E.HeartbeatRegister: lambda: E.HeartbeatRegister(engine_id=key, request_id="p2", ranks=(1,)),
        E.HeartbeatUnregister: lambda: E.HeartbeatUnregister(engine_id=key, request_id="p1"),
    }[ev_type]()


def guard_name(row) -> str | None:
    return row.guard.__name__ if row.guard is not None else None


# ------------------------------------------------------ recipes per guarded row
def arrange(kind, row):
    """Return (drive, event, now, checks) that should select ``row``."""
    g, ev, src = guard_name(row), row.event, row.src
    checks = []
    if kind == "decode_request":
        opts = {}
        if src in ("HANDSHAKING", "NOTIFYING") and ev is E.EngineReady:
            # other_incarnation: the params name an incarnation; the wake-up (default_event) names none.
            opts = {"remote_blocks_expired": dict(remote_expiry=5.0), "full_prefix_hit": dict(full=True),
                    "push_mode": dict(push=True), "other_incarnation": dict(incarnation="P0#1"),
                    "older_incarnation": dict(incarnation="P0#1"), None: {}}[g]
        elif src == "HANDSHAKING" and ev in (E.EngineLost, TimerFired):
            opts = {"full_prefix_hit": dict(full=True), None: {}}[g]
        d = decode_path(src, **opts)
        if ev is E.BlocksAllocated:
            event = E.BlocksAllocated(request_id="r1", block_ids=(1,), num_remote_tokens=32 if g == "has_remote_tokens" else 0,
                                      awaiting=g == "awaited")
        elif ev is E.RequestFinished:
            event = E.RequestFinished(request_id="r1", block_ids=(1, 2), hold_for_next_turn=g == "hold_for_next_turn")
        elif ev is E.PushDone and g == "foreign_pusher":
            event = E.PushDone(request_id="r1", sender="a-stranger")  # not the engine it reads
        elif g == "older_incarnation":
            # The handshake named an incarnation older than the params' (P0#0 < P0#1).
            event = E.EngineReady(kind="decode_request", request_id="r1", engine_id="P0", incarnation="P0#0")
            checks.append(lambda inst, acts: inst.superseded and inst.engine_id == "P0")
        else:
            assert g is None or opts, f"no recipe for guard {g}"
            event = default_event(kind, ev, d.inst)
    elif kind == "lease":
        if g == "foreign_sender":
            # Every consumer slot is bound (c1, and c3 by a heartbeat where
            # two are planned); c2 is a stranger.
            consumers = 1 if src == "LEASED" else 2
            d = lease_path(src, consumers=consumers, bind=("c1",) if src == "LEASED" else ("c3",))
            event = (E.ConsumerDone(request_id="p1", consumer="c2", expected_consumers=consumers)
                     if ev is E.ConsumerDone else E.LeaseHeartbeat(request_id="p1", sender="c2"))
            deadline = d.inst.deadline
            checks.append(lambda inst, acts: "c2" not in inst.bound and inst.deadline == deadline
                          and inst.consumers == (frozenset() if src == "LEASED" else frozenset({"c1"})))
        elif ev is E.ConsumerDone:
            consumers, consumer, expected = {
                ("LEASED", "wrong_consumer_count"): (2, "c2", 3),
                ("PARTIALLY_READ", "wrong_consumer_count"): (2, "c2", 3),
                ("LEASED", "last_consumer"): (1, "c1", 1),
                ("PARTIALLY_READ", "last_consumer"): (2, "c2", 2),
                ("PARTIALLY_READ", "duplicate_consumer"): (2, "c1", 2),
                ("LEASED", None): (2, "c1", 2),
                ("PARTIALLY_READ", None): (3, "c2", 3),
            }[(src, g)]
            d = lease_path(src, consumers=consumers)
            event = E.ConsumerDone(request_id="p1", consumer=consumer, expected_consumers=expected)
            if g == "last_consumer" or (g is None and src == "LEASED"):
                checks.append(lambda inst, acts: consumer in inst.consumers)
            if g == "duplicate_consumer":
                checks.append(lambda inst, acts: inst.consumers == frozenset({"c1"}))
            if g == "wrong_consumer_count":
                # Refused, not obeyed: nothing counted, the lease still held.
                checks.append(lambda inst, acts: consumer not in inst.consumers)
        elif ev is E.LeaseHeartbeat and src in ("LEASED", "PARTIALLY_READ"):
            d = lease_path(src, renewable=g == "renewable")
            d.now = 14.5  # the heartbeat comes at 15: now + extension (35) > grant expiry (30)
            event = E.LeaseHeartbeat(request_id="p1", sender="c1")
            checks.append(lambda inst, acts: "c1" in inst.bound)
            if g == "renewable":
                checks.append(lambda inst, acts: inst.deadline == 15.0 + CFG.lease_extension)
            else:
                checks.append(lambda inst, acts: inst.deadline == CFG.kv_lease_duration)
        else:
            assert g is None, f"no recipe for guard {g}"
            d = lease_path(src)
            event = default_event(kind, ev, d.inst)
    elif kind == "remote_engine":
        opts = {}
        if src == "HANDSHAKE_FAILED" and ev is E.EngineAcquire:
            opts = {"backing_off": {}, None: dict(backoff_over=True)}[g]
        elif src == "STALE" and ev is TimerFired:
            opts = {"referenced": {}, None: dict(released=True)}[g]
        else:
            assert g is None, f"no recipe for guard {g}"
        d = engine_path(src, **opts)
        event = default_event(kind, ev, d.inst)
    elif kind == "heartbeat":
        opts = {}
        if ev is TimerFired:
            opts = {"ids_left": {}, None: dict(empty=True)}[g]
        else:
            assert g is None, f"no recipe for guard {g}"
        d = heartbeat_path(src, **opts)
        event = default_event(kind, ev, d.inst)
    else:
        opts = {}
        if src == "CONNECTING" and ev is E.EngineReady:
            # D gives up at 3 (its clock, 0.5 s behind ours): too close for the margin.
            opts = {"decoder_gives_up_first": dict(remote_deadline=3.0), None: {}}[g]
        else:
            assert g is None, f"no recipe for guard {g}"
        d = push_path(src, **opts)
        event = default_event(kind, ev, d.inst)
        if opts:
            event = E.EngineReady(kind=kind, request_id="p1", engine_id="D0", clock_offset=-0.5)
    # Before any deadline armed on the path (the earliest is one backoff, 1 s, away).
    now = event.at if isinstance(event, TimerFired) else d.now + 0.5
    return d, event, now, checks


# ------------------------------------------------------------------- checks
def selected_row(machine, inst, event, now):
    """Index of the first row of the (state, event) pair whose guard holds,
    evaluated on a copy before the event is applied."""
    probe = copy.deepcopy(inst)
    for i, r in enumerate(machine.spec.table):
        if isinstance(r, Transition) and r.src == probe.state and r.event is type(event):
            if r.guard is None or r.guard(probe, event, CFG, now):
                return i
    return None


def built_as(declared, built) -> bool:
    # A row names exactly the action class its builder builds.
    return type(built) is declared.action


def exercise(kind, idx):
    machine = MACHINES[kind]
    row = machine.spec.table[idx]
    d, event, now, checks = arrange(kind, row)
    inst = d.inst
    assert inst.state == row.src
    chosen = selected_row(machine, inst, event, now)
    assert chosen == idx, f"recipe selects row {chosen}, not {idx}"
    old_deadline = inst.deadline
    acts = machine.handle(inst, event, CFG, now)

    assert inst.state == row.dest
    n = len(row.actions)
    body, timers = acts[:n], acts[n:]
    assert len(body) == n and all(not isinstance(a, (ArmTimer, CancelTimer)) for a in body), acts
    for declared, built in zip(row.actions, body):
        assert built_as(declared, built), f"{declared.name} built {type(built).__name__}"
        if declared.name == "cancel_xfer":
            assert built.cancel is True
        if declared.name == "release_xfer":
            assert built.cancel is False
        if isinstance(built, ReportRecv) and declared.name != "report_done":
            assert built.ok is False and built.failed_block_ids == tuple(inst.block_ids)
            assert declared.name == f"report_{built.reason.name.lower()}", "a failed report names its reason"
        if declared.name == "report_done":
            assert built.ok is True and built.reason is None
    dest = machine.states[row.dest]
    if dest.deadline is not None:
        assert inst.deadline is not None
        if inst.deadline != old_deadline:
            assert inst.deadline > now, "a deadline armed in the past"
            expected = [ArmTimer(machine.name, inst.key, inst.deadline)]
        else:
            expected = []
    else:
        assert inst.deadline is None
        expected = [CancelTimer(machine.name, inst.key)] if old_deadline is not None else []
    assert timers == expected
    for check in checks:
        assert check(inst, acts)
    return chosen


def rows_of(cls):
    return [(kind, i) for kind, m in MACHINES.items() for i, r in enumerate(m.spec.table) if isinstance(r, cls)]


def row_id(param):
    kind, i = param
    r = MACHINES[kind].spec.table[i]
    guard = f"[{guard_name(r)}]" if isinstance(r, Transition) and r.guard else ""
    dest = f"->{r.dest}" if isinstance(r, Transition) else ""
    return f"{kind}:{i}:{r.src}x{r.event.__name__}{dest}{guard}"


@pytest.mark.parametrize("param", rows_of(Transition), ids=row_id)
def test_transition(param):
    exercise(*param)


@pytest.mark.parametrize("param", rows_of(Ignore), ids=row_id)
def test_ignore(param):
    kind, i = param
    row = MACHINES[kind].spec.table[i]
    d = PATHS[kind](row.src)
    before = copy.deepcopy(d.inst)
    event = default_event(kind, row.event, d.inst)
    out = d.machine.handle(d.inst, event, CFG, d.now + 1.0)
    assert out is IGNORED
    assert d.inst == before


@pytest.mark.parametrize("param", rows_of(ProtocolError), ids=row_id)
def test_protocol_error(param):
    kind, i = param
    row = MACHINES[kind].spec.table[i]
    d = PATHS[kind](row.src)
    before = copy.deepcopy(d.inst)
    event = default_event(kind, row.event, d.inst)
    with pytest.raises(ProtocolViolation) as info:
        d.machine.handle(d.inst, event, CFG, d.now + 1.0)
    assert info.value.reason == row.reason and info.value.state == row.src
    assert d.inst == before


def test_every_row_is_exercised():
    """The rows these tests reach are exactly the rows of the compiled tables."""
    table_rows = {(kind, i) for kind, m in MACHINES.items() for i in range(len(m.spec.table))}
    reached = set()
    for kind, i in rows_of(Transition):
        reached.add((kind, exercise(kind, i)))
    for kind, i in rows_of(Ignore) + rows_of(ProtocolError):
        row = MACHINES[kind].spec.table[i]
        d = PATHS[kind](row.src)
        entry = d.machine.explain(d.inst.state, row.event)
        assert entry is row
        reached.add((kind, i))
    assert reached == table_rows
    # And every (live state, event) pair is some row: nothing falls outside the table.
    for kind, m in MACHINES.items():
        pairs = {(r.src, r.event) for r in m.spec.table}
        live = [s.name for s in m.spec.states if not s.terminal]
        assert pairs == {(s, e) for s in live for e in m.spec.events}, kind


def test_unknown_event_type_is_a_protocol_violation():
    d = decode_path("HEARTBEATING")
    with pytest.raises(ProtocolViolation, match="alphabet"):
        d.machine.handle(d.inst, E.LeaseHeartbeat(request_id="r1"), CFG, 1.0)
    assert d.inst.state == "HEARTBEATING"
