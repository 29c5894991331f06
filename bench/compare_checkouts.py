"""The plane's costs in two checkouts side by side: is a change slower?

Not a test.  From the repository root:

    python -m bench.compare_checkouts OTHER_CHECKOUT [--rounds N] [--explorer]

Runs ``bench/checkout_probe.py`` (this checkout's file, the same workloads
on both sides) in a fresh interpreter per checkout with ``PYTHONPATH`` set to
that checkout, alternating the two for ``--rounds`` rounds so that the
machine's background load hits both alike, and prints each checkout's best
and median CPU time per unit with the ratio of the medians, this / other.
The workloads: a lease heartbeat and a decode lifecycle through
``Machine.handle`` and ``ControlPlane.handle`` (µs per event), and a decode
request and a lease through a recording plane (µs per request: an
EventLogWriter attached, the configuration that ships); events are built
inside the timed loops, the same on both sides.  Then the vLLM connector's
scheduler halves with a deployment secret (no vLLM: a stand-in request):
D's ``on_new_request`` of P's signed params, P's ``request_finished`` (the
lease and the signature), and an engine step with nothing to tell.  ``--explorer`` adds the
explorer's default profile (states per CPU second; its ratio is this /
other too, so above 1 is faster here).  Make OTHER with
``git worktree add --detach /tmp/old REV``.
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
PROBE = Path(__file__).resolve().parent / "checkout_probe.py"
LABELS = ("lease heartbeat, Machine.handle (µs/event)", "lease heartbeat, ControlPlane.handle (µs/event)",
          "decode lifecycle, Machine.handle (µs/event)", "decode lifecycle, ControlPlane.handle (µs/event)",
          "decode request, recording on (µs/request)", "lease + 4 HB + done, recording on (µs/request)",
          "connector D accepts signed params (µs/request)", "connector P grants, signs (µs/request)",
          "connector empty step, scheduler half (µs/step)")
EXPLORER_LABEL = "explorer default profile (states/CPU-s)"


def probe(checkout: Path, explorer: bool) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run([sys.executable, str(PROBE), *(["--explorer"] if explorer else [])], cwd=checkout, env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare_checkouts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", type=Path, help="the checkout to compare with (e.g. a worktree of main)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--explorer", action="store_true", help="also the explorer's states per CPU second")
    a = ap.parse_args(argv)
    other = a.other.resolve()
    if not (other / "statemachines" / "plane.py").is_file() or not (other / "kvplane").is_dir():
        print(f"{other}: not a kvplane checkout", file=sys.stderr)
        return 2
    this_runs, other_runs = [], []
    for i in range(a.rounds):
        this_runs.append(probe(HERE, a.explorer))
        other_runs.append(probe(other, a.explorer))
        print(f"round {i + 1}/{a.rounds} done", file=sys.stderr)
    labels = LABELS + ((EXPLORER_LABEL,) if a.explorer else ())
    print(f"CPU time per unit, best / median of {a.rounds} alternating rounds; ratio of medians this / other; "
          f"this = {HERE}, other = {other}")
    print(f"{'workload':<50} {'this':>15} {'other':>15} {'this/other':>11}")
    for k, label in enumerate(labels):
        t = [r[k] for r in this_runs]
        o = [r[k] for r in other_runs]
        best = max if label == EXPLORER_LABEL else min  # a rate: the best is the highest
        print(f"{label:<50} {best(t):7.2f}/{statistics.median(t):7.2f} {best(o):7.2f}/{statistics.median(o):7.2f}"
              f" {statistics.median(t) / statistics.median(o):6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
