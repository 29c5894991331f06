"""The shared workloads, in the shape each implementation consumes.

Decode lifecycle (D, pull, engine already connected): NewRequest,
BlocksAllocated, StartLoad, ReadDone, RequestRunning, RequestFinished —
six external events; the plane adds the engine reference, EngineReady,
heartbeat start/stop and timers internally.  Prefill lease (P): LeaseGranted,
four LeaseHeartbeats, ConsumerDone — six events.

Inputs are built before timing for every implementation: the same event
objects for the planes, the machines and the hand-written dicts (each takes
them through one ``handle`` call, as the plane does), so the timed loop
measures dispatch and bookkeeping only, and building the events is counted
on neither side (it is measured on its own).
"""
from __future__ import annotations

from kvplane.statemachines import events as E
from kvplane.statemachines.plane import ControlPlane

from .dictbaseline import DictDecodeSide

NUM_ENGINES = 64
HEARTBEATS_PER_LEASE = 4
DECODE_EVENTS = 6
LEASE_EVENTS = 2 + HEARTBEATS_PER_LEASE


def engine_of(i: int) -> str:
    return f"P{i % NUM_ENGINES}"


def decode_stages(ids: range, tag: str) -> list[list]:
    """Per lifecycle stage, one event per request (stage-major: interleaved lifecycles)."""
    rid = [f"{tag}{i}" for i in ids]
    return [
        [E.NewRequest(request_id=r, engine_id=engine_of(i), remote_request_id="p" + r,
                      remote_block_ids=(1, 2, 3, 4), remote_ranks=(0,)) for i, r in zip(ids, rid)],
        [E.BlocksAllocated(request_id=r, block_ids=(5, 6, 7, 8), num_remote_tokens=64) for r in rid],
        [E.StartLoad(request_id=r) for r in rid],
        [E.ReadDone(request_id=r) for r in rid],
        [E.RequestRunning(request_id=r) for r in rid],
        [E.RequestFinished(request_id=r) for r in rid],
    ]


def decode_machine_stages(ids: range, tag: str) -> list[list]:
    """The same lifecycle fed to one machine directly: EngineReady is explicit."""
    st = decode_stages(ids, tag)
    ready = [E.EngineReady(kind="decode_request", request_id=ev.request_id, engine_id=ev.engine_id)
             for ev in st[0]]
    return st[:3] + [ready] + st[3:]


def lease_stages(ids: range, tag: str) -> list[list]:
    rid = [f"{tag}{i}" for i in ids]
    return (
        [[E.LeaseGranted(request_id=r, block_ids=(1, 2, 3, 4), expected_consumers=1) for r in rid]]
        + [[E.LeaseHeartbeat(request_id=r) for r in rid] for _ in range(HEARTBEATS_PER_LEASE)]
        + [[E.ConsumerDone(request_id=r, consumer="D0", expected_consumers=1) for r in rid]]
    )


def connect_plane(plane: ControlPlane, now: float, engines: int = NUM_ENGINES) -> None:
    """Every engine connected, each kept alive by one queued request's heartbeats."""
    for i in range(engines):
        e = engine_of(i)
        plane.handle(E.NewRequest(request_id=f"keep-{e}", engine_id=e, remote_request_id=f"pkeep-{e}"), now)
        plane.handle(E.HandshakeOk(engine_id=e, samples=[(0.0, 1e-4)]), now)


def connect_dict(d: DictDecodeSide, now: float, engines: int = NUM_ENGINES) -> None:
    for i in range(engines):
        e = engine_of(i)
        d.new_request(f"keep-{e}", e, f"pkeep-{e}", (), (0,), 1, now)
        d.handshake_ok(e, now)
    d.out.clear()
