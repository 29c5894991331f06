"""Arguments of ``kvplane run`` (kept apart so ``--help`` needs no torch)."""
from __future__ import annotations

import argparse


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=48, help="synthetic requests to send (default 48)")
    p.add_argument("--out", default="runs/latest", help="folder for event logs and the summary")
    p.add_argument("--lease", type=float, default=None, metavar="S", help="kv_lease_duration in seconds (>= 6)")
    p.add_argument("--push", action="store_true", help="push mode: P WRITEs into D's registered blocks")
    p.add_argument("--kill-decode-at", type=float, default=None, metavar="S",
                   help="SIGKILL the decode process S seconds into the run")
    p.add_argument("--hang-decode-at", type=float, default=None, metavar="S",
                   help="SIGSTOP the decode process S seconds into the run")
    p.add_argument("--drop-notifications", type=float, default=0.0, metavar="RATE",
                   help="drop this fraction of notifications (0..1) on receipt")
    p.add_argument("--clock-skew", type=float, default=0.0, metavar="S", help="skew D's clock by S seconds")
    p.add_argument("--overload", type=float, default=None, metavar="S",
                   help="hold each request in D's queue for S seconds before scheduling (default 2; "
                        "heartbeats keep P's leases alive meanwhile)")
    p.add_argument("--hold-ttl", type=float, default=None, metavar="S",
                   help="decoder_kv_blocks_ttl: how long D holds blocks for turn 2 (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="stop sending work after this many seconds, abort what is in flight, release "
                        "everything held and report what was abandoned (exit 1)")
    p.add_argument("--startup-timeout", type=float, default=None, metavar="S",
                   help="how long the two engine processes may take to start (default 300; a loaded "
                        "machine needs more than an idle one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
