"""The plane's timer heap: superseded entries are compacted away, and what
fires, when, and in which order is the same as without compaction."""
import random

import pytest

from kvplane.statemachines import events as E
from kvplane.statemachines import plane as plane_module
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.plane import ControlPlane

from core_support import connect, new_request


def workload(seed: int, n: int) -> list[tuple[float, object]]:
    """Decode lifecycles and leases, some left to time out, in a seeded order."""
    rnd = random.Random(seed)
    steps: list[tuple[float, object]] = []
    t = 0.0
    for i in range(n):
        t += rnd.choice((0.0, 0.5, 3.0))
        r, e = f"r{i}", f"P{i % 3}"
        steps.append((t, new_request(r, e, "p" + r)))
        steps.append((t, E.BlocksAllocated(request_id=r, block_ids=(i,), num_remote_tokens=8)))
        if rnd.random() < 0.8:
            steps.append((t, E.StartLoad(request_id=r)))
        if rnd.random() < 0.6:
            steps.append((t + 1.0, E.ReadDone(request_id=r)))
        steps.append((t, E.LeaseGranted(request_id=f"l{i}", block_ids=(i,))))
        for k in range(rnd.randrange(4)):
            steps.append((t + k, E.LeaseHeartbeat(request_id=f"l{i}")))
    return sorted(steps, key=lambda s: s[0])


def run(steps, min_compact: int, monkeypatch) -> tuple[list, int]:
    monkeypatch.setattr(plane_module, "_MIN_COMPACT", min_compact)
    p = ControlPlane(PlaneConfig())
    for e in ("P0", "P1", "P2"):
        p.handle(new_request(f"keep-{e}", e, f"pkeep-{e}"), 0.0)
        connect(p, e, 0.0)
    out, peak = [], 0
    for t, ev in steps:
        out.append(("fire", t, p.fire_due(t)))
        out.append(("event", t, p.handle(ev, t)))
        peak = max(peak, len(p._timers))
    out.append(("end", 500.0, p.fire_due(500.0)))
    return out, peak


@pytest.mark.parametrize("seed", range(3))
def test_compaction_changes_nothing_that_fires(seed, monkeypatch):
    steps = workload(seed, 300)
    compacted, peak = run(steps, 8, monkeypatch)
    lazy, lazy_peak = run(steps, 10 ** 9, monkeypatch)
    assert compacted == lazy
    # Superseded entries no longer pile up until their deadlines.
    assert peak < lazy_peak


def test_the_heap_stays_within_twice_its_live_entries(monkeypatch):
    monkeypatch.setattr(plane_module, "_MIN_COMPACT", 8)
    p = ControlPlane(PlaneConfig())
    p.handle(E.LeaseGranted(request_id="l", block_ids=(1,)), 0.0)
    for k in range(1, 2000):
        p.handle(E.LeaseHeartbeat(request_id="l"), k * 0.01)  # each moves the expiry: a new entry
        assert len(p._timers) <= 9
    assert p.next_deadline() == pytest.approx(1999 * 0.01 + p.config.lease_extension)
