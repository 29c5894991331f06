"""Push mode in a real vLLM (docs/parity.md, "Push"): ``kvplane run --engine
vllm --push`` starts P and D with ``KVPlanePushConnector``; every D
registers its blocks with P and P WRITEs its leased blocks into them.  One
small run (two engines started once), checked by the job's own checks:
every request completed, the KV in D's blocks right byte for byte, moved by
P's WRITEs only, nothing held on either side, both event logs replay.

Needs vLLM: ``scripts/install-vllm`` (skipped with that reason without it)."""
from __future__ import annotations

import importlib.util

import pytest

from test_vllm_engine import run_job

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: run scripts/install-vllm to include these tests")


def test_push_p_writes_every_request_s_kv_into_d_s_registered_blocks(tmp_path):
    proc, s = run_job(tmp_path, "--push", "--requests", "16")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert s["options"]["push"] and s["completed"] == s["requests"] == 16, s["failed"]
    kv = s["kv_check"]
    assert kv["ok"] == kv["checked"] == 16 and kv["tokens_compared"] > 0 and not kv["bad"], kv
    # Every block that moved was WRITTEN by P (D READ nothing), and none was declined or failed.
    assert s["push"]["p_writes"] > 0 and s["push"]["d_reads"] == 0 and s["push"]["d_failed_recvs"] == 0, s["push"]
    assert s["bytes_moved"] > 0 and s["leases_consumed"] >= s["push"]["p_writes"]
    assert s["usage_end"] == {"P": 0.0, "D": 0.0}
    assert s["connector_blocks_held"] == {"prefill": 0, "decode": 0}
    assert all(r["ok"] and r["held"] == 0 for r in s["replay"].values()), s["replay"]
    assert "ok   push_moved_the_kv" in proc.stdout
