"""Smoke test for the benchmark runner: it runs and prints the ratio table.

No timing is asserted: benchmarks report ratios, they never pass or fail on speed.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_quick_dispatch_prints_ratio_table(tmp_path):
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "dispatch", "--json", str(out_json)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Event dispatch" in proc.stdout
    assert "kvplane / (b)" in proc.stdout and "(a) / kvplane" in proc.stdout
    assert '"dispatch.events"' in out_json.read_text()
