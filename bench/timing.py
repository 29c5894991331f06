"""Timing helpers: interleaved rounds, medians, a wall-clock budget."""
from __future__ import annotations

import gc
import statistics
import time
from typing import Callable


def interleaved(fns: dict[str, Callable[[], tuple[float, int]]], rounds: int) -> dict[str, list[float]]:
    """Run each ``fn() -> (seconds, units)`` once per round, in turn.

    Interleaving spreads CPU-frequency and noisy-neighbour drift over every
    implementation instead of penalising whichever ran last.  A collection
    before each run leaves no run the cyclic garbage of the one before it
    (transitions' machines are full of cycles); each still pays for the
    collections its own allocations cause.  Returns
    microseconds per unit, one value per round.
    """
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            gc.collect()  # the garbage of the run before is not this one's to collect
            secs, units = fn()
            out[name].append(secs / units * 1e6)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


now = time.perf_counter
