"""The plane per request, recording on, with warm and with disturbed caches.

``python -m bench.plane_cold [--requests N]``: why ``kvplane run``'s plane
CPU per request is several times ``bench dispatch``'s in-process figure,
and what a hand-written connector would cost in the same conditions.
The same prebuilt events (``bench.workload``'s decode request, D, and lease
with four heartbeats, P), timed per ``handle`` call with ``time.thread_time``:

- batched: the stages of 64 requests one after the other (``bench dispatch``'s way);
- one at a time: each request's events in turn, nothing between them;
- between every two events, what a running engine does between the plane's
  calls: a 1 ms sleep (the process leaves the core; other processes run) or
  a memset of 8 MiB (torch touching its buffers).

Each cell four ways, interleaved batch by batch so that the machine's load
falls on all of them alike: the plane recording (what ships); the plane
without a recorder (what recording adds); the hand-written dict with the
plane's bookkeeping (``bench/dictbaseline.py``, timer heap on; it records
nothing), the anchor: what a connector written without machines costs in
the same conditions; and an empty function timed the same way (two clock
reads and a call: what no implementation can go below).
"""
from __future__ import annotations

import argparse
import io
import time
from typing import Callable

import torch

from kvplane.statemachines.eventlog import EventLogWriter
from kvplane.statemachines.plane import ControlPlane

from . import workload as W
from .dictbaseline import DictDecodeSide, DictPrefillSide
from .dispatch import CFG

_BUFFER = torch.zeros(8 << 20, dtype=torch.uint8)

WAYS = ("recording", "no recorder", "hand-written dict", "empty call")
CASES = ((64, "nothing"), (1, "nothing"), (1, "sleep 1 ms"), (1, "memset 8 MiB"))


def _between(kind: str) -> None:
    if kind == "sleep 1 ms":
        time.sleep(0.001)
    elif kind == "memset 8 MiB":
        _BUFFER.fill_(1)


def _empty(event: object, now: float) -> None:
    return None


def _handler(side: str, way: str) -> Callable[[object, float], object]:
    """A fresh implementation for ``way``, connected to every engine, its caches warmed on 64 requests."""
    stages_fn = W.decode_stages if side == "D" else W.lease_stages
    if way == "hand-written dict":
        d = DictDecodeSide(CFG, heap=True) if side == "D" else DictPrefillSide(CFG, heap=True)
        if isinstance(d, DictDecodeSide):
            W.connect_dict(d, 1000.0)
        handle = d.handle
    else:
        plane = ControlPlane(CFG)
        W.connect_plane(plane, 1000.0)
        if way == "recording":
            EventLogWriter.attach(plane, io.StringIO())
        handle = _empty if way == "empty call" else plane.handle
    for evs in stages_fn(range(64), "warm"):
        for ev in evs:
            handle(ev, 1000.0)
    return handle


def per_request_us(side: str, batch: int, between: str, requests: int) -> dict[str, float]:
    """CPU µs inside the timed calls per request, for each way."""
    stages_fn = W.decode_stages if side == "D" else W.lease_stages
    handlers = {way: _handler(side, way) for way in WAYS}
    clock = time.thread_time
    spent = dict.fromkeys(WAYS, 0.0)
    t = 1000.0
    for start in range(0, requests, batch):
        for way, handle in handlers.items():  # the ways take turns, batch by batch
            stages = stages_fn(range(start, start + batch), "q")
            for ev in [ev for evs in stages for ev in evs]:
                _between(between)
                t0 = clock()
                handle(ev, t)
                spent[way] += clock() - t0
        t += 1e-3
    return {way: s / requests * 1e6 for way, s in spent.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plane_cold", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=192, help="requests per cell (a multiple of 64)")
    args = p.parse_args(argv)
    if args.requests < 64 or args.requests % 64:
        p.error("--requests must be a positive multiple of 64")
    print("CPU µs per request inside the timed calls; the ratios: recording to its batched cell, and to the dict")
    print("| side | requests in a batch | between two events | recording | no recorder | hand-written dict | "
          "empty call | to batched | to the dict |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for side in ("D", "P"):
        base = None
        for batch, between in CASES:
            us = per_request_us(side, batch, between, args.requests)
            base = base or us["recording"]
            print(f"| {side} | {batch} | {between} | {us['recording']:.1f} | {us['no recorder']:.1f} | "
                  f"{us['hand-written dict']:.1f} | {us['empty call']:.1f} | {us['recording'] / base:.2f}x | "
                  f"{us['recording'] / us['hand-written dict']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
