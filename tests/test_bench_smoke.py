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


def test_compare_checkouts_prints_both_sides_and_the_ratio():
    # Against itself: both columns come from real runs; only the shape is checked.
    proc = subprocess.run([sys.executable, "-m", "bench.compare_checkouts", str(ROOT), "--rounds", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("lease", "decode"))]
    assert len(rows) == 4 and all(line.rstrip().endswith("x") for line in rows), proc.stdout


def test_compare_checkouts_refuses_a_folder_that_is_not_a_checkout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.compare_checkouts", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a kvplane checkout" in proc.stderr
