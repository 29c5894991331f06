"""A hybrid model's KV cache groups without vLLM: NixlConnector's clipping,
the flat interleaved list whose tail pairing pairs each group with itself,
per-group params signed per group, and the refusals (group count, coverage,
block ids, tampering) on D's scheduler half."""
from __future__ import annotations

import importlib.util
import random

import pytest

from kvplane.connector.kv_groups import KvGroups, interleave, local_for, paired, without_null
from kvplane.connector.param_auth import _normal
from kvplane.connector.params import BadTransferParams
from kvplane.connector.records import RankInfo
from kvplane.connector.vllm_params import from_vllm
from kvplane.connector.vllm_scheduler import VllmSchedulerSide
from kvplane.connector.vllm_settings import settings_from
from vllm_support import Req

# The two tests that build vLLM's KV cache specs or the job's tokenizer need vLLM (its extra brings
# `tokenizers`); the rest of this file is core and runs without it.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: run scripts/install-vllm to include this test")

TOKENS = 40  # 3 blocks of 16
BLOCK = 16
HYBRID = KvGroups.from_windows([16, None], BLOCK)  # sliding window of one block, full attention
# P's blocks when the request finished: the sliding group's first block cleaned up (the null block).
P_GROUPS = ((0, 5, 6), (7, 8, 9))


def test_windows_clip_as_nixl_connector():
    assert HYBRID.window_blocks == (2, 0)  # cdiv(16, 16) + 1, as blocks_per_sw
    assert KvGroups.from_windows([64, None], 128).window_blocks == (2, 0)
    assert HYBRID.clip(P_GROUPS) == ((5, 6), (7, 8, 9))
    assert HYBRID.expected(TOKENS, BLOCK) == (2, 3) and HYBRID.expected(10, BLOCK) == (1, 1)
    with pytest.raises(ValueError):
        HYBRID.clip(((1,),))


def test_interleave_orders_by_position_then_group():
    assert interleave(((5, 6), (7, 8, 9))) == (7, 5, 8, 6, 9)
    assert interleave(((4,),)) == (4,)


def test_tail_pairing_of_the_flat_lists_pairs_each_group_with_itself():
    """On random shapes (sliding windows, prefix hits of any length): the
    driver's rule (pair the flat lists from the end) gives exactly vLLM's
    per-group tail pairs."""
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(1, 12)
        hit = rng.randint(0, n - 1)
        groups = KvGroups(tuple(rng.choice((0, 1, 2, 3)) for _ in range(rng.randint(2, 4))))
        ids = iter(range(1, 10_000))
        remote = groups.clip([[next(ids) for _ in range(n)] for _ in groups.window_blocks])
        local = groups.clip([[next(ids) for _ in range(n - hit)] for _ in groups.window_blocks])
        flat = local_for(remote, local)
        assert flat is not None
        flat_remote = interleave(remote)
        got = set(zip(flat_remote[len(flat_remote) - len(flat):], flat))
        want = {pair for r, loc in zip(*paired(remote, local)) for pair in zip(r, loc)}
        assert got == want


def test_lists_that_are_no_tails_of_one_sequence_have_no_flat_pairing():
    assert local_for(((5,), (7, 8)), ((21, 22), (31,))) == (22, 31)
    # D lacking only the full group's last block while it lacks every sliding block: the
    # remote full group's unpaired block sits between paired ones in the flat order.
    assert local_for(((5, 6), (7, 8)), ((21, 22), (32,))) is None
    assert local_for(((5,), (7,)), ((21,),)) is None


@pytest.mark.parametrize("blocks, why", [
    ([[5, 6], [7, 8]], "group 1: 2 blocks"),
    ([[5, 6, 4], [7, 8, 9]], "group 0: 3 blocks"),
    ([[5, 6], [7, 8, 9], []], "not 2 block lists"),
    ([5, 6, 7], "not 2 block lists"),
    ([[5, 7], [7, 8, 9]], "block 7 twice"),
    ([[5, 6], [0, 8, 9]], "null block in a full-attention group"),
    ([[5, "6"], [7, 8, 9]], "not an int"),
])
def test_cover_problems(blocks, why):
    assert why in HYBRID.cover_problem(blocks, TOKENS, BLOCK)


def test_cover_accepts_the_null_block_in_a_sliding_group():
    assert HYBRID.cover_problem([[0, 6], [7, 8, 9]], TOKENS, BLOCK) is None
    assert HYBRID.cover_problem([[5, 6], [7, 8, 9]], TOKENS, BLOCK) is None


def test_params_keep_one_list_per_group_and_sign_them_so():
    assert from_vllm({"remote_block_ids": [[5, 6], [7, 8, 9]]}, groups=2)["remote_block_ids"] == [[5, 6], [7, 8, 9]]
    with pytest.raises(BadTransferParams, match="2 KV cache groups"):
        from_vllm({"remote_block_ids": [[4, 5, 6]]}, groups=2)
    with pytest.raises(BadTransferParams, match="has one"):
        from_vllm({"remote_block_ids": [[4, 5], [6]]}, groups=1)
    # One group: the flat encoding signed before hybrid models, unchanged.
    assert _normal({"remote_block_ids": [[4, 5, 6]]})["remote_block_ids"] == [4, 5, 6]
    assert _normal({"remote_block_ids": [[5, 6], [7]]})["remote_block_ids"] == [[5, 6], [7]]


# ---------------------------------------------------------------- the scheduler halves
def side(name: str, tmp_path, groups: KvGroups = HYBRID, secret: bool = True) -> VllmSchedulerSide:
    cfg: dict = {"kvplane_insecure": True}
    if secret:
        path = tmp_path / f"{name}.secret"
        path.write_text("a" * 64)
        cfg = {"kvplane_secret_file": str(path)}
    s = VllmSchedulerSide(name, settings_from(cfg, environ={}), block_size=BLOCK, groups=groups)
    s.add_ranks({0: RankInfo(rank=0, engine_id=f"{name}/tp0", side_channel_port=5700, public_key=None)})
    return s


def grant(p: VllmSchedulerSide, groups=P_GROUPS) -> dict:
    x = Req("x", {"do_remote_decode": True}, num_prompt_tokens=TOKENS, num_computed_tokens=TOKENS)
    p.on_new_request(x)
    delay, params = p.request_finished_groups(x, groups)
    assert delay and params is not None
    return params


def load(d: VllmSchedulerSide, params: dict, local: tuple, rid: str = "a", p_groups=P_GROUPS) -> tuple | None:
    """The flat blocks D's plane reads into, or None if D refused the params."""
    a = Req(rid, params, num_prompt_tokens=TOKENS, num_computed_tokens=0)
    d.on_new_request(a)
    n, is_async = d.get_num_new_matched_tokens(a, 0)
    if (n, is_async) != (TOKENS, True):
        return None
    news = d.build_step([]).meta.new_requests
    assert [r.remote.remote_block_ids for r in news] == [interleave(without_null(HYBRID.clip(p_groups)))]
    d.update_state_after_alloc_groups(a, local, TOKENS)
    (one,) = d.build_step([]).meta.loads
    return one.block_ids


@pytest.mark.parametrize("secret", [True, False])
def test_p_leases_the_clipped_groups_and_d_pairs_them(tmp_path, secret):
    p, d = side("prefill-0", tmp_path, secret=secret), side("decode-0", tmp_path, secret=secret)
    params = grant(p)
    assert params["remote_block_ids"] == [[5, 6], [7, 8, 9]] and params["remote_num_tokens"] == TOKENS
    (lease,) = p.build_step([]).meta.grants
    assert lease.block_ids == (7, 5, 8, 6, 9)
    # D allocated every position of both groups; the sliding group is clipped alike.
    assert load(d, params, ((20, 21, 22), (30, 31, 32))) == (30, 21, 31, 22, 32)
    assert d.counters["kvplane_refused_params"] == 0


def test_a_cleaned_up_block_in_the_clip_is_named_but_not_moved(tmp_path):
    # P's vLLM already freed the sliding block before the window (the null block, in the clip);
    # D's vLLM allocates the sliding group from the window on: one block, paired with P's last.
    p, d = side("prefill-0", tmp_path), side("decode-0", tmp_path)
    groups = ((0, 0, 6), (7, 8, 9))
    params = grant(p, groups)
    assert params["remote_block_ids"] == [[0, 6], [7, 8, 9]]  # NixlConnector's clip, signed as is
    (lease,) = p.build_step([]).meta.grants
    assert lease.block_ids == (7, 8, 6, 9)  # the null block is no lease's
    assert load(d, params, ((22,), (30, 31, 32)), p_groups=groups) == (30, 31, 22, 32)


def test_d_with_a_prefix_hit_reads_each_groups_tail(tmp_path):
    p, d = side("prefill-0", tmp_path), side("decode-0", tmp_path)
    assert load(d, grant(p), ((21, 22), (31, 32))) == (21, 31, 22, 32)  # pairs (8, 31) (6, 22) ... by the tail


@pytest.mark.parametrize("change", [
    lambda b: [[5], [6, 7, 8, 9]],  # a block moved between groups: not what P signed
    lambda b: [b[1], b[0]],  # groups swapped
    lambda b: [[5, 6], [7, 8, 9], []],  # a group more
    lambda b: [[5, 6], [7, 8, 10]],  # another block
])
def test_tampered_group_lists_are_refused(tmp_path, change):
    p, d = side("prefill-0", tmp_path), side("decode-0", tmp_path)
    params = grant(p)
    assert load(d, dict(params, remote_block_ids=change(params["remote_block_ids"])), ((1,), (2,))) is None
    assert d.counters["kvplane_refused_params"] == 1


@pytest.mark.parametrize("blocks", [
    [[5, 6, 4], [7, 8, 9]],  # the sliding group not clipped: does not cover its window's blocks
    [[5, 6], [7, 8]],  # the full group short of the tokens
    [[5, 6], [7, 8, -1]],  # a block id out of range
    [[5, 6], [7, 8, 1 << 40]],
    [[5, 6]],  # a group count unlike this engine's
])
def test_unauthenticated_group_lists_must_cover_the_tokens(tmp_path, blocks):
    p, d = side("prefill-0", tmp_path, secret=False), side("decode-0", tmp_path, secret=False)
    params = dict(grant(p), remote_block_ids=blocks)
    assert load(d, params, ((20, 21, 22), (30, 31, 32))) is None
    assert d.counters["kvplane_refused_params"] == 1


def test_group_counts_of_p_and_d_must_match(tmp_path):
    p = side("prefill-0", tmp_path)
    one = side("decode-0", tmp_path, groups=KvGroups())
    assert load(one, grant(p), ((20, 21, 22),)) is None
    assert one.counters["refused_params"] == 0 and one.counters["kvplane_refused_params"] == 1


# ---------------------------------------------------------------- what the connector moves
def _config(*specs, transfer=None):
    from types import SimpleNamespace

    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}"]) for i, s in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups,
                           transfer_group_ids=tuple(range(len(specs))) if transfer is None else transfer)


def _specs():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(128, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(128, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64)
    mamba = MambaSpec(128, shapes=((4, 4),), dtypes=(torch.bfloat16,))
    return full, sliding, mamba


@needs_vllm
def test_the_connector_moves_full_and_sliding_groups_and_refuses_the_rest_in_one_line():
    from kvplane.connector.vllm import _kv_groups

    full, sliding, mamba = _specs()
    assert _kv_groups(_config(full), 2, "push", True) == KvGroups()  # one group: as before
    assert _kv_groups(_config(sliding, full), 1, "pull", False).window_blocks == (2, 0)
    for config, tp, mode, bidir, words in [
        (_config(sliding, full), 2, "pull", False, "tensor parallel size 1"),
        (_config(sliding, full), 1, "push", False, "pull mode"),
        (_config(sliding, full), 1, "pull", True, "bidirectional"),
        (_config(mamba, full), 1, "pull", False, "MambaSpec"),
        (_config(sliding, full, transfer=(1,)), 1, "pull", False, r"transfers \(1,\)"),
    ]:
        with pytest.raises(ValueError, match=words) as info:
            _kv_groups(config, tp, mode, bidir)
        assert "\n" not in str(info.value)


# ---------------------------------------------------------------- --model
@needs_vllm
def test_model_option_writes_the_hybrid_model_and_refuses_what_it_does_not_run(tmp_path, capsys):
    import json

    from kvplane.app.cli import build_parser, main
    from kvplane.app.vllm.model import write_tiny_model
    from kvplane.app.vllm.run import options_from_args

    config = json.loads((write_tiny_model(tmp_path / "m", "hybrid") / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2 and config["sliding_window"] == 64
    assert "layer_types" not in json.loads((write_tiny_model(tmp_path / "t") / "config.json").read_text())

    def opts(*argv: str):
        return options_from_args(build_parser().parse_args(["run", "--engine", "vllm", *argv]))

    assert opts().model == "tiny" and opts("--model", "hybrid").model == "hybrid"
    for argv in (("--prefill-tp", "2"), ("--decode-tp", "2"), ("--push",)):
        with pytest.raises(ValueError, match="--model hybrid runs with"):
            opts("--model", "hybrid", *argv)
    assert main(["run", "--model", "hybrid"]) == 2  # the sim engine has no model
    assert capsys.readouterr().err.strip() == "kvplane run: --model needs --engine vllm"
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", "--engine", "vllm", "--model", "huge"])
    assert info.value.code == 2


def test_groups_that_do_not_pair_read_nothing_counted(tmp_path):
    # D lacks the full group's last block only, but every sliding block: no flat list pairs these.
    p, d = side("prefill-0", tmp_path), side("decode-0", tmp_path)
    warned: list = []
    d.warn = lambda *a: warned.append(a)
    assert load(d, grant(p), ((21, 22), (32,))) == ()
    assert d.counters["kvplane_unpaired_groups"] == 1 and warned
    assert d.stats() == {"kvplane_unpaired_groups": 1}
