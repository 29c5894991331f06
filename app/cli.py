"""The ``kvplane`` command line.

The help text is ``DESCRIPTION`` and ``EPILOG``, written for a user; this
docstring is for readers of the code.  Subcommands import their modules
lazily so that ``kvplane diagrams`` and ``--help`` do not pay for NIXL or
torch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = ("kvplane: the control plane of a disaggregated prefill/decode KV-cache connector, "
               "as explicit state machines. Run the main job, check event logs, model-check the machines, "
               "render their diagrams.")
EPILOG = """\
exit status: 0 ok, 1 a check failed, 2 bad input or arguments.
`kvplane COMMAND --help` lists a command's options.

Benchmarks are not part of the installed package: from a checkout run
`python -m bench --help`.
"""


def version() -> str:
    """The installed distribution's version, else the package's own (a bare checkout)."""
    from importlib import metadata

    try:
        return metadata.version("kvplane")
    except metadata.PackageNotFoundError:
        import kvplane

        return kvplane.__version__


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default; keeps the line breaks of a text that has
    some (the epilog) and wraps the others.  An
    option without a value (a flag, or one whose absence is its meaning)
    shows none: "(default: None)" would read as a value."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument error is one line on stderr (exit 2), not the usage
    block: the line names the option and points at --help."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _diagrams(args) -> int:
    from kvplane.app.offline import diagram_folders as folders
    from kvplane.app.offline import diagrams

    try:
        if args.check:
            folder = (Path(args.out) if args.out else folders.committed()).resolve()
            if not folder.is_dir():
                print(f"kvplane diagrams: no folder {folder} to check", file=sys.stderr)
                return 2
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
        out = (Path(args.out) if args.out else folders.default_out()).resolve()
        if not diagrams.have_dot():
            print("note: graphviz `dot` not found; writing Mermaid only "
                  "(apt-get install graphviz for SVG)", file=sys.stderr)
        for path in diagrams.write_all(out):
            print(f"wrote {path}")
        return 0
    except folders.DiagramsUnavailable as exc:
        print(f"kvplane diagrams: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = exc.filename or args.out
        print(f"kvplane diagrams: cannot write {where}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _replay(args) -> int:
    from kvplane.app.offline.checks import cmd_replay

    return cmd_replay(args.log, json_out=args.json)


def _check_log(args) -> int:
    from kvplane.app.offline.checks import cmd_check_log

    return cmd_check_log(args.log, args.grace, json_out=args.json)


def _explore(args) -> int:
    from kvplane.app.offline.checks import cmd_explore

    return cmd_explore(args)


# Options of the sim engine's job only, with the value that means "not given".
SIM_ONLY = {"ucx_net_devices": None, "side_channel_host": None, "advertise_host": None,
            "rate_limit": None, "decode_engines": 1,
            "restart_decode_at": None, "engine_ttl": None}


def _run(args) -> int:
    if args.engine == "vllm":
        for flag, unset in SIM_ONLY.items():
            if getattr(args, flag, unset) != unset:
                print(f"kvplane run: --{flag.replace('_', '-')} needs --engine sim (not yet with vllm)", file=sys.stderr)
                return 2
        import importlib.util

        from kvplane.app.vllm.run import cmd_run_vllm, options_from_args

        try:  # nonsense options first: refused whether or not vLLM is installed
            options_from_args(args)
        except ValueError as exc:
            print(f"kvplane run: {exc}", file=sys.stderr)
            return 2
        if importlib.util.find_spec("vllm") is None:
            print("kvplane run: --engine vllm: vLLM is not installed: from the checkout, run scripts/install-vllm "
                  "(see docs/vllm.md)", file=sys.stderr)
            return 2
        return cmd_run_vllm(args)
    for flag in ("connector", "late_forward", "bidirectional", "late_turn2", "model", "prefill_block_size",
                 "decode_block_size", "prefill_dp", "decode_dp", "prefill_pp"):
        if hasattr(args, flag):
            print(f"kvplane run: --{flag.replace('_', '-')} needs --engine vllm", file=sys.stderr)
            return 2
    from kvplane.app.job.orchestrator import cmd_run

    return cmd_run(args)


def _proxy(args) -> int:
    from kvplane.app.vllm.proxy import cmd_proxy

    return cmd_proxy(args)


def _sequence(args) -> int:
    from kvplane.app.sequence_diagrams.command import cmd_sequence

    return cmd_sequence(args)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvplane", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    d = sub.add_parser("diagrams", help="render the state diagrams from the machine tables (--check: compare only)", formatter_class=HelpFormatter,
                       description="Render the state diagrams (Mermaid, and SVG when graphviz is installed) "
                                   "from the machine tables.")
    d.add_argument("--out", metavar="DIR", help="output folder (default: the checkout's diagrams/ when run from a checkout, "
                                 "otherwise the current directory)")
    d.add_argument("--check", action="store_true",
                   help="write nothing; fail if the diagrams differ from the tables (those in --out; by default "
                        "the checkout's, or the ones installed with the package)")
    d.set_defaults(fn=_diagrams)

    r = sub.add_parser("replay", help="replay an event log; exit 1 on a divergence or a leak", formatter_class=HelpFormatter,
                       description="Replay an event log (JSONL) through fresh machines: the recorded states and "
                                   "actions must be reproduced exactly, and nothing may be held at the end.")
    r.add_argument("log", help="the event log, e.g. runs/latest/prefill.events.jsonl")
    r.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of tables")
    r.set_defaults(fn=_replay)

    c = sub.add_parser("check-log", help="liveness monitors over an event log; exit 1 on an obligation still hot", formatter_class=HelpFormatter,
                       description="Run the liveness monitors over an event log: every obligation (a lease, a "
                                   "recv, a transfer) must be discharged by its deadline.")
    c.add_argument("log", help="the event log, e.g. runs/latest/decode.events.jsonl")
    c.add_argument("--grace", type=float, default=0.5, metavar="S",
                   help="report an obligation only when still hot S seconds past its deadline")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of tables")
    c.set_defaults(fn=_check_log)

    from kvplane.app.offline.checks import add_explore_arguments

    e = sub.add_parser("explore", help="model-check the composed machines with faults (every interleaving up to a depth)", formatter_class=HelpFormatter,
                       description="Explore every interleaving of the composed P and D machines, with faults, up "
                                   "to a depth; report the shortest path to each violated property.")
    add_explore_arguments(e)
    e.set_defaults(fn=_explore)

    from kvplane.app.job.options import add_placement_arguments, add_run_arguments

    run = sub.add_parser("run", help="the main job: a prefill and a decode process exchanging KV over real NIXL",
                         formatter_class=HelpFormatter,
                         description="Start a prefill (P) and a decode (D) process, send a synthetic request "
                                     "stream, move the KV over real NIXL, inject the requested faults, check "
                                     "that nothing leaks, and write the event logs and summary.json under --out.")
    add_run_arguments(run)
    add_placement_arguments(run)
    run.set_defaults(fn=_run)

    from kvplane.app.vllm.proxy import add_proxy_arguments

    px = sub.add_parser("proxy", help="a disaggregated-serving proxy for vLLM engines (P, then D)",
                        formatter_class=HelpFormatter,
                        description="Serve /v1/completions and /v1/chat/completions (streamed or not): each request "
                                    "goes to a P with max_tokens 1 and do_remote_decode, then to a D with P's "
                                    "kv_transfer_params (vLLM's protocol); several Ps and Ds are taken round robin.")
    add_proxy_arguments(px)
    px.set_defaults(fn=_proxy)

    from kvplane.app.vllm.attack import add_attack_arguments, cmd_attack

    at = sub.add_parser("attack", help="hostile requests straight to two vLLM engines' APIs (kvplane, nixl or both)",
                        formatter_class=HelpFormatter,
                        description="Start P and D (vLLM, tiny local model) and send each class of hostile "
                                    "kv_transfer_params of docs/security-tests.md; report per attack.")
    add_attack_arguments(at)
    at.set_defaults(fn=cmd_attack)

    from kvplane.app.sequence_diagrams.command import add_sequence_arguments

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
