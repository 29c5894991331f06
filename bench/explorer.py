"""Item 6: the explorer (model checker) — states per second, and state counts
with and without symmetry reduction.  Uses statemachines/explorer/
(skipped with a message when it is missing).

Two identical requests ("read", "read") make symmetry matter; the depth is
bounded so both runs cover the same space and the counts are comparable.
"""
from __future__ import annotations

import importlib.util
import time

from .report import Table, ratio


def run(quick: bool) -> list[Table]:
    if importlib.util.find_spec("kvplane.statemachines.explorer") is None:
        t = Table("explorer.skipped", "Explorer", ["item", "result"])
        t.add("explorer", "skipped: statemachines/explorer/ does not exist yet")
        return [t]
    from kvplane.statemachines.explorer import explore

    cases = [("1 read, 1 fault, 1 abort (complete)", dict(requests=("read",)))]
    depth = 10 if quick else 14
    cases.append((f"2 reads, no faults/aborts, depth <= {depth}",
                  dict(requests=("read", "read"), max_faults=0, max_aborts=0, max_depth=depth)))
    if not quick:
        cases.append(("2 reads, 1 fault, 1 abort, depth <= 8",
                      dict(requests=("read", "read"), max_depth=8)))
    t = Table("explorer.states", "Explorer: states, states/s, symmetry reduction",
              ["configuration", "symmetry", "states", "transitions", "seconds", "states / s", "complete",
               "violations", "states without / with symmetry"])
    for label, kw in cases:
        got = {}
        for sym in (True, False):
            r = explore(symmetry=sym, clock=time.perf_counter, max_states=30_000 if not quick else 15_000, **kw)
            got[sym] = r
        for sym, r in got.items():
            t.add(label, "on" if sym else "off", r.states, r.transitions, r.elapsed, r.states_per_second,
                  "no (max_states)" if r.truncated else "yes", len(r.violations),
                  ratio(got[False].states, got[True].states) if sym else None,
                  config=label, symmetry=sym, states=r.states, transitions=r.transitions, seconds=r.elapsed,
                  states_per_s=r.states_per_second, truncated=r.truncated, violations=len(r.violations))
    t.notes.append("Breadth-first over the composed D and P planes with the real machines; liveness drains "
                   "included in the time. A truncated run's counts are not comparable across the symmetry setting.")
    return [t]
