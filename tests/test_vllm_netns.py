"""``kvplane run --engine vllm --hosts netns``: P's and D's vLLM engines each
in a network namespace of its own on a bridge, UCX over TCP and the side
channel on their veths, the proxy (this job's process) in the root
namespace reaching both through a veth of its own; the right KV moves,
nothing is held at the end, both event logs replay, and no namespace or
veth is left.

Needs vLLM (``scripts/install-vllm``; skipped with that reason without it)
and root (CI runs as root): where namespaces cannot be made the run exits 2
and the test fails, it does not skip."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvplane.app.job import netns

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: run scripts/install-vllm to include these tests")

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}


def test_vllm_engines_in_namespaces_move_the_right_kv(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "kvplane.app.cli", "run", "--engine", "vllm", "--hosts", "netns", "--out", str(out),
           "--requests", "4", "--quiet"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-4000:]}\n{stderr[-4000:]}"
    s = json.loads((out / "summary.json").read_text())
    hosts = s["hosts"]
    assert hosts["kind"] == "netns" and hosts["P"]["netns"] != hosts["D"]["netns"]
    assert hosts["P"]["address"] != hosts["D"]["address"] and not hosts["P"]["address"].startswith("127.")
    assert s["completed"] == s["requests"] == 4
    # The engines could reach each other only over their veths: every byte D read crossed them.
    assert s["kv_check"]["ok"] == 4 and s["kv_check"]["tokens_compared"] > 0 and not s["kv_check"]["bad"]
    assert s["bytes_moved"] > 0
    assert s["connector_blocks_held"] == {"prefill": 0, "decode": 0} and s["usage_end"] == {"P": 0.0, "D": 0.0}
    assert all(r["ok"] for r in s["replay"].values()), s["replay"]
    assert "blocks still held P / D 0 / 0" in stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"{netns.PREFIX}{proc.pid}-" not in names, names
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert f"kvp{proc.pid % 10**7}" not in links, links


def test_two_prefill_engines_through_a_partition(tmp_path):
    """Two prefill vLLM engines and one decode engine, each in its own
    namespace; requests alternate over P and P1 (D reads each from the P its
    params name); every P's link goes down for 12 s at the first prefill
    answered 3 s or more into the stream (before D got its params: a lease is
    live across the cut), while requests keep coming: the leases whose
    completion or heartbeats the cut lost are freed within the lease term (12 s
    here) from the cut, the
    requests sent meanwhile are answered after the heal, nothing is held and
    every event log replays."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "kvplane.app.cli", "run", "--engine", "vllm", "--hosts", "netns", "--out", str(out),
           "--prefill-engines", "2", "--requests", "12", "--lease", "12", "--partition-at", "3",
           "--partition-for", "12"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=1200)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-4000:]}\n{stderr[-4000:]}"
    s = json.loads((out / "summary.json").read_text())
    hosts = s["hosts"]
    assert len({hosts[r]["netns"] for r in ("P", "P1", "D")}) == 3
    assert s["completed"] == s["requests"] == 12
    engines = {e["name"]: e for e in s["prefill_engines"]}
    assert {n: e["requests"] for n, e in engines.items()} == {"P": 6, "P1": 6}
    assert all(e["blocks_held"] == 0 for e in engines.values()), engines
    assert s["kv_check"]["ok"] == s["kv_check"]["checked"] == 12 and not s["kv_check"]["bad"]
    part = s["partition"]
    assert part["healed_at_s"] - part["at_s"] >= 12 - 0.5, part
    assert part["leases_expired"] > 0, part  # the cut stranded leases, and P freed them
    assert part["within_bound"] and part["reclaim_s"] <= part["lease_s"] + part["slack_s"], part
    # Requests kept coming through the cut: those sent to a P while it was cut were answered after the heal.
    assert part["requests_sent_while_cut"] >= 1 and part["answered_after_heal"] == part["requests_sent_while_cut"], part
    assert s["connector_blocks_held"] == {"prefill": 0, "decode": 0}
    assert set(s["replay"]) == {"prefill", "prefill1", "decode"} and all(r["ok"] for r in s["replay"].values())
    assert "blocks still held P / D 0 / 0" in stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"{netns.PREFIX}{proc.pid}-" not in names, names
