"""The vLLM job's KV check (app/vllm/kv_check) on hand-made dumps: what it
accepts as the right KV of a request, and what it catches."""
from __future__ import annotations

import torch

from kvplane.app.vllm.kv_check import check_all

BLOCK = 4


def _save(path, kv, **meta):
    torch.save({"kv": kv, "block_tokens": BLOCK, "when": "finish", "first_read_token": 0, **meta}, path)


def _unlike_tp_failed_read(tmp_path, kept_from):
    """P TP 2, D TP 1 (engines of different TP run different dummy models):
    D's read of ``r`` failed and D kept blocks ``kept_from`` gives, for a
    9-token prompt (2 whole blocks checked)."""
    p_kv = torch.arange(2 * 2 * 12 * 3, dtype=torch.float32).reshape(2, 2, 12, 3)  # [layers, heads, tokens, width]
    d_model = -p_kv  # D's own recompute: another model's bytes
    for rank in range(2):  # each P rank dumps its head
        _save(tmp_path / f"r.p.rank{rank}.pt", p_kv[:, rank:rank + 1].clone(), num_tokens=9, read_ok=None)
    _save(tmp_path / "r.local.rank0.pt", d_model.clone(), num_tokens=9, read_ok=None)
    _save(tmp_path / "r.rank0.pt", kept_from(p_kv, d_model), num_tokens=9, read_ok=False)
    (v,) = check_all(tmp_path, ["r"], prefill_tp=2, decode_tp=1)
    return v


def test_unlike_tp_failed_read_accepts_p_s_blocks_found_in_d_s_prefix_cache(tmp_path):
    # Block 0 came from D's prefix cache (an earlier request read it from P), block 1 D computed.
    v = _unlike_tp_failed_read(tmp_path, lambda p, d: torch.cat([p[:, :, :BLOCK], d[:, :, BLOCK:]], dim=2))
    assert v.ok and v.declined, v


def test_unlike_tp_failed_read_still_catches_a_block_that_is_neither_p_s_nor_d_s(tmp_path):
    def kept(p, d):
        out = torch.cat([p[:, :, :BLOCK], d[:, :, BLOCK:]], dim=2).clone()
        out[1, 0, BLOCK + 1, 2] += 0.5  # one wrong value in the block D computed
        return out

    v = _unlike_tp_failed_read(tmp_path, kept)
    assert not v.ok and "1 of 2 blocks differ from D's recompute" in v.why, v


def test_like_tp_failed_read_accepts_only_d_s_recompute(tmp_path):
    # Same TP: one model, so a kept block must be D's recompute (= P's bytes too).
    p_kv = torch.arange(2 * 1 * 12 * 3, dtype=torch.float32).reshape(2, 1, 12, 3)
    _save(tmp_path / "r.p.rank0.pt", p_kv.clone(), num_tokens=9, read_ok=None)
    _save(tmp_path / "r.local.rank0.pt", p_kv.clone(), num_tokens=9, read_ok=None)
    wrong = p_kv.clone()
    wrong[0, 0, 0, 0] += 1
    _save(tmp_path / "r.rank0.pt", wrong, num_tokens=9, read_ok=False)
    (v,) = check_all(tmp_path, ["r"])
    assert not v.ok and "1 of 2 blocks differ from D's recompute" in v.why, v
