"""Smoke test for the benchmark runner: it runs and prints the ratio table.

No timing is asserted: benchmarks report ratios, they never pass or fail on speed.
"""
import json
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
    # The section's target rows come once, in the final Targets table (and the JSON).
    assert proc.stdout.rstrip().splitlines()[-1].strip().endswith("targets met.")
    data = json.loads(out_json.read_text())
    keys = [t["key"] for t in data["tables"]]
    assert "dispatch.events" in keys and keys[-1] == "targets" and "dispatch.targets" not in keys
    speedup = data["tables"][keys.index("dispatch.speedup")]
    assert "kvplane / (b) dict + heap" in speedup["columns"] and "(a) transitions per request" in speedup["columns"]
    targets = data["tables"][-1]
    assert targets["columns"] == ["target", "measured", "goal", "met"]
    assert any(r[0].startswith("D (decode request): the plane's CPU per request") for r in targets["rows"])
    assert all(r[3] in ("YES", "NO") for r in targets["rows"])


def test_compare_checkouts_prints_both_sides_and_the_ratio():
    # Against itself: both columns come from real runs; only the shape is checked.
    proc = subprocess.run([sys.executable, "-m", "bench.compare_checkouts", str(ROOT), "--rounds", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("lease", "decode"))]
    assert len(rows) == 6 and all(line.rstrip().endswith("x") for line in rows), proc.stdout


def test_compare_checkouts_refuses_a_folder_that_is_not_a_checkout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.compare_checkouts", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a kvplane checkout" in proc.stderr
