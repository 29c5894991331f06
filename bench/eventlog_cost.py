"""Per-event cost of recording the event log: ``python -m bench.eventlog_cost``.

Drives the same synthetic decode+lease workload through a plane without a
recorder, with a recorder that takes each stimulus and keeps nothing (the
plane's side of recording alone), and with the JSONL writer; prints
µs/event and ratios.  The writer encodes a batch at a time as it records;
its run ends with ``flush()`` inside the time, so every line's encoding is
counted.
"""
from __future__ import annotations

import io
import time

from kvplane.statemachines import events as E
from kvplane.statemachines.eventlog import EventLogWriter
from kvplane.statemachines.plane import ControlPlane


def workload(plane: ControlPlane, n: int) -> int:
    events = 0
    plane.handle(E.NewRequest(request_id="warm", engine_id="e", remote_request_id="w"), 0.0)
    plane.handle(E.HandshakeOk(engine_id="e"), 0.0)
    t = 0.0
    for i in range(n):
        r, p = f"r{i}", f"p{i}"
        t += 0.001
        for ev in (E.NewRequest(request_id=r, engine_id="e", remote_request_id=p),
                   E.BlocksAllocated(request_id=r, block_ids=(1, 2), num_remote_tokens=4),
                   E.StartLoad(request_id=r), E.ReadDone(request_id=r), E.RequestRunning(request_id=r),
                   E.RequestFinished(request_id=r),
                   E.LeaseGranted(request_id=p, block_ids=(3,)), E.LeaseHeartbeat(request_id=p),
                   E.ConsumerDone(request_id=p, consumer="d", expected_consumers=1)):
            plane.handle(ev, t)
            events += 1
    return events


class Discard:
    """Takes each stimulus the way the writer does (``capture``) and keeps nothing."""

    def capture(self, stimulus, out) -> None:
        pass

    def __call__(self, step) -> None:
        pass


def measure(mode: str, n: int) -> float:
    plane = ControlPlane()
    writer = None
    if mode == "capture":
        plane.recorder = Discard()
    elif mode == "jsonl":
        writer = EventLogWriter(io.StringIO())
        plane.recorder = writer
    start = time.perf_counter()
    events = workload(plane, n)
    if writer is not None:
        writer.flush()
    return (time.perf_counter() - start) / events * 1e6


def main(n: int = 5000, rounds: int = 5) -> None:
    res = {m: min(measure(m, n) for _ in range(rounds)) for m in ("off", "capture", "jsonl")}
    base = res["off"]
    for m, us in res.items():
        print(f"{m:8s} {us:7.2f} µs/event  x{us / base:.2f}")


if __name__ == "__main__":
    main()
