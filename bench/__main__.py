"""``python -m bench [--quick] [--json PATH] [--markdown PATH] [SECTION ...]``

Benchmarks that compare implementations side by side in one run and report
ratios.  Nothing here passes or fails on a timing; the exit status is
non-zero only when a section crashes.

A section may return tables titled ``"targets: ..."`` with the columns
(target, measured, goal, met), met "YES" or "NO" (``report.targets_table``):
their rows are printed together as the final "Targets" table, and written
once, as that table, to --json and --markdown.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

# Before anything imports NIXL/UCX: loopback only, quiet logs (a bench box has no RDMA NIC).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

from .report import Table, collect_targets, environment, is_targets, print_table, to_json, to_markdown  # noqa: E402

# Section name -> module with ``run(quick) -> list[Table]``, in run order.
# memory runs last: its 1M-request populations (built under tracemalloc) leave
# the process's heap fragmented, and scale's 1M-in-flight steps measured after
# it read 15-20x longer (a 77 ms step against 4 ms in a fresh process).
SECTIONS = {
    "dispatch": "bench.dispatch",
    "step": "bench.step",
    "scale": "bench.scale",
    "nixl": "bench.nixl",
    "eventlog": "bench.eventlog",
    "explorer": "bench.explorer",
    "datapath": "bench.datapath",
    "memory": "bench.memory",
    "vllm": "bench.vllm_ttft",
    "connector": "bench.connector",
}
# Run only when named: each starts four vLLM engines (minutes) and needs the vllm extra.
OPT_IN = ("vllm", "connector")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="kvplane's benchmarks (run from a checkout; not part of the installed package): they compare "
                    "implementations side by side in one run and report ratios. Nothing passes or fails on a "
                    "timing; the exit status is non-zero only when a section crashes.")
    p.add_argument("sections", nargs="*", metavar="SECTION",
                   help=f"which to run (default: all but {', '.join(OPT_IN)}): {', '.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="short smoke run (small sizes, few rounds)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the results as a Markdown table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        print(f"unknown section(s): {', '.join(unknown)}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    from rich.console import Console

    # Wide enough that the tables are not wrapped when output is piped or captured.
    console = Console(width=max(Console().width, 160))
    env = environment("quick" if args.quick else "full")
    console.print(f"[bold]kvplane bench[/bold] ({env['mode']}): {env['cpu']}, {env['cores']} CPUs, "
                  f"Python {env['python']}", highlight=False)
    tables: list[Table] = []
    failed = []
    for name in args.sections or [s for s in SECTIONS if s not in OPT_IN]:
        t0 = time.perf_counter()
        console.rule(name)
        try:
            got = importlib.import_module(SECTIONS[name]).run(args.quick)
        except Exception:  # one broken section must not hide the others' results
            failed.append(name)
            console.print(f"[red]section {name} crashed:[/red]", highlight=False)
            console.print(traceback.format_exc(), markup=False, highlight=False)
            continue
        n_targets = 0
        for t in got:
            if is_targets(t):  # printed once, with every section's, at the end
                n_targets += len(t.rows)
            else:
                print_table(t, console)
        tables += got
        if n_targets:
            console.print(f"[dim]{n_targets} target row(s): see the Targets table at the end[/dim]")
        console.print(f"[dim]{name}: {time.perf_counter() - t0:.1f} s[/dim]\n")
    summary = collect_targets(tables)
    shown = [t for t in tables if not is_targets(t)]
    if summary is not None:
        console.rule("targets")
        print_table(summary, console)
        shown.append(summary)
    if args.json:
        Path(args.json).write_text(to_json(shown, env) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(to_markdown(shown, env))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
