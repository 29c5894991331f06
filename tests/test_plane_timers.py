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
    out, peak, drained = [], 0, 0
    for t, ev in steps:
        out.append(("fire", t, p.fire_due(t)))
        drained += p._draining is not None
        out.append(("event", t, p.handle(ev, t)))
        drained += p._draining is not None
        peak = max(peak, len(p.timer_entries()))
    out.append(("end", 500.0, p.fire_due(500.0)))
    return out, peak, drained


@pytest.mark.parametrize("seed", range(3))
def test_compaction_changes_nothing_that_fires(seed, monkeypatch):
    steps = workload(seed, 300)
    compacted, peak, drained = run(steps, 8, monkeypatch)
    lazy, lazy_peak, never = run(steps, 10 ** 9, monkeypatch)
    assert compacted == lazy
    # Compactions ran, each draining its heap over many steps, and
    # superseded entries no longer pile up until their deadlines.
    assert drained > 10 and never == 0
    assert peak < lazy_peak


def test_the_heap_stays_within_twice_its_live_entries(monkeypatch):
    monkeypatch.setattr(plane_module, "_MIN_COMPACT", 8)
    p = ControlPlane(PlaneConfig())
    p.handle(E.LeaseGranted(request_id="l", block_ids=(1,)), 0.0)
    for k in range(1, 2000):
        p.handle(E.LeaseHeartbeat(request_id="l"), k * 0.01)  # each moves the expiry later
        assert len(p.timer_entries()) <= 9
    assert p.next_deadline() == pytest.approx(1999 * 0.01 + p.config.lease_extension)


def test_a_deadline_moved_later_keeps_its_one_entry_and_fires_at_the_deadline():
    """Heartbeats extend a lease without a heap entry each: its entry comes
    due at the first expiry, re-arms at the extended one, and the lease
    expires then, once, not before."""
    p = ControlPlane(PlaneConfig())
    ext = p.config.lease_extension
    p.handle(E.LeaseGranted(request_id="l", block_ids=(1,)), 0.0)
    first = p.get("lease", "l").deadline
    for k in range(1, 40):
        p.handle(E.LeaseHeartbeat(request_id="l"), float(k))
        assert [e[0] for e in p.timer_entries()] == [first]
    expiry = 39.0 + ext
    assert p.get("lease", "l").deadline == expiry > first
    assert p.fire_due(first) == [] and p.get("lease", "l").state == "LEASED"  # re-armed, not fired
    assert [e[0] for e in p.timer_entries()] == [expiry]
    p.handle(E.LeaseHeartbeat(request_id="l"), 40.0)
    assert p.next_deadline() == 40.0 + ext  # the true deadline, the early entry re-armed on the way
    assert p.fire_due(40.0 + ext - 0.001) == []
    fired = p.fire_due(40.0 + ext)
    assert [a.__class__.__name__ for a in fired] == ["FreeBlocks"] and fired[0].reason == "expired"
    assert p.get("lease", "l") is None and p.fire_due(1e6) == [] and p.next_deadline() is None


def test_a_deadline_moved_earlier_than_its_entry_is_armed_again():
    """A READ's deadline (transfer) comes before the recv deadline its entry
    was armed at: a new entry, which fires; the old one is dropped."""
    p = ControlPlane(PlaneConfig(recv_timeout=100.0, transfer_timeout=5.0))
    p.handle(new_request("r", "P0", "pr"), 0.0)
    connect(p, "P0", 0.0)
    p.handle(E.BlocksAllocated(request_id="r", block_ids=(1,), num_remote_tokens=8), 0.0)

    def entries() -> list[float]:
        return sorted(at for at, _, kind, _ in p.timer_entries() if kind == "decode_request")

    r = p.get("decode_request", "r")
    assert entries() == [100.0] and r.timer_at == 100.0
    p.handle(E.StartLoad(request_id="r"), 1.0)
    assert r.state == "READING" and r.deadline == r.timer_at == 6.0 and entries() == [6.0, 100.0]
    fired = []
    while r.state == "READING":  # the engine's and the heartbeats' timers fire on the way
        fired += p.fire_due(p.next_deadline())
    assert r.state == "RECV_FAILED" and "ReportRecv" in [a.__class__.__name__ for a in fired]
    # The recv deadline's entry is superseded: it fires nothing when it comes up, and goes.
    assert r.timer_at is None and entries() == [100.0]
    assert not [a for a in p.fire_due(100.0) if getattr(a, "request_id", None) == "r"]
    assert entries() == []
