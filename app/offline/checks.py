"""What ``kvplane replay``, ``kvplane check-log`` and ``kvplane explore`` run.

Each returns the exit code: 0 ok, 1 divergence / leak / hot obligation /
violation, 2 bad input (unreadable or malformed log, bad arguments).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from kvplane.statemachines.eventlog import EventLogError, lines_before, read_log, torn_last_line
from kvplane.statemachines.lifecycle_counts import eviction_words
from kvplane.statemachines.explorer import ENGINE_FAULTS, PROFILES, RANK_FAULTS, STALL_FAULTS, ExploreConfig, ExploreResult, Violation, explore
from kvplane.statemachines.monitors import DEFAULT_GRACE, check_log
from kvplane.statemachines.replay import Divergence, replay

from ..job.options import finite_float, int_at_least
from .progress import PLAIN_EVERY_S, ExploreProgress

OK, FAILED, BAD_INPUT = 0, 1, 2
# The version of the --json objects; a field's meaning never changes within one.
JSON_SCHEMA = 1


def _console() -> Console:
    # No markup: log contents (ids, event names) are printed, and a "[/x]"
    # in them must not be parsed as a style tag (rich raises on a stray one).
    return Console(highlight=False, markup=False, emoji=False)


def _emit_json(obj: dict) -> None:
    """The --json output: one object, one line, on stdout."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def _os_error(exc: Exception) -> str:
    """An error in words: an OSError's reason without its repr'd file name."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def _label(key: Any) -> str:
    """A stats key in words (stats records have a ``label``; plain counters are strings)."""
    return getattr(key, "label", str(key))


def _divergence_json(d: Divergence | None) -> dict | None:
    return None if d is None else {"seq": d.seq, "line": d.line, "what": d.what, "expected": d.expected,
                                   "got": d.got, "message": str(d)}


def violation_note_path(log_path: str) -> str:
    """Where ``kvplane explore --out`` notes which property a counterexample's
    logs (``<prefix>.<plane>.jsonl``) violate: ``<prefix>.violation.json``."""
    head, name = os.path.split(log_path)
    prefix = name.rsplit(".", 2)[0] if name.count(".") >= 2 else name
    return os.path.join(head, prefix + ".violation.json")


def _violation_note(log_path: str) -> dict | None:
    """The note beside a counterexample's log, if this log is one."""
    try:
        with open(violation_note_path(log_path), encoding="utf-8") as f:
            note = json.load(f)
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) and "kind" in note else None


def _whole_lines(command: str, path: str):
    """What to read of the log at ``path``: the path itself, or, when its last
    line is torn (a writer killed mid-line), the lines before it, with a
    warning on stderr.  Raises OSError for a file that cannot be read."""
    torn = torn_last_line(path)
    if torn is None:
        return path
    print(f"warning: kvplane {command}: {path}: line {torn} is torn (a writer killed mid-line): "
          f"read up to line {torn - 1}", file=sys.stderr)
    return list(lines_before(path, torn))


def _bad_input(command: str, message: str, json_obj: dict | None) -> int:
    """One line on stderr (and, with --json, the object on stdout): exit 2."""
    if json_obj is not None:
        _emit_json({**json_obj, "ok": False, "error": message})
    print(f"kvplane {command}: {message}", file=sys.stderr)
    return BAD_INPUT


def cmd_replay(path: str, *, json_out: bool = False) -> int:
    con = _console()
    where = os.path.abspath(path)
    try:
        r = replay(_whole_lines("replay", path))
    except (EventLogError, OSError) as exc:
        return _bad_input("replay", f"cannot replay {where}: {_os_error(exc)}",
                          {"command": "replay", "schema": JSON_SCHEMA, "log": where} if json_out else None)
    if r.assumed is not None:
        print(f"note: {where} has no config header and replays only under an older version's defaults: "
              f"{r.assumed}", file=sys.stderr)
    note = _violation_note(path)
    if json_out:
        _emit_json({
            "command": "replay", "schema": JSON_SCHEMA, "log": where, "ok": r.ok,
            "lines": r.lines, "recorded_lines": r.recorded_lines, "end_t": r.end_time,
            "requests": dict(sorted(r.requests.items())),
            "leases": {what: r.leases[what] for what in ("granted", "extended", "expired", "released")},
            "engines_evicted": r.engines_evicted, "evictions": r.evictions,
            "anomalies": [{"key": str(k), "label": _label(k), "count": n} for k, n in sorted(r.anomalies.items())],
            "divergence": _divergence_json(r.divergence),
            "held": [{"machine": kind, "id": str(key), "state": state, "holds": list(res)}
                     for kind, key, state, res in r.held],
            "counterexample_of": note, "assumed_defaults": r.assumed,
        })
        return OK if r.ok else FAILED
    t = Table(title=f"replay {where}")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("lines", str(r.lines))
    t.add_row("recorded lines (checked exactly)", str(r.recorded_lines))
    for state, n in sorted(r.requests.items()):
        t.add_row(f"requests {state}", str(n))
    for what in ("granted", "extended", "expired", "released"):
        t.add_row(f"leases {what}", str(r.leases[what]))
    t.add_row("engines evicted", eviction_words(r.engines_evicted, r.evictions))
    for key, n in sorted(r.anomalies.items()):
        t.add_row(_label(key), str(n))
    con.print(t)
    if note is not None:
        # The property is cross-plane (the explorer's); one plane's replay
        # shows its symptom (a leak, a divergence) or nothing at all.
        con.print(f"counterexample of the explorer's property {note['kind']}: {note.get('message', '')}")
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


def cmd_check_log(path: str, grace: float = DEFAULT_GRACE, *, json_out: bool = False) -> int:
    con = _console()
    where = os.path.abspath(path)

    def refuse(message: str) -> int:
        return _bad_input("check-log", message,
                          {"command": "check-log", "schema": JSON_SCHEMA, "log": where} if json_out else None)

    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < math.inf:
        return refuse(f"bad --grace {grace!r}: must be a finite number of seconds >= 0")
    try:
        log = read_log(_whole_lines("check-log", path))
        rep = check_log(log, grace=grace)
    except (EventLogError, OSError) as exc:
        return refuse(f"cannot check {where}: {_os_error(exc)}")
    start = log.records[0].t  # read_log refuses a log without an event line

    def rel(t: float | None) -> float | None:
        # Rounded to the microsecond: a difference of two log times keeps float noise.
        return None if t is None else round(t - start, 6)

    if json_out:
        _emit_json({
            "command": "check-log", "schema": JSON_SCHEMA, "log": where, "ok": rep.ok, "grace_s": grace,
            "lines": rep.lines, "start_t": start, "end_t": rep.end_time, "discharged": rep.discharged,
            "divergence": _divergence_json(rep.divergence),
            "hot": [{"machine": h.kind, "id": str(h.key), "resource": h.resource, "state": h.state,
                     "reason": h.reason, "since_s": rel(h.since), "deadline_s": rel(h.deadline), "at_s": rel(h.at),
                     "since_t": h.since, "deadline_t": h.deadline, "at_t": h.at} for h in rep.hot],
        })
        return OK if rep.ok else FAILED
    end = rep.end_time if rep.end_time is not None else start
    con.print(f"{where}: {rep.lines} lines over {end - start:g} s (log clock t={start:g} to {end:g}), "
              f"{rep.discharged} obligations discharged")
    if rep.divergence is not None:
        # The monitors watched the replay, not the recorded run: fail.
        con.print(f"DIVERGENCE at {rep.divergence}")
    if rep.hot:
        t = Table(title="hot obligations (times in seconds from the log's start)")
        for col in ("machine", "id", "resource", "state", "since", "deadline", "why"):
            t.add_column(col)
        for h in rep.hot:
            t.add_row(h.kind, str(h.key), h.resource, h.state, f"{rel(h.since):g}",
                      "-" if h.deadline is None else f"{rel(h.deadline):g}", h.reason.replace("_", " "))
        con.print(t)
    con.print("OK" if rep.ok else "FAILED")
    return OK if rep.ok else FAILED


def add_explore_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = ExploreConfig()
    parser.add_argument("--requests", default=",".join(d.requests), metavar="PROFILES",
                        help="comma-separated request profiles: read, hit, notify, read2 (turn 2), push")
    parser.add_argument("--depth", type=int_at_least(1), default=d.max_depth, metavar="N",
                        help="moves per execution, at most")
    parser.add_argument("--faults", type=int_at_least(0), default=d.max_faults, metavar="N",
                        help="fault budget per execution")
    parser.add_argument("--aborts", type=int_at_least(0), default=d.max_aborts, metavar="N",
                        help="abort budget per execution")
    parser.add_argument("--skew", type=finite_float(), default=d.skew, metavar="S", help="P clock minus D clock, seconds")
    parser.add_argument("--stall", type=finite_float(), nargs="?", const=d.stall, default=None, metavar="S",
                        help=f"add the fault 'D stalls' for up to S seconds ({d.stall:g} when S is omitted): D's "
                             "timers and loop stop while P's run on (not in the default fault set)")
    parser.add_argument("--ranks", default=None, metavar="PxD",
                        help="one plane per worker rank: P's TP x D's TP (e.g. 2x2, 1x2), with the rank faults "
                             "(a heartbeat lost to one rank, one rank's notification lost, a rank crash)")
    parser.add_argument("--engine", action="store_true",
                        help="the engine world: vLLM's scheduler (aborts, preemption, repeated calls, worker output "
                             "in any step) drives the engine_request machine of each side over the ranks (default "
                             "2x2); profiles read, hit, notify")
    parser.add_argument("--preemptions", type=int_at_least(0), default=d.max_preemptions, metavar="N",
                        help="the engine world's preemptions")
    parser.add_argument("--max-states", type=int_at_least(1), default=d.max_states, metavar="N",
                        help="stop (truncated) after this many distinct states")
    parser.add_argument("--no-symmetry", action="store_true", help="do not merge states that differ only in "
                                                                   "the naming of interchangeable requests")
    parser.add_argument("--no-liveness", action="store_true", help="skip the fault-free drains (safety only)")
    parser.add_argument("--all", action="store_true", help="keep going after the first violation")
    parser.add_argument("--out", default=None, metavar="DIR", help="write each counterexample's event logs here")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of tables")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (without it: states found, depth, states waiting and states/s, "
                             "a live line on a terminal, a plain line every "
                             f"{PLAIN_EVERY_S:g} s otherwise; none with --json either)")
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
    ``<prefix>.mmd`` (not in the list: the list is what replays); from the
    rank world one per D rank, ``<prefix>.D<r>.mmd``."""
    from kvplane.app.sequence_diagrams.command import violation_diagram

    paths = []
    for name, lines in v.logs.items():
        path = f"{prefix}.{name}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        paths.append(path)
    if set(v.logs) <= {"P", "D"}:
        pairs = {"": v.logs}
    else:  # the rank world: each D rank beside the P rank it reads (same index, or P0 when P has one rank)
        pairs = {f".{d}": {"P": v.logs.get(f"P{d[1:]}", v.logs.get("P0", [])), "D": v.logs[d]}
                 for d in sorted(v.logs) if d.startswith("D")}
    for suffix, logs in pairs.items():
        with open(f"{prefix}{suffix}.mmd", "w", encoding="utf-8") as f:
            f.write(violation_diagram(logs, str(v).splitlines()))
    return paths


def write_counterexamples(result: ExploreResult, directory: str) -> list[str]:
    """Each violation's logs as ``<directory>/<NN>-<kind>.<plane>.jsonl``."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for n, v in enumerate(result.violations, 1):
        paths += write_violation(v, os.path.join(directory, f"{n:02d}-{v.kind}"))
    return paths


def write_violation_notes(result: ExploreResult, directory: str) -> list[str]:
    """Beside each violation's logs (``write_counterexamples``' names), the
    property it violates, so that ``kvplane replay`` of one log can say."""
    paths = []
    for n, v in enumerate(result.violations, 1):
        path = os.path.join(directory, f"{n:02d}-{v.kind}.violation.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_violation_json(v), f, indent=1)
            f.write("\n")
        paths.append(path)
    return paths


def _violation_json(v: Violation) -> dict:
    return {"kind": v.kind, "message": v.message, "steps": list(v.moves)}


def cmd_explore(args: Any = None) -> int:
    """``args``: an argparse Namespace (missing attributes take defaults), or a list of argv strings."""
    con = _console()
    json_out = False
    try:
        a = _explore_args(args)
        json_out = bool(a.json)
        requests = tuple(x.strip() for x in str(a.requests).split(",") if x.strip())
        unknown = [r for r in requests if r not in PROFILES]
        if unknown or not requests:
            raise ValueError(f"--requests: unknown profile(s) {', '.join(unknown) or '(none given)'} "
                             f"(known: {', '.join(PROFILES)})")
        cfg = ExploreConfig(requests=requests, max_depth=a.depth, max_faults=a.faults, max_aborts=a.aborts,
                            skew=a.skew, max_states=a.max_states, symmetry=not a.no_symmetry,
                            liveness=not a.no_liveness, stop_at_first=not a.all)
        if a.stall is not None:
            if not a.stall > 0:
                raise ValueError(f"--stall must be > 0, got {a.stall:g}")
            cfg = attrs.evolve(cfg, faults=STALL_FAULTS, stall=a.stall)
        if a.ranks is not None:
            if a.stall is not None:
                raise ValueError("--ranks models no D stalls")
            try:
                p_tp, d_tp = (int(x) for x in str(a.ranks).lower().split("x"))
            except ValueError:
                raise ValueError(f"--ranks takes PxD, e.g. 2x2, got {a.ranks!r}") from None
            if p_tp < 1 or d_tp < 1:
                raise ValueError(f"--ranks: each TP size must be >= 1, got {a.ranks!r}")
            cfg = attrs.evolve(cfg, ranks=(p_tp, d_tp), faults=RANK_FAULTS)
        if a.engine:
            if a.stall is not None:
                raise ValueError("--engine models no D stalls")
            bad = [r for r in requests if r not in ("read", "hit", "notify")]
            if bad:
                raise ValueError(f"--engine models the profiles read, hit and notify, not {', '.join(bad)}")
            cfg = attrs.evolve(cfg, engine=True, ranks=cfg.ranks or (2, 2), faults=ENGINE_FAULTS,
                               max_preemptions=a.preemptions)
        if a.out:
            try:  # before the search: its counterexamples must have somewhere to go
                os.makedirs(a.out, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"--out {a.out}: cannot create it: {exc.strerror or exc}") from None
        if a.quiet or json_out:
            result = explore(cfg, clock=time.perf_counter)
        else:
            with ExploreProgress() as shown:
                result = explore(cfg, clock=time.perf_counter, progress=shown.update)
    except SystemExit:
        return BAD_INPUT
    except (KeyError, ValueError, TypeError) as exc:
        # In words: a KeyError's str() is the key's repr.
        message = f"kvplane explore: {exc.args[0] if isinstance(exc, KeyError) and exc.args else exc}"
        if json_out:
            _emit_json({"command": "explore", "schema": JSON_SCHEMA, "ok": False, "error": message})
        print(message, file=sys.stderr)
        return BAD_INPUT
    written: dict[int, list[str]] = {}
    if result.violations and a.out:
        paths = write_counterexamples(result, a.out)
        write_violation_notes(result, a.out)
        for n in range(1, len(result.violations) + 1):
            written[n] = [os.path.abspath(p) for p in paths if os.path.basename(p).startswith(f"{n:02d}-")]
    if json_out:
        _emit_json({
            "command": "explore", "schema": JSON_SCHEMA, "ok": result.ok,
            "config": {"requests": list(requests), "max_depth": cfg.max_depth, "max_faults": cfg.max_faults,
                       "max_aborts": cfg.max_aborts, "skew_s": cfg.skew,
                       "stall_s": cfg.stall if "stall" in cfg.faults else None, "symmetry": cfg.symmetry,
                       "liveness": cfg.liveness, "max_states": cfg.max_states, "stop_at_first": cfg.stop_at_first,
                       "ranks": list(cfg.ranks) if cfg.ranks is not None else None, "engine": cfg.engine,
                       "max_preemptions": cfg.max_preemptions if cfg.engine else None},
            "states": result.states, "transitions": result.transitions,
            "max_depth_reached": result.max_depth_reached, "states_cut_at_max_depth": result.frontier_cut,
            "drains": result.drained, "elapsed_s": round(result.elapsed, 3),
            "states_per_s": round(result.states_per_second, 1) if result.elapsed > 0 else None,
            "truncated": result.truncated,
            "violations": [{**_violation_json(v), "logs": written.get(n, [])}
                           for n, v in enumerate(result.violations, 1)],
        })
        return OK if result.ok else FAILED
    t = Table(title="explore")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("requests", ", ".join(requests))
    t.add_row("depth / faults / aborts / skew", f"{cfg.max_depth} / {cfg.max_faults} / {cfg.max_aborts} / {cfg.skew:g}")
    if cfg.ranks is not None:
        t.add_row("ranks (P x D)", f"{cfg.ranks[0]} x {cfg.ranks[1]}")
    if cfg.engine:
        t.add_row("engine world (vLLM's scheduler)", f"on, {cfg.max_preemptions} preemption(s)")
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
    for paths in written.values():
        for p in paths:
            con.print(f"wrote {p}")
    con.print("OK" if result.ok else "FAILED")
    return OK if result.ok else FAILED
