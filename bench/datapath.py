"""The main job's data path: ``kvplane run`` against a bare NIXL READ, one run.

Runs the main job (default workload; ``--quick``: 16 requests) from this
checkout and reads its summary: every transfer the ranks posted, timed from
post to the poll that saw it done, and the bare NIXL READ of the same sizes
that D's rank 0 makes beside them: one of each job READ's size, the next time it is idle
(``app/job/bare_read.py``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .report import Table

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.5  # the job's in-flight READ GB/s over the bare READ's
TARGET = "main job in-flight READ throughput / bare NIXL READ, same blocks, same run"


def run_job(out: str, quick: bool) -> dict:
    """One ``kvplane run`` of this checkout (its own code: cwd and PYTHONPATH); its summary."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["run", "--quiet", "--out", out] + (["--requests", "16"] if quick else [])
    proc = subprocess.run([sys.executable, "-c", "from kvplane.app.cli import main; raise SystemExit(main())",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    path = Path(out) / "summary.json"
    if not path.is_file():
        raise RuntimeError(f"kvplane run wrote no summary (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    return json.loads(path.read_text())


def tables(summary: dict) -> list[Table]:
    dp = summary.get("data_path") or {}
    reads, bare, writes = dp.get("reads"), dp.get("bare_nixl_read"), dp.get("writes")
    detail = Table("datapath.job", "Main job data path: each transfer from post to done, and a bare NIXL READ "
                   "of the same sizes made beside them (interleaved) in the same run",
                   ["transfers", "count", "MiB", "p50 ms", "p99 ms", "GB/s in flight"])
    for label, stats, key in (("job READs (D reads P; P reads D's holds)", reads, "job_read"),
                              ("job WRITEs (push)", writes, "job_write"),
                              ("bare NIXL READ, same sizes (D rank 0's process, interleaved)", bare, "bare_read")):
        if stats:
            detail.add(label, stats["transfers"], stats["bytes"] / 2**20, stats["p50_ms"], stats["p99_ms"],
                       stats["gbps"], what=key, **stats)
    ok = "all checks passed" if summary.get("ok") else f"FAILED checks: {summary.get('check_reasons')}"
    detail.notes += [
        f"kvplane run (default workload, {summary['requests']['total']} requests), wall {summary['wall_s']} s; {ok}.",
        "GB/s in flight: bytes over the summed post-to-done times. The bare READ: two fresh agents in one process, "
        "the reader polling its READ in a tight loop while the source progresses UCX in the same loop; the job's "
        "READs cross processes, and each waits for its target's loop to progress (the rank's naps of 0.1 ms while "
        "it holds blocks a peer may read).",
    ]
    if dp.get("bare_read_error"):
        detail.notes.append(f"bare NIXL READ failed: {dp['bare_read_error']}")
    targets = Table("datapath.targets", "targets: main job data path", ["target", "measured", "goal", "met"])
    r = dp.get("read_gbps_vs_bare")
    if r is None:
        targets.add(TARGET, "not measured (no READs or no bare figure)", f">= {GOAL:.0%}", "NO", target=TARGET)
    else:
        targets.add(TARGET, f"{r:.0%} ({reads['gbps']:.2f} / {bare['gbps']:.2f} GB/s)", f">= {GOAL:.0%}",
                    "YES" if r >= GOAL else "NO", target=TARGET, ratio=r, job_gbps=reads["gbps"],
                    bare_gbps=bare["gbps"], met=r >= GOAL)
    return [detail, targets]


def run(quick: bool) -> list[Table]:
    with tempfile.TemporaryDirectory(prefix="kvplane-datapath-") as out:
        return tables(run_job(out, quick))
