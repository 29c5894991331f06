"""The plane over the compiled machines (``machine.run``, the interpreter
every deployment runs) and the same plane over the ``transitions``-based
reference interpreter (``reference.ReferenceMachine``) agree.

The same stimuli (random ones with garbage ids and non-finite numbers, and
interleaved whole lifecycles, with timers fired as time advances) go to
both; after every step the two must have returned the same actions,
recorded the same step (or the same event-log lines), and hold the same
instances, timer heap, stats and anomalies.  The two interpret the same
tables independently: a dispatch, guard-order, deadline or recording
difference between them shows here, at the plane, where the machine-level
comparison (test_reference_interpreter) cannot see the wires and timers."""
from __future__ import annotations

import io
import random

import attrs
import pytest

from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.eventlog import EventLogWriter
from kvplane.statemachines.machines import SPECS
from kvplane.statemachines import plane as plane_module
from kvplane.statemachines.plane import ControlPlane
from kvplane.statemachines.reference import RefInstance, ReferenceMachine

CFG = PlaneConfig(kv_lease_duration=6.0, engine_ttl=4.0, handshake_timeout=2.0, transfer_timeout=3.0,
                  recv_timeout=8.0, push_registration_timeout=3.0, decoder_kv_blocks_ttl=10.0)
REQS = ["r1", "r2", "r3", "ghost"]
ENGINES = ["e1", "e2", "nope"]
PEERS = ["x1", "x2", "x3"]
ODD = [float("nan"), float("inf"), float("-inf")]


def stimulus(rng: random.Random):
    """An event, or a time step (a float: fire what is due after it)."""
    pick = rng.choice
    r, e, p = pick(REQS), pick(ENGINES), pick(PEERS)

    def number(lo: float, hi: float) -> float | None:
        return pick([None, rng.uniform(lo, hi), rng.uniform(lo, hi), pick(ODD)])

    return pick([
        lambda: E.NewRequest(request_id=r, engine_id=e, remote_request_id=p, remote_block_ids=(1,),
                             push=rng.random() < 0.3, remote_expiry=number(0, 30)),
        lambda: E.BlocksAllocated(request_id=r, block_ids=(2,), num_remote_tokens=pick([0, 4, 4]),
                                  awaiting=rng.random() < 0.8),
        lambda: getattr(E, pick(["StartLoad", "ReadDone", "ReadFailed", "PushDone", "RequestRunning",
                                 "Abort"]))(request_id=r),
        lambda: E.RequestFinished(request_id=r, block_ids=(2,), hold_for_next_turn=rng.random() < 0.5),
        lambda: E.HandshakeOk(engine_id=e, samples=((pick([0.0, 1.5, pick(ODD)]), 0.01),),
                              notify_only=rng.random() < 0.2),
        lambda: getattr(E, pick(["HandshakeFailed", "EngineActivity", "PeerDisconnected"]))(engine_id=e),
        lambda: E.LeaseGranted(request_id=p, block_ids=(3,), expected_consumers=pick([1, 2]),
                               duration=number(0, 20), renewable=rng.random() < 0.8),
        lambda: getattr(E, pick(["LeaseHeartbeat", "LeaseAbort"]))(request_id=p),
        lambda: E.LeaseHeartbeat(request_id=p, sender=pick(["c1", "c2", None])),
        lambda: E.ConsumerDone(request_id=p, consumer=pick(["c1", "c2"]), expected_consumers=pick([1, 2])),
        lambda: E.PushRegistered(request_id=p, engine_id=e, remote_request_id="d-" + p, remote_block_ids=(1,),
                                 remote_deadline=number(0, 40)),
        lambda: E.PushReady(request_id=p, block_ids=(3,)),
        lambda: getattr(E, pick(["WriteDone", "WriteFailed", "PushAbort"]))(request_id=p),
        lambda: pick([0.0, 0.5, 1.0, 2.5, 7.0, 30.0]),
    ])()


def step_both(a: ControlPlane, b: ControlPlane, s, now: float) -> tuple[tuple, float]:
    """Feed stimulus ``s`` (an event, or a time step: fire what is due
    after it) to both planes: (what each returned, the time now)."""
    if isinstance(s, float):
        now += s
        return (a.fire_due(now), b.fire_due(now)), now
    return (a.handle(s, now), b.handle(s, now)), now


def reference_plane(config: PlaneConfig) -> ControlPlane:
    """A plane whose every machine is the reference interpreter of its spec."""
    return ControlPlane(config, {kind: ReferenceMachine(spec) for kind, spec in SPECS.items()})


def state_of(plane: ControlPlane) -> str:
    """Everything the plane holds, as text (NaN compares unequal to itself;
    its repr does not)."""
    instances = {kind: {key: attrs.asdict(i.inst if isinstance(i, RefInstance) else i, recurse=False)
                        for key, i in insts.items()}
                 for kind, insts in plane.instances.items()}
    return repr((instances, list(plane._timers), plane._draining, plane._seq, dict(plane.stats), list(plane.anomalies)))


def step_and_compare(a: ControlPlane, b: ControlPlane, logs: tuple[list, list], s, now: float, n: int) -> float:
    """Feed ``s`` to both planes (``step_both``) and check they agree: the same
    output, the same steps in ``logs`` (the planes' recorders' lists, emptied
    after), the same state; returns the time now."""
    got, now = step_both(a, b, s, now)
    assert repr(got[0]) == repr(got[1]), (n, s)
    assert repr(logs[0]) == repr(logs[1]), (n, s)
    logs[0].clear()
    logs[1].clear()
    assert state_of(a) == state_of(b), (n, s)
    return now


@pytest.mark.parametrize("recording", [True, False], ids=["recording", "not-recording"])
@pytest.mark.parametrize("config", [CFG, PlaneConfig(), PlaneConfig(heartbeat_spread=True)],
                         ids=["short", "default", "spread"])
@pytest.mark.parametrize("seed", range(2))
def test_random_stimuli_agree(seed, config, recording, monkeypatch):
    """Random stimuli, recorded or not: the same actions, and the same
    instances, heap (entry order and sequence numbers), stats and anomalies
    after every step."""
    monkeypatch.setattr(plane_module, "_MIN_COMPACT", 8)  # compactions happen, on both sides
    rng = random.Random(seed)
    compiled, reference = ControlPlane(config), reference_plane(config)
    logs: tuple[list, list] = ([], [])
    if recording:
        compiled.recorder, reference.recorder = logs[0].append, logs[1].append
    now = 0.0
    for n in range(400):
        s = stimulus(rng)
        now = step_and_compare(compiled, reference, logs, s, now, n)


def test_engine_reused_by_many_requests_agrees():
    """The benchmark's shape: one connected engine, many whole lifecycles."""
    compiled, reference = ControlPlane(), reference_plane(PlaneConfig())
    now = 0.0
    for plane in (compiled, reference):
        plane.handle(E.NewRequest(request_id="keep", engine_id="P0", remote_request_id="pkeep"), now)
        plane.handle(E.HandshakeOk(engine_id="P0", samples=[(0.0, 1e-4)]), now)
    for i in range(300):
        now += 0.37
        rid = f"r{i}"
        for ev in (E.NewRequest(request_id=rid, engine_id="P0", remote_request_id="p" + rid, remote_block_ids=(1, 2)),
                   E.BlocksAllocated(request_id=rid, block_ids=(5, 6), num_remote_tokens=64),
                   E.StartLoad(request_id=rid), E.StartLoad(request_id=rid), E.ReadDone(request_id=rid),
                   E.RequestRunning(request_id=rid), E.RequestFinished(request_id=rid),
                   E.LeaseGranted(request_id="l" + rid, block_ids=(1,)), E.LeaseHeartbeat(request_id="l" + rid),
                   E.ConsumerDone(request_id="l" + rid, consumer="D0", expected_consumers=1)):
            assert compiled.handle(ev, now) == reference.handle(ev, now), (i, ev)
        assert compiled.fire_due(now) == reference.fire_due(now)
        assert state_of(compiled) == state_of(reference)


def lifecycle_stimuli(rng: random.Random, n: int):
    """Requests walking their lifecycles against a few engines, interleaved,
    with faults and time steps among them: where the wires' cascades run
    (a connected engine, a heartbeat batch in use), a uniform mix seldom goes."""
    steps: dict[str, int] = {}
    serial = 0
    for _ in range(n):
        if rng.random() < 0.15:
            yield stimulus(rng)
            continue
        if len(steps) < 6 and rng.random() < 0.3:
            serial += 1
            steps[f"q{serial}"] = 0
        if not steps:
            continue
        rid = rng.choice(sorted(steps))
        step, engine = steps[rid], rng.choice(ENGINES[:2])
        steps[rid] += 1
        if step == 0:
            yield E.NewRequest(request_id=rid, engine_id=engine, remote_request_id="p" + rid, remote_block_ids=(1,))
            yield E.HandshakeOk(engine_id=engine, samples=((0.0, 0.01),))
        elif step == 1:
            yield E.BlocksAllocated(request_id=rid, block_ids=(2,), num_remote_tokens=rng.choice([0, 4, 4, 4]))
        elif step == 2:
            yield E.StartLoad(request_id=rid)
        elif step == 3:
            yield rng.choice([E.ReadDone, E.ReadDone, E.ReadFailed])(request_id=rid)
        elif step == 4:
            yield E.RequestRunning(request_id=rid)
        else:
            yield E.RequestFinished(request_id=rid, block_ids=(2,), hold_for_next_turn=rng.random() < 0.3)
            del steps[rid]
        if rng.random() < 0.1:
            yield rng.choice([0.5, 1.0, 2.5, 4.5])


@pytest.mark.parametrize("recording", ["not-recording", "steps", "event-log"])
@pytest.mark.parametrize("seed", range(3))
def test_interleaved_lifecycles_agree(seed, recording, monkeypatch):
    """Whole lifecycles, interleaved, with their wires' cascades: after every
    step the same actions and the same instances, heap (entry order,
    sequence numbers), stats and anomalies.  Recorded, the same steps (a
    Step recorder) or the same log lines (the event log's writer, which the
    plane hands each stimulus unbuilt, ``capture``)."""
    monkeypatch.setattr(plane_module, "_MIN_COMPACT", 8)
    rng = random.Random(2000 + seed)
    compiled, reference = ControlPlane(CFG), reference_plane(CFG)
    steps: tuple[list, list] = ([], [])
    writers = (EventLogWriter(io.StringIO()), EventLogWriter(io.StringIO()))
    for plane, log, writer in zip((compiled, reference), steps, writers):
        if recording != "not-recording":
            plane.recorder = log.append if recording == "steps" else writer
    now = 0.0
    for n, s in enumerate(lifecycle_stimuli(rng, 800)):
        now = step_and_compare(compiled, reference, steps, s, now, n)
    for writer in writers:
        writer.flush()
    lines = [w.stream.getvalue().splitlines() for w in writers]
    assert lines[0] == lines[1]
    assert (len(lines[0]) > 800) is (recording == "event-log")
