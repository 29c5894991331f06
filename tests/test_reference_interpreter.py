"""The compiled dispatch and the transitions-based reference interpreter
agree on every machine: same states, same actions, same ignores and errors,
on random event sequences."""
import copy
import random

import pytest

from kvplane.statemachines import events as E
from kvplane.statemachines.base import TimerFired
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.machines import MACHINES, SPECS
from kvplane.statemachines.reference import ReferenceMachine
from kvplane.statemachines.machine import IGNORED, ProtocolViolation


def sample_event(cls, key, rng):
    """A plausible instance of ``cls`` addressed to ``key``."""
    pick = rng.choice
    kw = {
        E.NewRequest: dict(engine_id="P0", remote_request_id="p-" + key, remote_block_ids=(1, 2),
                           remote_ranks=(0, 1), remote_expiry=pick([None, 3.0, 100.0]), push=pick([False, True])),
        E.BlocksAllocated: dict(block_ids=(5, 6), num_remote_tokens=pick([0, 16]), awaiting=pick([True, False])),
        E.EngineReady: dict(kind="x", engine_id="P0", clock_offset=pick([0.0, 50.0, -50.0])),
        E.EngineLost: dict(kind="x", engine_id="P0"),
        E.SourceEnded: dict(kind="x", source_state=pick([None, "EXPIRED"])),
        E.RequestFinished: dict(hold_for_next_turn=pick([False, True])),
        E.LeaseGranted: dict(block_ids=(1, 2), expected_consumers=pick([1, 2]), renewable=pick([True, False])),
        E.ConsumerDone: dict(consumer=pick(["d0", "d1"]), expected_consumers=pick([1, 2])),
        E.PushRegistered: dict(engine_id="D0", remote_request_id="d-" + key, remote_block_ids=(3,)),
        E.PushReady: dict(block_ids=(1,)),
        E.EngineAcquire: dict(requester_kind="decode_request", requester_key=pick(["a", "b"])),
        E.EngineRelease: dict(requester_kind="decode_request", requester_key=pick(["a", "b"])),
        E.HandshakeOk: dict(samples=((0.5, 0.01), (0.2, 0.001))),
        E.HeartbeatRegister: dict(request_id=pick(["p1", "p2"]), ranks=pick([(0,), (0, 1)])),
        E.HeartbeatUnregister: dict(request_id=pick(["p1", "p2"])),
    }.get(cls, {})
    if cls is TimerFired:
        return None
    field = cls.key_field
    return cls(**{field: key}, **kw)


def outcome(machine, inst, ev, cfg, now):
    try:
        acts = machine.handle(inst, ev, cfg, now)
    except ProtocolViolation as exc:
        return ("violation", type(exc).__name__)
    return ("ignored",) if acts is IGNORED else ("actions", list(acts))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_compiled_and_reference_agree(name):
    spec, fast = SPECS[name], MACHINES[name]
    ref = ReferenceMachine(spec)
    cfg = PlaneConfig()
    rng = random.Random(name)
    checked = 0
    covered = set()
    for trial in range(400):
        a = fast.new("k")
        b = ref.new("k")
        now = 0.0
        for _ in range(12):
            now += rng.choice([0.5, 3.0, 40.0])
            # Mostly events the state has transitions for, so walks go deep.
            moves = [t.event for t in spec.table if t.src == a.state and hasattr(t, "dest")]
            cls = rng.choice(moves if moves and rng.random() < 0.8 else spec.events)
            ev = TimerFired(name, "k", a.deadline) if cls is TimerFired else sample_event(cls, "k", random.Random(rng.random()))
            if cls is TimerFired and a.deadline is None:
                continue
            ev_copy = copy.copy(ev)
            state_before = a.state
            got_a = outcome(fast, a, ev, cfg, now)
            got_b = outcome(ref, b, ev_copy, cfg, now)
            assert got_a == got_b, (trial, ev)
            assert a.state == b.state
            checked += 1
            covered.add((state_before, type(ev)))
            if fast.is_terminal(a) or got_a[0] == "violation":
                break
    pairs = {(t.src, t.event) for t in spec.table if hasattr(t, "dest")}
    assert len(pairs & covered) >= 0.8 * len(pairs), sorted(pairs - covered, key=str)
