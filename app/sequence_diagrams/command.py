"""``kvplane sequence``: both sides' event logs as one Mermaid sequence
diagram, plus the diagrams ``kvplane run`` and ``kvplane explore`` write.

The model (records -> arrows and notes) is ``sequence_model``, the text
``sequence_mermaid``; this module reads logs, picks requests and writes
files (an SVG too when the Mermaid CLI ``mmdc`` is on PATH).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

import attrs
from kvplane.statemachines.eventlog import EmptyLog, EventLogError, MalformedLine, read_log

from ..job.options import finite_float, int_at_least

from . import model
from .mermaid import check, render
from .model import D, P, Selection, SequenceDiagram, SideLog

OK, FAILED, BAD_INPUT = 0, 1, 2
JSON_SCHEMA = 1  # as the --json of replay, check-log and explore
NO_MMDC = "note: Mermaid CLI `mmdc` not found on PATH; wrote Mermaid only (npm install -g @mermaid-js/mermaid-cli for SVG)"


def read_side(side: str, source: str | Sequence[str]) -> SideLog:
    """One side's log.  A killed writer can leave a torn last line: that line
    is left out (and said so in the diagram); any other bad line is an error."""
    lines = _lines(source)
    name = source if isinstance(source, str) else ""
    try:
        return SideLog(side, read_log(lines).records, name)
    except EmptyLog:
        # A side killed before its first line: nothing to draw from it.
        return SideLog(side, (), name)
    except MalformedLine as exc:
        last = max((n for n, text in enumerate(lines, 1) if text.strip()), default=0)
        torn = exc.message.startswith(("not JSON", "not UTF-8"))
        if not torn or exc.line != last or last < 2:
            raise
        return SideLog(side, read_log(lines[:last - 1]).records, name, torn_tail=last)


def with_scheduler_log(ranks: SideLog, scheduler: SideLog) -> SideLog:
    """A side's rank log with its scheduler half's lines merged in by time
    (one process's clock: the scheduler and its ranks share the host's)."""
    merged = sorted(ranks.records + scheduler.records, key=lambda r: r.t)  # stable: each log keeps its order
    return attrs.evolve(ranks, records=tuple(merged))


def _lines(source: str | Sequence[str]) -> list:
    if isinstance(source, str):
        with open(source, "rb") as f:
            return f.read().split(b"\n")
    return list(source)


def diagram(p: str | Sequence[str], d: str | Sequence[str], selection: Selection | None = None) -> SequenceDiagram:
    """The model of two logs (paths, or their lines)."""
    return model.build({P: read_side(P, p), D: read_side(D, d)}, selection or Selection())


def write(d: SequenceDiagram, path: str, *, svg: bool = True, say: TextIO | None = None) -> list[str]:
    """Write ``path`` (Mermaid) and, when ``mmdc`` is on PATH, the SVG beside it; returns what was written."""
    text = render(d)
    check(text)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    written = [path]
    if svg:
        mmdc = shutil.which("mmdc")
        if mmdc is None:
            if say is not None:
                print(NO_MMDC, file=say)
        else:
            out = os.path.splitext(path)[0] + ".svg"
            try:
                subprocess.run([mmdc, "-i", path, "-o", out], check=True, capture_output=True, timeout=120)
                written.append(out)
            except (OSError, subprocess.SubprocessError) as exc:
                if say is not None:
                    print(f"note: mmdc failed ({exc}); wrote Mermaid only", file=say)
    return written


def _refuse(message: str) -> int:
    print(f"kvplane sequence: {message}", file=sys.stderr)
    return BAD_INPUT


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def cmd_sequence(args) -> int:
    err = sys.stderr
    if args.start is not None and args.end is not None and args.start > args.end:
        return _refuse(f"--from {args.start:g} is after --to {args.end:g}: the window is empty")
    if _same_file(args.p_log, args.d_log):
        return _refuse(f"P's and D's logs are the same file ({args.p_log}): give the prefill log, then the decode log")
    try:
        logs = {P: read_side(P, args.p_log), D: read_side(D, args.d_log)}
        # The scheduler halves' logs (the engine's calls), merged into their side's time line.
        for side, path in ((P, args.p_scheduler), (D, args.d_scheduler)):
            if path is not None:
                logs[side] = with_scheduler_log(logs[side], read_side(side, path))
    except OSError as exc:
        return _refuse(f"cannot read {exc.filename}: {exc.strerror or exc}")
    except EventLogError as exc:
        return _refuse(f"cannot read the logs: {exc}")
    for side, path in ((P, args.p_log), (D, args.d_log)):
        if not logs[side].records:
            return _refuse(f"{path} has no event line (an empty log): nothing to draw {side}'s side from")
    if logs[P].records == logs[D].records:
        return _refuse(f"{args.p_log} and {args.d_log} hold the same records: give the prefill log, then the decode log")
    seen = {side: model.looks_like(log.records) for side, log in logs.items()}
    if seen == {P: D, D: P}:
        # Given the other way round: draw them as their content says.
        logs = {P: attrs.evolve(logs[D], side=P), D: attrs.evolve(logs[P], side=D)}
        print(f"note: {args.p_log} is a decode log and {args.d_log} a prefill log (their leases and reads say so): "
              f"drawn with {args.d_log} as P", file=err)
    elif seen[P] == D or seen[D] == P:
        which = args.p_log if seen[P] == D else args.d_log
        return _refuse(f"{which} looks like the {'decode' if seen[P] == D else 'prefill'} side's log "
                       f"(its leases and reads say so): give the prefill log, then the decode log")
    for torn in (log for log in logs.values() if log.torn_tail):
        print(f"warning: {torn.source}: line {torn.torn_tail} is torn (a writer killed mid-line): read up to the "
              f"line before it", file=err)
    requests = tuple(args.request or ())
    unknown = [r for r in requests if r not in model.known_ids(logs)]
    if unknown:
        return _refuse(f"request(s) {', '.join(unknown)} appear in neither log")
    sel = Selection(request_ids=requests, start=args.start, end=args.end, max_events=args.max_events,
                    proxy=args.proxy)
    d = model.build(logs, sel)
    if not d.items and (args.start is not None or args.end is not None):
        return _refuse(f"no event between --from {args.start if args.start is not None else 0:g} and --to "
                       f"{args.end if args.end is not None else 'the end'} (seconds after the first event)")
    text = render(d)
    check(text)
    written: list[str] = []
    if args.out:
        try:
            written = [os.path.abspath(path) for path in write(d, args.out, say=None if args.json else err)]
        except OSError as exc:
            return _refuse(f"cannot write {args.out}: {exc.strerror or exc}")
        for path in written:
            print(f"wrote {path}", file=err)
    if args.json:
        _emit_json({"command": "sequence", "schema": JSON_SCHEMA, "ok": True,
                    "p_log": os.path.abspath(logs[P].source), "d_log": os.path.abspath(logs[D].source),
                    "swapped": seen == {P: D, D: P}, "items": len(d.items), "left_out": d.left_out,
                    "arrows": len(d.arrows), "notes": len(d.notes),
                    "clock_shift_s": d.clock.shift, "written": written,
                    "mermaid": None if args.out else text})
    elif not args.out:
        sys.stdout.write(text)
        sys.stdout.flush()
    if d.left_out:
        print(f"note: {d.left_out} event(s) left out past --max-events {args.max_events}", file=err)
    return OK


def _emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def add_sequence_arguments(p) -> None:
    p.add_argument("p_log", metavar="P.jsonl", help="the prefill side's event log")
    p.add_argument("d_log", metavar="D.jsonl", help="the decode side's event log")
    p.add_argument("--p-scheduler", default=None, metavar="PS.jsonl",
                   help="P's scheduler-half log (kvplane_event_log's scheduler file, e.g. "
                        "prefill.scheduler.events.jsonl): the engine's calls, drawn beside the wire messages")
    p.add_argument("--d-scheduler", default=None, metavar="DS.jsonl", help="D's scheduler-half log")
    p.add_argument("-o", "--out", default=None, help="write this .mmd file (and an .svg when mmdc is on PATH) "
                                                     "instead of printing to stdout")
    p.add_argument("--request", action="append", metavar="ID",
                   help="only this request (either side's id; its peer on the other side comes with it); "
                        "repeatable")
    p.add_argument("--from", dest="start", type=finite_float(0), default=None, metavar="T",
                   help="only events T seconds or later after the first event")
    p.add_argument("--to", dest="end", type=finite_float(0), default=None, metavar="T",
                   help="only events up to T seconds after the first event")
    p.add_argument("--max-events", type=int_at_least(1), default=model.DEFAULT_MAX_EVENTS, metavar="N",
                   help="draw at most N arrows and notes, saying how many were left out")
    p.add_argument("--proxy", action="store_true",
                   help="draw the proxy that forwarded kv_transfer_params (as kvplane run's parent does)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout: what was drawn (items, left out, clock shift), the files "
                        "written, and the Mermaid text when not written to --out")


# ------------------------------------------------------------------ kvplane run / explore
SAMPLE_REQUESTS = 2


def sample_requests(logs: dict[str, SideLog]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The first few P requests, and one that failed (a failed recv, or a lease
    that expired instead of being read), if any."""
    first: list[str] = []
    for r in logs[P].records if P in logs else ():
        if type(r.event).__name__ == "LeaseGranted" and r.event.renewable and r.event.request_id not in first:
            first.append(r.event.request_id)
    failed: list[str] = []
    for log in logs.values():
        for r in log.records:
            name = type(r.event).__name__
            if name == "TimerFired" and r.event.kind == "lease" and r.state_after == "EXPIRED":
                failed.append(str(r.event.key))
            for a_name, a in r.actions or ():
                if a_name == "ReportRecv" and not a.get("ok", True):
                    failed.append(a["request_id"])
    return tuple(first[:SAMPLE_REQUESTS]), tuple(failed[:1])


def write_run_samples(out_dir: str, p_log: str, d_log: str) -> list[str]:
    """``kvplane run``'s diagrams under ``out_dir``: ``sequence.mmd`` for the
    first requests, ``sequence-failed.mmd`` for a failed one if any.  Never
    fails the run: an unreadable log writes nothing."""
    written: list[str] = []
    try:
        logs = {P: read_side(P, p_log), D: read_side(D, d_log)}
        first, failed = sample_requests(logs)
        for name, ids in (("sequence.mmd", first), ("sequence-failed.mmd", failed)):
            if ids:
                d = model.build(logs, Selection(request_ids=ids, proxy=True))
                written += write(d, os.path.join(out_dir, name), svg=False)
    except (OSError, ValueError, KeyError, TypeError):
        # An unreadable log (EventLogError is a ValueError) or a diagram bug
        # must not fail the job that produced the logs.
        pass
    return written


def violation_diagram(logs: dict[str, Iterable[str]], title: Sequence[str] = ()) -> str:
    """The explorer's counterexample (its planes' in-memory JSONL lines) as
    Mermaid text; ``title``: the violation, one comment line each."""
    sides = {side: read_side(side, list(lines)) for side, lines in logs.items() if side in (P, D)}
    text = render(model.build(sides, Selection(max_events=10_000)), title)
    check(text)
    return text
