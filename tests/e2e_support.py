"""Shared runs for the end-to-end tests: each scenario runs P and D for real
(two processes, NIXL over loopback) once per test session, and the replay
test reuses the logs those runs wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvplane.app.job.options import RunOptions
from kvplane.app.job.orchestrator import run_job

REPO = Path(__file__).resolve().parent.parent

# Short configurations: a few seconds each on a 2-core machine.  Every
# scenario has multi-turn requests (12 requests cover every request kind).
# Where a test asserts that an on-time turn 2 is read, the hold is long
# (5-6 s) so that a loaded machine (load average 10 on 2 cores) still reads
# it in time; a late turn 2 comes inside the margin whatever the load.
SCENARIOS: dict[str, dict] = {
    # Through the CLI, as a user runs it; overload long enough for heartbeats.
    "normal": dict(requests=16, overload=1.5, hold_ttl=5.0),
    # All requests queue on D (heartbeating) for long; the kill comes after
    # three heartbeats, so every lease's deadline is last heartbeat + extension.
    "kill": dict(requests=12, overload=8.0, kill_decode_at=3.5, hold_ttl=3.0),
    "hang": dict(requests=12, overload=8.0, hang_decode_at=3.5, hold_ttl=3.0),
    "drop": dict(requests=16, overload=0.5, drop_notifications=0.3, hold_ttl=2.5, seed=3),
    "push": dict(requests=12, overload=0.5, push=True, hold_ttl=2.5),
    # Turn 2 on time and late (inside the margin), D's clock 50 s ahead.
    "turn2_expired": dict(requests=12, overload=0.0, hold_ttl=6.0, clock_skew=50.0),
    # Sustained load: requests arrive faster than D's 2 s queue lets P's
    # leases go, so P's block pool is always full; turn 2 (a 4 s hold, 3 s
    # to read it before the margin) must still get blocks.
    "sustained": dict(requests=400, overload=2.0, hold_ttl=4.0),
    # The job times out mid-stream (requests arrive for 8 s, D queues each
    # for 1 s): it must abandon what is in flight and end holding nothing.
    "timeout": dict(requests=400, overload=1.0, hold_ttl=3.0, timeout=4.0),
    # Tensor parallelism: each engine a scheduler plus one process per rank.
    "tp4_2": dict(requests=12, overload=1.5, hold_ttl=5.0, prefill_tp=4, decode_tp=2),
    "tp1_2": dict(requests=12, overload=1.5, hold_ttl=5.0, prefill_tp=1, decode_tp=2),
    # One decode rank dies while every request queues on D (heartbeating).
    "kill_rank": dict(requests=12, overload=8.0, kill_decode_at=3.5, rank=1, hold_ttl=3.0, prefill_tp=2,
                      decode_tp=2),
}
# Generous: these are not timing tests.  A run takes a few seconds idle; the
# limits only keep a broken run from hanging the suite.
DEFAULTS = dict(timeout=300.0, startup_timeout=600.0)

_cache: dict[str, dict] = {}


def _cli_args(opts: dict, out: Path) -> list[str]:
    args = [sys.executable, "-m", "kvplane.app.cli", "run", "--out", str(out), "--quiet"]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            args.append(flag)
        else:
            args += [flag, str(v)]
    return args


def run_scenario(name: str, base: Path) -> dict:
    """The scenario's summary (run once per session).  ``normal`` goes
    through ``python -m kvplane.app.cli run``; the others call run_job, the
    function the CLI uses, to save a process start."""
    if name in _cache:
        return _cache[name]
    out = base / name
    opts = SCENARIOS[name]
    if name == "normal":
        opts = dict(DEFAULTS, **opts)
        env = dict(os.environ, UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="ERROR")
        proc = subprocess.run(_cli_args(opts, out), cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
        summary = json.loads((out / "summary.json").read_text())
        summary["_returncode"] = proc.returncode
        summary["_stdout"] = proc.stdout + proc.stderr
    else:
        summary = run_job(RunOptions(out=str(out), quiet=True, **dict(DEFAULTS, **opts)))
    _cache[name] = summary
    return summary
