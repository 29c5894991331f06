"""The plane per request, recording on, with warm and with disturbed caches.

``python -m bench.plane_cold [--requests N]``: why ``kvplane run``'s plane
CPU per request is several times ``bench dispatch``'s in-process figure.
The same recording plane (an ``EventLogWriter`` attached) and the same
prebuilt events (``bench.workload``'s decode request, D, and lease with four
heartbeats, P), timed per ``handle`` call with ``time.thread_time``:

- batched: the stages of 64 requests one after the other (``bench dispatch``'s way);
- one at a time: each request's events in turn, nothing between them;
- between every two events, what a running engine does between the plane's
  calls: a 1 ms sleep (the process leaves the core; other processes run) or
  a memset of 8 MiB (torch touching its buffers).

Each cell three ways, to show the floor: the plane recording (what ships),
the plane without a recorder (what recording adds cold), and an empty
function timed the same way (the two clock reads and a call: what no plane
can go below).
"""
from __future__ import annotations

import argparse
import io
import time

import torch

from kvplane.statemachines.eventlog import EventLogWriter
from kvplane.statemachines.plane import ControlPlane

from . import workload as W
from .dispatch import CFG

_BUFFER = torch.zeros(8 << 20, dtype=torch.uint8)


def _between(kind: str) -> None:
    if kind == "sleep 1 ms":
        time.sleep(0.001)
    elif kind == "memset 8 MiB":
        _BUFFER.fill_(1)


def _empty(event: object, now: float) -> None:
    return None


WAYS = ("recording", "no recorder", "empty call")


def per_request_us(side: str, batch: int, between: str, requests: int, way: str = "recording") -> float:
    """CPU µs inside ``handle`` (or the empty call) per request."""
    stages_fn = W.decode_stages if side == "D" else W.lease_stages
    plane = ControlPlane(CFG)
    W.connect_plane(plane, 1000.0)
    if way == "recording":
        EventLogWriter.attach(plane, io.StringIO())
    handle = _empty if way == "empty call" else plane.handle
    t = 1000.0
    for evs in stages_fn(range(64), "warm"):
        for ev in evs:
            plane.handle(ev, t)
    clock, spent = time.thread_time, 0.0
    for start in range(0, requests, batch):
        stages = stages_fn(range(start, start + batch), "q")
        for ev in [ev for evs in stages for ev in evs]:
            _between(between)
            t0 = clock()
            handle(ev, t)
            spent += clock() - t0
            t += 1e-4
    return spent / requests * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plane_cold", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=192, help="requests per cell (a multiple of 64)")
    args = p.parse_args(argv)
    if args.requests < 64 or args.requests % 64:
        p.error("--requests must be a positive multiple of 64")
    cases = [(64, "nothing"), (1, "nothing"), (1, "sleep 1 ms"), (1, "memset 8 MiB")]
    print("CPU µs per request inside the timed calls; ratio: recording to its batched cell")
    print("| side | requests in a batch | between two events | recording | no recorder | empty call | ratio |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for side in ("D", "P"):
        base = None
        for batch, between in cases:
            us = {way: per_request_us(side, batch, between, args.requests, way) for way in WAYS}
            base = base or us["recording"]
            print(f"| {side} | {batch} | {between} | {us['recording']:.1f} | {us['no recorder']:.1f} | "
                  f"{us['empty call']:.1f} | {us['recording'] / base:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
