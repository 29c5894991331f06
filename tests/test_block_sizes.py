"""Blocks of different sizes on the two sides (``transport.block_sizes``,
``descriptors.plan_slices``): every token of every row lands where the
other side's layout keeps it, byte for byte, for random shapes, token
ranges (a local prefix hit, a partly filled last block) and block lists;
the same over the loopback fabric and real NIXL (two agents in one
process, DRAM), both directions (READ and WRITE)."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.transport.block_sizes import (BlockMappingError, BlockShape, SlicePair, cpu_rows, pairs_for_read,
                                           slice_pairs)
from kvplane.transport.descriptors import plan_slices
from kvplane.transport.errors import IncompatibleLayout
from kvplane.transport.layout import CacheLayout
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

from transfer_support import complete



def cache(num_blocks: int, shape: BlockShape, seed: int | None) -> torch.Tensor:
    """[blocks, cells] bytes (a cell: one byte here): seeded nonzero, or zeros."""
    if seed is None:
        return torch.zeros(num_blocks, shape.cells, dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (num_blocks, shape.cells), dtype=torch.uint8, generator=g)


def layout(t: torch.Tensor, regions: int = 1) -> CacheLayout:
    return CacheLayout(mem_type="DRAM", device_id=0, block_size=t[0].numel() * t.element_size(),
                       num_blocks=t.shape[0], base_addrs=tuple(1 + i for i in range(regions)))


def copy_by_plan(dst: torch.Tensor, src: torch.Tensor, pairs) -> None:
    """Move bytes as an endpoint would: each span of the plan, src -> dst (one region)."""
    plan = plan_slices(layout(dst), layout(src), pairs)
    d, s = dst.view(-1), src.view(-1)
    for ls, rs in zip(plan.local, plan.remote):
        d[ls.offset:ls.offset + ls.length] = s[rs.offset:rs.offset + rs.length]


def slot(t: torch.Tensor, shape: BlockShape, block: int, row: int, token: int) -> torch.Tensor:
    """The cells of ``token``'s slot in ``row`` of ``block``."""
    before = sum(shape.widths[:row])
    at = before * shape.tokens + token * shape.widths[row]
    return t[block, at:at + shape.widths[row]]


def assert_tokens_moved(local: torch.Tensor, remote: torch.Tensor, lshape: BlockShape, rshape: BlockShape,
                        local_ids, remote_ids, first: int, n: int) -> None:
    """Every token in [first, n), every row: local slot == remote slot."""
    for t in range(first, n):
        lb, rb = local_ids[(t - first) // lshape.tokens], remote_ids[t // rshape.tokens]
        for row in range(len(lshape.widths)):
            assert torch.equal(slot(local, lshape, lb, row, t % lshape.tokens),
                               slot(remote, rshape, rb, row, t % rshape.tokens)), (t, row)


shapes = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([2, 4, 8]),
                   st.lists(st.integers(1, 4), min_size=1, max_size=5), st.booleans())


@pytest.mark.core
@settings(max_examples=150, deadline=None)
@given(shape=shapes, data=st.data())
@pytest.mark.core
def test_every_token_of_every_row_lands_where_the_other_layout_keeps_it(shape, data):
    ratio, small, widths, local_larger = shape
    lshape = BlockShape(small * ratio if local_larger else small, widths)
    rshape = BlockShape(small if local_larger else small * ratio, widths)
    n = data.draw(st.integers(1, 6 * max(lshape.tokens, rshape.tokens)), label="tokens")
    first = data.draw(st.integers(0, (n - 1) // lshape.tokens), label="local hit blocks") * lshape.tokens
    nr = -(-n // rshape.tokens)
    nl = -(-(n - first) // lshape.tokens)
    pool = 2 * max(nr, nl) + 1
    remote_ids = data.draw(st.permutations(range(pool)), label="remote ids")[:nr]
    local_ids = data.draw(st.permutations(range(pool)), label="local ids")[:nl]
    remote = cache(pool, rshape, seed=data.draw(st.integers(0, 1000), label="seed"))
    local = cache(pool, lshape, seed=None)
    pairs = slice_pairs(lshape, rshape, local_ids, remote_ids, first_token=first, num_tokens=n)
    copy_by_plan(local, remote, pairs)
    assert_tokens_moved(local, remote, lshape, rshape, local_ids, remote_ids, first, n)
    # Nothing but the named local blocks is written.
    untouched = sorted(set(range(pool)) - set(local_ids))
    assert not local[untouched].any()


@pytest.mark.core
def test_a_large_block_row_is_the_small_blocks_rows_back_to_back():
    # D's block of 4 tokens holds P's blocks of 2; a row of 1-cell slots and
    # a row of 2-cell slots (a K dimension, a V).  P block: cells K0 K1 | V0 V0 V1 V1
    # (6, parts of 2 cells: 3); D block: K0..K3 | V0..V3 (12 cells, 6 parts).
    pairs = slice_pairs(BlockShape(4, (1, 2)), BlockShape(2, (1, 2)), [7], [3, 5], first_token=0, num_tokens=4)
    assert pairs == (SlicePair(7, (0, 6), 3, (0, 3)), SlicePair(7, (2, 6), 3, (1, 3)), SlicePair(7, (3, 6), 3, (2, 3)),
                     SlicePair(7, (1, 6), 5, (0, 3)), SlicePair(7, (4, 6), 5, (1, 3)), SlicePair(7, (5, 6), 5, (2, 3)))
    # V's two parts are adjacent on both sides: one span; 4 per region.
    p = cache(8, BlockShape(2, (1, 2)), seed=1)
    d = cache(8, BlockShape(4, (1, 2)), seed=None)
    assert plan_slices(layout(d, 2), layout(p, 2), pairs).descriptors == 8


@pytest.mark.core
def test_equal_block_sizes_pair_whole_blocks_and_coalesce():
    pairs = slice_pairs(BlockShape(4, (1, 2)), BlockShape(4, (1, 2)), [3, 4], [0, 1, 2], first_token=4,
                        num_tokens=10)
    assert pairs == (SlicePair(3, (0, 1), 1, (0, 1)), SlicePair(4, (0, 1), 2, (0, 1)))
    p = cache(8, BlockShape(4, (1, 2)), seed=1)
    assert plan_slices(layout(p), layout(p), pairs).descriptors == 1


@pytest.mark.core
@pytest.mark.parametrize("local, remote, lids, rids, first, n, words", [
    (BlockShape(6, (1,)), BlockShape(4, (1,)), [0], [0, 1], 0, 6, "neither is a multiple"),
    (BlockShape(4, (1, 1)), BlockShape(2, (1,)), [0], [0, 1], 0, 4, "rows per block differ"),
    (BlockShape(4, (1,)), BlockShape(2, (1,)), [0], [0, 1], 2, 4, "not the start of a local block"),
    (BlockShape(4, (1,)), BlockShape(2, (1,)), [0], [0], 0, 4, "1 remote blocks of 2 tokens for 4"),
    (BlockShape(4, (1,)), BlockShape(2, (1,)), [0, 1], [0, 1], 0, 4, "2 local blocks of 4 tokens"),
    (BlockShape(4, (1,)), BlockShape(2, (1,)), [], [0, 1], 4, 4, "no tokens to move"),
])
def test_shapes_and_lists_that_do_not_pair_are_refused(local, remote, lids, rids, first, n, words):
    with pytest.raises(BlockMappingError, match=words):
        slice_pairs(local, remote, lids, rids, first_token=first, num_tokens=n)


@pytest.mark.core
def test_a_plan_refuses_unequal_slices_and_ids_out_of_range():
    p = cache(4, BlockShape(2, (1,)), seed=1)
    d = cache(4, BlockShape(4, (1,)), seed=None)
    with pytest.raises(IncompatibleLayout, match="slice size mismatch"):
        plan_slices(layout(d), layout(p), [SlicePair(0, (0, 1), 0, (0, 1))])
    with pytest.raises(IndexError, match="remote block id 9"):
        plan_slices(layout(d), layout(p), [SlicePair(0, (0, 2), 9, (0, 1))])
    with pytest.raises(ValueError, match="at least one slice"):
        plan_slices(layout(d), layout(p), [])


# ------------------------------------------------------------------ over endpoints

_names = itertools.count()


@pytest.fixture(params=[pytest.param("loopback", marks=pytest.mark.core), "nixl"])
def endpoints(request):
    made = []
    fabric = LoopbackFabric()

    def make(role: str, t: torch.Tensor):
        if request.param == "nixl":
            nixl = pytest.importorskip("kvplane.transport.nixl_agent")
            ep = nixl.NixlEndpoint(f"{role}{next(_names)}")
        else:
            ep = LoopbackEndpoint(fabric, f"{role}{next(_names)}")
        ep.register_kv_cache(t, t[0].numel() * t.element_size())
        for other in made:
            assert other.add_remote(ep.local_metadata()) == ep.name
            assert ep.add_remote(other.local_metadata()) == other.name
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()


def test_d_reads_p_s_smaller_blocks_into_its_larger_ones(endpoints):
    # P: blocks of 32 tokens; D: 64 (NixlConnector's direction), vLLM's CPU
    # rows of 2 KV heads of size 4; 150 tokens, D has its first block (64) cached.
    p_shape, d_shape = BlockShape(32, cpu_rows(2, 4)), BlockShape(64, cpu_rows(2, 4))
    p_cache = cache(16, p_shape, seed=7)
    d_cache = cache(16, d_shape, seed=None)
    p, d = endpoints("P", p_cache), endpoints("D", d_cache)
    p_ids, d_ids = [9, 2, 14, 5, 11], [6, 3]
    pairs = slice_pairs(d_shape, p_shape, d_ids, p_ids, first_token=64, num_tokens=150)
    h = d.post_read_slices(p.name, p.describe_cache(), pairs, b"r:1")
    assert h.num_blocks == 2 and h.nbytes == 3 * p_shape.cells  # tokens 64..160 (P's last block whole)
    complete(d, h, p, b"r:1")
    d.release(h)
    assert_tokens_moved(d_cache, p_cache, d_shape, p_shape, d_ids, p_ids, 64, 150)
    assert not d_cache[[i for i in range(16) if i not in d_ids]].any()


def test_p_writes_its_larger_blocks_into_d_s_smaller_ones(endpoints):
    # Push: P's blocks of 64 tokens into D's of 32.
    p_shape, d_shape = BlockShape(64, cpu_rows(2, 4)), BlockShape(32, cpu_rows(2, 4))
    p_cache = cache(8, p_shape, seed=8)
    d_cache = cache(8, d_shape, seed=None)
    p, d = endpoints("P", p_cache), endpoints("D", d_cache)
    pairs = slice_pairs(p_shape, d_shape, [4, 1], [0, 7, 2, 5], first_token=0, num_tokens=100)
    h = p.post_write_slices(d.name, d.describe_cache(), pairs, b"w:1")
    complete(p, h, d, b"w:1")
    p.release(h)
    assert_tokens_moved(p_cache, d_cache, p_shape, d_shape, [4, 1], [0, 7, 2, 5], 0, 100)


@pytest.mark.core
def test_a_read_derives_the_remote_block_tokens_and_d_s_prefix_hit_from_the_lists():
    d_shape = BlockShape(64, cpu_rows(2, 4))
    p_bytes = BlockShape(32, cpu_rows(2, 4)).cells
    got = pairs_for_read(d_shape, d_shape.cells, 32, p_bytes, [6, 3], [9, 2, 14, 5, 11])
    assert got == slice_pairs(d_shape, BlockShape(32, cpu_rows(2, 4)), [6, 3], [9, 2, 14, 5, 11],
                              first_token=64, num_tokens=160)
    with pytest.raises(BlockMappingError, match="larger than the local"):
        pairs_for_read(BlockShape(32, cpu_rows(2, 4)), p_bytes, 64, d_shape.cells, [1, 2], [3])
    # A P rank with half the heads in blocks of twice the tokens: as many bytes, another layout.
    with pytest.raises(BlockMappingError, match="not laid out as a local one"):
        pairs_for_read(d_shape, d_shape.cells, 128, d_shape.cells, [6], [9])
