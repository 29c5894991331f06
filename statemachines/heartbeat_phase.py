"""When each remote engine's heartbeat batches go out: a fixed phase per engine.

Batches would otherwise keep the phase of whatever step first sent them:
engines that got their first request in the same step (a start-up burst)
send in lockstep for ever, and one step then builds every engine's batch
(at 1M ids in flight, a quarter of a second).  Instead each engine sends on
its own grid, ``phase + k * interval``, with the phase a fraction of the
interval derived from the engine id (CRC-32: the same in every process and
run, nothing random, nothing from the clock, so the plane stays pure and
replayable), which spreads the engines evenly over the interval.

The lease guarantee is unchanged: the next batch is always due at most one
interval after the current one (or after the first registration), so every
registered id is still heartbeated at least once per interval; the first
batch may only come earlier than before.  This is the default; with
``PlaneConfig.heartbeat_spread`` off (what a log recorded before the key
existed replays with) every batch is due one interval after the last
(``now + interval``).
"""
from __future__ import annotations

import math
import zlib


def phase(engine_id: str, interval: float) -> float:
    """The engine's offset in [0, interval) on the shared grid."""
    return interval * (zlib.crc32(engine_id.encode("utf-8", "surrogatepass")) / 2 ** 32)


def next_slot(engine_id: str, now: float, cfg) -> float:
    """The engine's first grid time after ``now``: in (now, now + interval]."""
    interval = cfg.heartbeat_interval
    if not cfg.heartbeat_spread:
        return now + interval
    offset = phase(engine_id, interval)
    at = offset + (math.floor((now - offset) / interval) + 1) * interval
    # Float rounding near a grid point: never at or before now, never over one interval on.
    if at <= now or at > now + interval:
        at = now + interval
    return at
