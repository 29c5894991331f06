"""kvplane as a real vLLM connector: ``kvplane run --engine vllm`` with two
vLLM engines (P and D) loading ``kvplane.connector.vllm.KVPlaneConnector``,
the disaggregated proxy protocol, real NIXL between them.  Each run starts
two engines (1-3 minutes here) and checks its own summary: every request
completed, the KV D read is byte for byte P's and D's own recompute, P and
D end holding no block, both event logs replay.

Needs vLLM: ``scripts/install-vllm`` (skipped with that reason without it;
CI installs it)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: run scripts/install-vllm to include these tests")

RUN_TIMEOUT_S = 1200


def run_job(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "kvplane.app.cli", "run", "--engine", "vllm", "--out", str(out),
                           "--quiet", *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    summary_path = out / "summary.json"
    assert summary_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(summary_path.read_text())


def test_a_normal_run_moves_the_right_kv_and_ends_holding_nothing(tmp_path):
    proc, s = run_job(tmp_path, "--requests", "16")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert s["completed"] == s["requests"] == 16
    assert s["kv_check"]["ok"] == 16 and s["kv_check"]["tokens_compared"] > 0 and not s["kv_check"]["bad"]
    assert s["bytes_moved"] > 0 and s["declined_reads"] == 0
    assert s["connector_blocks_held"] == {"prefill": 0, "decode": 0}
    assert s["usage_end"] == {"P": 0.0, "D": 0.0}
    assert all(r["ok"] for r in s["replay"].values()), s["replay"]
    assert "blocks still held P / D 0 / 0" in proc.stdout
    # The connector's stats reached vLLM's Prometheus endpoint.
    assert s["metrics"]["D"].get("vllm:kvplane_bytes_transferred_total", 0) > 0, s["metrics"]["D"]


def test_a_late_forward_is_declined_and_recomputed_never_read(tmp_path):
    proc, s = run_job(tmp_path, "--requests", "12", "--late-forward", "40")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert s["late"] == 3 and s["completed"] == 12
    assert s["declined_reads"] >= 3 and s["kv_check"]["declined"] >= 3
    assert s["kv_check"]["ok"] == 12 and s["leases_expired"] >= 3
    assert s["connector_blocks_held"] == {"prefill": 0, "decode": 0}
    assert "blocks still held P / D 0 / 0" in proc.stdout
