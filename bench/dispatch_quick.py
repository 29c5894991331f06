"""Quick dispatch cost: microseconds per event, Machine.handle vs ControlPlane.handle.

Not a test.  Run from the repository root:

    python -m bench.dispatch_quick          (or: python bench/dispatch_quick.py)

Two workloads, each timed through the bare compiled machine and through the
composed plane (routing, internal actions, timer heap, heartbeat batcher):
- a lease heartbeat on a held lease (the most frequent event on P);
- a full decode-request lifecycle (NewRequest, BlocksAllocated, StartLoad,
  EngineReady / handshake, ReadDone, RequestRunning, RequestFinished).
Each figure is the best of several repeats, to keep scheduler noise out.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvplane.statemachines import events as E  # noqa: E402
from kvplane.statemachines.config import PlaneConfig  # noqa: E402
from kvplane.statemachines.machines import MACHINES  # noqa: E402
from kvplane.statemachines.plane import ControlPlane  # noqa: E402

CFG = PlaneConfig()
REPEATS = 5


def best(fn, n: int) -> float:
    """Best-of-REPEATS microseconds per event; ``fn(n)`` handles ``n`` events."""
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(n)
        times.append(time.perf_counter() - t0)
    return min(times) / n * 1e6


# ---------------------------------------------------------------- heartbeat
def machine_heartbeat(n: int) -> None:
    m = MACHINES["lease"]
    inst = m.new("p1")
    m.handle(inst, E.LeaseGranted(request_id="p1", block_ids=(1, 2, 3)), CFG, 0.0)
    ev = E.LeaseHeartbeat(request_id="p1")
    handle = m.handle
    t = 0.0
    for _ in range(n):
        t += 0.001
        handle(inst, ev, CFG, t)


def plane_heartbeat(n: int) -> None:
    p = ControlPlane(CFG)
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(1, 2, 3)), 0.0)
    ev = E.LeaseHeartbeat(request_id="p1")
    handle = p.handle
    t = 0.0
    for _ in range(n):
        t += 0.001
        handle(ev, t)


# ---------------------------------------------------------------- lifecycle
def lifecycle_events(rid: str) -> list:
    return [
        E.NewRequest(request_id=rid, engine_id="P0", remote_request_id="p" + rid, remote_block_ids=(7, 8)),
        E.BlocksAllocated(request_id=rid, block_ids=(1, 2), num_remote_tokens=32),
        E.StartLoad(request_id=rid),
        E.ReadDone(request_id=rid),
        E.RequestRunning(request_id=rid),
        E.RequestFinished(request_id=rid),
    ]


MACHINE_LIFECYCLE_LEN = 7  # the six above plus EngineReady, fed by hand


def machine_lifecycle(n_events: int) -> None:
    m = MACHINES["decode_request"]
    handle = m.handle
    t = 0.0
    for i in range(n_events // MACHINE_LIFECYCLE_LEN):
        rid = f"r{i}"
        evs = lifecycle_events(rid)
        inst = m.new(rid)
        t += 0.001
        for ev in evs[:3]:
            handle(inst, ev, CFG, t)
        handle(inst, E.EngineReady(kind="decode_request", request_id=rid, engine_id="P0"), CFG, t)
        for ev in evs[3:]:
            handle(inst, ev, CFG, t)


def plane_lifecycle(n_events: int) -> None:
    # The engine is connected once; each request then runs its whole life
    # through the plane (its EngineReady is produced by the plane itself).
    p = ControlPlane(CFG)
    p.handle(lifecycle_events("warm")[0], 0.0)
    p.handle(E.HandshakeOk(engine_id="P0", samples=((0.0, 0.001),)), 0.0)
    handle = p.handle
    t = 0.0
    for i in range(n_events // 6):
        t += 0.001
        for ev in lifecycle_events(f"r{i}"):
            handle(ev, t)


def main() -> None:
    n = 60_000
    rows = [
        ("lease heartbeat", "Machine.handle", best(machine_heartbeat, n)),
        ("lease heartbeat", "ControlPlane.handle", best(plane_heartbeat, n)),
        ("decode lifecycle", "Machine.handle", best(machine_lifecycle, n)),
        ("decode lifecycle", "ControlPlane.handle", best(plane_lifecycle, n)),
    ]
    print(f"dispatch cost, best of {REPEATS}, {n} events each (Python {sys.version.split()[0]})")
    print(f"{'workload':<18} {'path':<22} {'us/event':>9}")
    for work, path, us in rows:
        print(f"{work:<18} {path:<22} {us:9.2f}")
    print("(the lifecycle figures include building each request's event objects)")


if __name__ == "__main__":
    main()
