"""Pipeline parallel on the prefill side in a real vLLM (docs/parity.md
"Pipeline parallel"): ``kvplane run --engine vllm --prefill-pp 2``, P's two
stages each a worker holding one of the tiny model's 2 layers, D (PP 1)
reading each layer from the stage that holds it; the job's own checks
(every request completed, each layer's KV right byte for byte, nothing
held, every rank's event log replays).

Needs vLLM: ``scripts/install-vllm`` (skipped with that reason without it)."""
from __future__ import annotations

import importlib.util

import pytest

from test_vllm_parity import STARVED_MS, assert_clean, run_job

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: run scripts/install-vllm to include these tests")


def test_prefill_pp_2_d_reads_each_layer_from_the_stage_that_holds_it(tmp_path):
    # Three worker processes on two cores: a lease long enough that none expires waiting.
    proc, s = run_job(tmp_path, "--prefill-pp", "2", "--requests", "4", "--lease", "120")
    assert_clean(proc, s, 4)
    assert set(s["replay"]) == {"prefill.rank0", "prefill.rank1", "decode"}  # one log per stage
    kv = s["kv_check"]
    if kv["declined"] or s["declined_reads"] or s["failed_recvs"]:
        # Recomputed, never wrong (assert_clean); only a starved worker explains a lost read (as the TP tests).
        assert max(s["longest_rank_stall_ms"].values()) >= STARVED_MS, (kv, s["longest_rank_stall_ms"])
    else:
        assert kv["tokens_compared"] > 0 and s["leases_expired"] == 0  # every stage's lease ended by D's reads
