"""Dispatch cost of two checkouts side by side: is a change slower?

Not a test.  From the repository root:

    python -m bench.compare_checkouts OTHER_CHECKOUT [--rounds N]

Runs ``bench.dispatch_quick``'s four workloads (lease heartbeat and decode
lifecycle, through ``Machine.handle`` and ``ControlPlane.handle``) in a fresh
interpreter per checkout, alternating the two for ``--rounds`` rounds so
that the machine's background load hits both alike, and prints each
checkout's best and median CPU microseconds per event with the ratio
this / other.  Make OTHER with ``git worktree add --detach /tmp/old REV``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
WORKLOADS = ("machine_heartbeat", "plane_heartbeat", "machine_lifecycle", "plane_lifecycle")
LABELS = ("lease heartbeat, Machine.handle", "lease heartbeat, ControlPlane.handle",
          "decode lifecycle, Machine.handle", "decode lifecycle, ControlPlane.handle")

# Run inside the checkout under test: its own bench.dispatch_quick and kvplane.
_PROBE = f"""
WORKLOADS = {WORKLOADS!r}
import json, time
import bench.dispatch_quick as q
def best(fn, n, repeats=5):
    ts = []
    for _ in range(repeats):
        t0 = time.process_time(); fn(n); ts.append(time.process_time() - t0)
    return min(ts) / n * 1e6
print(json.dumps([best(getattr(q, name), 30000) for name in WORKLOADS]))
"""


def probe(checkout: Path) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=checkout, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare_checkouts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", type=Path, help="the checkout to compare with (e.g. a worktree of main)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    a = ap.parse_args(argv)
    other = a.other.resolve()
    if not (other / "bench" / "dispatch_quick.py").is_file():
        print(f"{other}: not a kvplane checkout with bench/dispatch_quick.py", file=sys.stderr)
        return 2
    this_runs, other_runs = [], []
    for i in range(a.rounds):
        this_runs.append(probe(HERE))
        other_runs.append(probe(other))
        print(f"round {i + 1}/{a.rounds} done", file=sys.stderr)
    print(f"µs per event (CPU time), best / median of {a.rounds} alternating rounds; this = {HERE}, other = {other}")
    print(f"{'workload':<40} {'this':>13} {'other':>13} {'this/other':>11}")
    for k, label in enumerate(LABELS):
        t = [r[k] for r in this_runs]
        o = [r[k] for r in other_runs]
        print(f"{label:<40} {min(t):6.2f}/{statistics.median(t):5.2f} {min(o):6.2f}/{statistics.median(o):5.2f}"
              f" {min(t) / min(o):6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
