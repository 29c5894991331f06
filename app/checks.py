"""What ``kvplane replay``, ``kvplane check-log`` and ``kvplane explore`` run.

Each returns the exit code: 0 ok, 1 divergence / leak / hot obligation /
violation, 2 bad input (unreadable or malformed log, bad arguments).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import attrs

from rich.console import Console
from rich.table import Table

from kvplane.statemachines.eventlog import EventLogError
from kvplane.statemachines.explorer import STALL_FAULTS, ExploreConfig, ExploreResult, Violation, explore
from kvplane.statemachines.monitors import DEFAULT_GRACE, check_log
from kvplane.statemachines.replay import replay

OK, FAILED, BAD_INPUT = 0, 1, 2


def _console() -> Console:
    # No markup: log contents (ids, event names) are printed, and a "[/x]"
    # in them must not be parsed as a style tag (rich raises on a stray one).
    return Console(highlight=False, markup=False, emoji=False)


def cmd_replay(path: str) -> int:
    con = _console()
    try:
        r = replay(path)
    except (EventLogError, OSError) as exc:
        con.print(f"cannot replay {path}: {exc}", style="red")
        return BAD_INPUT
    t = Table(title=f"replay {path}")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("lines", str(r.lines))
    t.add_row("recorded lines (checked exactly)", str(r.recorded_lines))
    for state, n in sorted(r.requests.items()):
        t.add_row(f"requests {state}", str(n))
    for what in ("granted", "extended", "expired", "released"):
        t.add_row(f"leases {what}", str(r.leases[what]))
    t.add_row("engines evicted", str(r.engines_evicted))
    for key, n in sorted(r.anomalies.items()):
        t.add_row(str(key), str(n))
    con.print(t)
    if r.divergence is not None:
        con.print(f"DIVERGENCE at {r.divergence}")
    if r.held:
        lt = Table(title="still held at the end of the log (leaks)")
        for col in ("machine", "id", "state", "holds"):
            lt.add_column(col)
        for kind, key, state, res in r.held:
            lt.add_row(kind, str(key), state, ", ".join(res))
        con.print(lt)
    con.print("OK" if r.ok else "FAILED")
    return OK if r.ok else FAILED


def cmd_check_log(path: str, grace: float = DEFAULT_GRACE) -> int:
    con = _console()
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < math.inf:
        con.print(f"bad --grace {grace!r}: must be a finite number of seconds >= 0", style="red")
        return BAD_INPUT
    try:
        rep = check_log(path, grace=grace)
    except (EventLogError, OSError) as exc:
        con.print(f"cannot check {path}: {exc}", style="red")
        return BAD_INPUT
    con.print(f"{rep.lines} lines, end t={rep.end_time}, {rep.discharged} obligations discharged")
    if rep.divergence is not None:
        # The monitors watched the replay, not the recorded run: fail.
        con.print(f"DIVERGENCE at {rep.divergence}")
    if rep.hot:
        t = Table(title="hot obligations")
        for col in ("machine", "id", "resource", "state", "since", "deadline", "why"):
            t.add_column(col)
        for h in rep.hot:
            t.add_row(h.kind, str(h.key), h.resource, h.state, f"{h.since:g}",
                      "-" if h.deadline is None else f"{h.deadline:g}", h.reason.replace("_", " "))
        con.print(t)
    con.print("OK" if rep.ok else "FAILED")
    return OK if rep.ok else FAILED


def add_explore_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = ExploreConfig()
    parser.add_argument("--requests", default=",".join(d.requests),
                        help="comma-separated request profiles: read, hit, notify, read2 (turn 2)")
    parser.add_argument("--depth", type=int, default=d.max_depth)
    parser.add_argument("--faults", type=int, default=d.max_faults, help="fault budget per execution")
    parser.add_argument("--aborts", type=int, default=d.max_aborts)
    parser.add_argument("--skew", type=float, default=d.skew, help="P clock minus D clock, seconds")
    parser.add_argument("--stall", type=float, nargs="?", const=d.stall, default=None, metavar="S",
                        help=f"add the fault 'D stalls' for up to S seconds (default {d.stall:g}): D's timers "
                             "and loop stop while P's run on (not in the default fault set)")
    parser.add_argument("--max-states", type=int, default=d.max_states)
    parser.add_argument("--no-symmetry", action="store_true")
    parser.add_argument("--no-liveness", action="store_true")
    parser.add_argument("--all", action="store_true", help="keep going after the first violation")
    parser.add_argument("--out", default=None, help="directory for counterexample logs")
    return parser


def _explore_args(args: Any) -> argparse.Namespace:
    if args is None or isinstance(args, (list, tuple)):
        parser = add_explore_arguments(argparse.ArgumentParser(prog="kvplane explore"))
        return parser.parse_args(list(args or []))
    defaults = add_explore_arguments(argparse.ArgumentParser()).parse_args([])
    for k, v in vars(defaults).items():
        if not hasattr(args, k):
            setattr(args, k, v)
    return args


def write_violation(v: Violation, prefix: str) -> list[str]:
    """Write ``<prefix>.<plane>.jsonl`` per plane (replayable); returns those
    paths.  Also writes the counterexample as a sequence diagram,
    ``<prefix>.mmd`` (not in the list: the list is what replays)."""
    from kvplane.app.sequence import violation_diagram

    paths = []
    for name, lines in v.logs.items():
        path = f"{prefix}.{name}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        paths.append(path)
    with open(f"{prefix}.mmd", "w", encoding="utf-8") as f:
        f.write(violation_diagram(v.logs, str(v).splitlines()))
    return paths


def write_counterexamples(result: ExploreResult, directory: str) -> list[str]:
    """Each violation's logs as ``<directory>/<NN>-<kind>.<plane>.jsonl``."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for n, v in enumerate(result.violations, 1):
        paths += write_violation(v, os.path.join(directory, f"{n:02d}-{v.kind}"))
    return paths


def cmd_explore(args: Any = None) -> int:
    """``args``: an argparse Namespace (missing attributes take defaults), or a list of argv strings."""
    con = _console()
    try:
        a = _explore_args(args)
        requests = tuple(x.strip() for x in str(a.requests).split(",") if x.strip())
        cfg = ExploreConfig(requests=requests, max_depth=a.depth, max_faults=a.faults, max_aborts=a.aborts,
                            skew=a.skew, max_states=a.max_states, symmetry=not a.no_symmetry,
                            liveness=not a.no_liveness, stop_at_first=not a.all)
        if a.stall is not None:
            if not a.stall > 0:
                raise ValueError(f"--stall must be > 0, got {a.stall:g}")
            cfg = attrs.evolve(cfg, faults=STALL_FAULTS, stall=a.stall)
        result = explore(cfg, clock=time.perf_counter)
    except SystemExit:
        return BAD_INPUT
    except (KeyError, ValueError, TypeError) as exc:
        con.print(f"bad explore arguments: {exc!r}")
        return BAD_INPUT
    t = Table(title="explore")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("requests", ", ".join(requests))
    t.add_row("depth / faults / aborts / skew", f"{cfg.max_depth} / {cfg.max_faults} / {cfg.max_aborts} / {cfg.skew:g}")
    t.add_row("D stalls", f"up to {cfg.stall:g} s" if "stall" in cfg.faults else "off (--stall)")
    t.add_row("symmetry reduction", "on" if cfg.symmetry else "off")
    t.add_row("states", str(result.states))
    t.add_row("transitions", str(result.transitions))
    t.add_row("states cut at max depth", str(result.frontier_cut))
    t.add_row("drains (liveness)", str(result.drained))
    t.add_row("time (s)", f"{result.elapsed:.2f}")
    t.add_row("states / s", f"{result.states_per_second:.0f}")
    if result.truncated:
        t.add_row("TRUNCATED", f"stopped at {cfg.max_states} states")
    con.print(t)
    for v in result.violations:
        con.print(f"VIOLATION {v}")
    if result.violations and a.out:
        for p in write_counterexamples(result, a.out):
            con.print(f"wrote {p}")
    con.print("OK" if result.ok else "FAILED")
    return OK if result.ok else FAILED
