"""The ``kvplane`` command line.

    kvplane run            prefill + decode processes over real NIXL (the main job)
    kvplane diagrams       render diagrams/ from the machine tables (--check: compare only)
    kvplane replay LOG     replay an event log; non-zero on divergence or leak
    kvplane check-log LOG  liveness monitors over a log
    kvplane explore        exhaustive interleavings with faults (model checker)

The benchmark suite is not part of the installed package: run
`python -m bench` from a checkout.

Subcommands import their modules lazily so that ``kvplane diagrams`` does
not pay for NIXL or torch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _diagrams(args) -> int:
    from kvplane.app import diagram_folders as folders
    from kvplane.app import diagrams

    try:
        if args.check:
            folder = Path(args.out) if args.out else folders.committed()
            stale = diagrams.stale_files(folder)
            if stale:
                # Outside a checkout the shipped copy is the reference: the
                # installed tables differ from the release's diagrams.
                fix = "run `kvplane diagrams`" if args.out or folders.checkout_dir() else \
                    "the installed tables differ from the diagrams shipped with them"
                print(f"stale diagrams in {folder}: {', '.join(stale)} ({fix})")
                return 1
            print(f"diagrams in {folder} are up to date")
            return 0
        out = Path(args.out) if args.out else folders.default_out()
        if not diagrams.have_dot():
            print("note: graphviz `dot` (or the graphviz package) not found; writing Mermaid only "
                  "(apt-get install graphviz for SVG)")
        for path in diagrams.write_all(out):
            print(f"wrote {path}")
        return 0
    except folders.DiagramsUnavailable as exc:
        print(f"kvplane diagrams: {exc}")
        return 2


def _replay(args) -> int:
    from kvplane.app.checks import cmd_replay

    return cmd_replay(args.log)


def _check_log(args) -> int:
    from kvplane.app.checks import cmd_check_log

    return cmd_check_log(args.log, args.grace)


def _explore(args) -> int:
    from kvplane.app.checks import cmd_explore

    return cmd_explore(args)


def _run(args) -> int:
    from kvplane.app.orchestrator import cmd_run

    return cmd_run(args)


def _sequence(args) -> int:
    from kvplane.app.sequence import cmd_sequence

    return cmd_sequence(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvplane", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("diagrams", help="render state diagrams from the machine tables")
    d.add_argument("--out", help="output folder (default: the checkout's diagrams/ when run from a checkout, "
                                 "otherwise the current directory)")
    d.add_argument("--check", action="store_true",
                   help="write nothing; fail if the diagrams differ from the tables (those in --out; by default "
                        "the checkout's, or the ones installed with the package)")
    d.set_defaults(fn=_diagrams)

    r = sub.add_parser("replay", help="replay an event log through fresh machines")
    r.add_argument("log")
    r.set_defaults(fn=_replay)

    c = sub.add_parser("check-log", help="run the liveness monitors over an event log")
    c.add_argument("log")
    c.add_argument("--grace", type=float, default=0.5, metavar="S",
                   help="report an obligation only when still hot S seconds past its deadline (default 0.5)")
    c.set_defaults(fn=_check_log)

    from kvplane.app.checks import add_explore_arguments

    e = sub.add_parser("explore", help="model-check the composed machines with faults")
    add_explore_arguments(e)
    e.set_defaults(fn=_explore)

    from kvplane.app.options import add_run_arguments

    run = sub.add_parser("run", help="the main job: P and D processes exchanging KV over NIXL")
    add_run_arguments(run)
    run.set_defaults(fn=_run)

    from kvplane.app.sequence import add_sequence_arguments

    sq = sub.add_parser("sequence", help="both sides' event logs as one Mermaid sequence diagram",
                        formatter_class=p.formatter_class,
                        description="Merge a prefill and a decode event log on one time line (D's clock corrected "
                                    "with the handshake's clock offset) and draw it as a Mermaid sequenceDiagram.")
    add_sequence_arguments(sq)
    sq.set_defaults(fn=_sequence)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
