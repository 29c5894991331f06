"""Descriptor coalescing: a run of blocks consecutive on both sides is one
descriptor per region, over real NIXL (two agents in one process, DRAM) and
over the loopback fabric, which copies by the same plan.

Every transfer is checked byte for byte against a block-by-block reference
copy, and its descriptor count against the runs it contains.
"""

import itertools

import pytest
import torch

from kvplane.transport.descriptors import Span, block_runs, plan_transfer
from kvplane.transport.layout import CacheLayout
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

from transfer_support import complete

NB, BS = 16, 2048
_names = itertools.count()


def pattern(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, shape, dtype=torch.uint8, generator=g)


class Pair:
    """A source P and a reader D of one kind, ``regions`` caches each."""

    def __init__(self, kind, *, regions=1, d_block=BS):
        n = next(_names)
        if kind == "nixl":
            from kvplane.transport.nixl_agent import NixlEndpoint

            self.p, self.d = NixlEndpoint(f"Pc{n}"), NixlEndpoint(f"Dc{n}")
        else:
            fabric = LoopbackFabric()
            self.p, self.d = LoopbackEndpoint(fabric, f"Pc{n}"), LoopbackEndpoint(fabric, f"Dc{n}")
        self.p_caches = [pattern((NB, BS), 100 * n + r) for r in range(regions)]
        self.d_caches = [pattern((NB, d_block), 100 * n + 50 + r) for r in range(regions)]
        for t in self.p_caches:
            self.p.register_kv_cache(t, BS)
        for t in self.d_caches:
            self.d.register_kv_cache(t, d_block)
        self.d.add_remote(self.p.local_metadata())
        self.p.add_remote(self.d.local_metadata())

    def close(self):
        self.d.close()
        self.p.close()


@pytest.fixture(params=[pytest.param("loopback", marks=pytest.mark.core), "nixl"])
def kind(request):
    if request.param == "nixl":
        pytest.importorskip("kvplane.transport.nixl_agent")
    return request.param


@pytest.fixture
def pairs(kind):
    made = []

    def make(**kw):
        made.append(Pair(kind, **kw))
        return made[-1]

    yield make
    for pair in made:
        pair.close()


def part_slice(part, block_bytes):
    index, of = part
    size = block_bytes // of
    return slice(index * size, (index + 1) * size)


def read_and_check(pair, remote_ids, local_ids, remote_part=(0, 1), local_part=(0, 1)):
    """READ, then compare every region with a block-by-block reference copy;
    returns the handle's descriptor count."""
    expected = [t.clone() for t in pair.d_caches]
    rs, ls = part_slice(remote_part, BS), part_slice(local_part, pair.d_caches[0].shape[1])
    for src, dst in zip(pair.p_caches, expected):
        for r, loc in zip(remote_ids, local_ids):
            dst[loc, ls] = src[r, rs]
    h = pair.d.post_read(pair.p.name, pair.p.describe_cache(), remote_ids, local_ids, b"c",
                         remote_part=remote_part, local_part=local_part)
    complete(pair.d, h, pair.p, b"c")
    pair.d.release(h)
    for got, want in zip(pair.d_caches, expected):
        assert torch.equal(got, want)
    return h.descriptors


def test_contiguous_blocks_are_one_descriptor(pairs):
    pair = pairs()
    assert read_and_check(pair, [0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]) == 1


def test_non_contiguous_blocks_are_one_descriptor_each(pairs):
    pair = pairs()
    assert read_and_check(pair, [0, 2, 4, 6], [1, 3, 5, 7]) == 4
    # Consecutive on one side only, or descending: no run.
    assert read_and_check(pair, [9, 7, 5], [0, 1, 2]) == 3
    assert read_and_check(pair, [3, 2, 1], [3, 2, 1]) == 3


def test_mixed_runs(pairs):
    pair = pairs()
    # Runs: (local 4.., remote 0..) x3, (0.., 5..) x2, (7, 3) x1, (8.., 10..) x4.
    remote = [0, 1, 2, 5, 6, 3, 10, 11, 12, 13]
    local = [4, 5, 6, 0, 1, 7, 8, 9, 10, 11]
    assert read_and_check(pair, remote, local) == 4


def test_runs_are_per_region(pairs):
    pair = pairs(regions=3)
    assert read_and_check(pair, [4, 5, 6, 7], [0, 1, 2, 3]) == 3
    assert read_and_check(pair, [4, 5, 9], [8, 9, 10]) == 3 * 2


def test_parts_stay_one_descriptor_per_block(pairs):
    """A TP split: half of each remote block into whole local blocks of half
    the size.  The remote halves are strided, so no run coalesces."""
    pair = pairs(d_block=BS // 2)
    assert read_and_check(pair, [0, 1, 2, 3], [4, 5, 6, 7], remote_part=(1, 2)) == 4
    assert read_and_check(pair, [8, 9], [0, 1], remote_part=(0, 2)) == 2


def test_parts_on_both_sides(pairs):
    pair = pairs()
    assert read_and_check(pair, [0, 1, 2], [5, 6, 7], remote_part=(3, 4), local_part=(0, 4)) == 3


def test_write_coalesces_too(pairs):
    pair = pairs()
    before = [t.clone() for t in pair.p_caches]
    h = pair.d.post_write(pair.p.name, pair.p.describe_cache(), [8, 9, 10, 2], [0, 1, 2, 3], b"w")
    assert h.descriptors == 2
    complete(pair.d, h, pair.p, b"w")
    pair.d.release(h)
    want = before[0].clone()
    want[[8, 9, 10, 2]] = pair.d_caches[0][[0, 1, 2, 3]]
    assert torch.equal(pair.p_caches[0], want)


def test_nixl_records_each_transfer_from_post_to_done():
    nixl = pytest.importorskip("kvplane.transport.nixl_agent")
    pair = Pair("nixl")
    try:
        for ids in ([0, 1, 2], [5, 7]):
            read_and_check(pair, ids, ids)
        samples = pair.d.transfer_times.samples
        assert [(s.op, s.nbytes, s.descriptors) for s in samples] == [("READ", 3 * BS, 1), ("READ", 2 * BS, 2)]
        assert all(0 < s.seconds < 2.0 for s in samples)
        assert pair.p.transfer_times.samples == []  # the passive side posted nothing
        assert isinstance(pair.d, nixl.NixlEndpoint)
    finally:
        pair.close()


# ------------------------------------------------------------------ the plan itself


def test_block_runs():
    assert block_runs([4, 5, 6, 0, 1, 7], [0, 1, 2, 5, 6, 3]) == [(4, 0, 3), (0, 5, 2), (7, 3, 1)]
    assert block_runs([0, 1], [0, 1], coalesce=False) == [(0, 0, 1), (1, 1, 1)]
    assert block_runs([], []) == []


def test_plan_spans_are_region_major_and_paired():
    local = CacheLayout("DRAM", 0, 64, 8, (0x1000, 0x9000))
    remote = CacheLayout("DRAM", 0, 128, 8, (0x20000, 0x40000))
    plan = plan_transfer(local, remote, [0, 1, 5], [2, 3, 4], (0, 1), (1, 2), 64)
    # The remote side moves halves: no coalescing, one span per block and region.
    assert plan.local == tuple(Span(r, b * 64, 64) for r in (0, 1) for b in (0, 1, 5))
    assert plan.remote == tuple(Span(r, b * 128 + 64, 64) for r in (0, 1) for b in (2, 3, 4))
    assert plan.nbytes == 2 * 3 * 64
    whole = plan_transfer(local, local, [0, 1, 5], [2, 3, 4], (0, 1), (0, 1), 64)
    assert whole.local == (Span(0, 0, 128), Span(0, 5 * 64, 64), Span(1, 0, 128), Span(1, 5 * 64, 64))
    assert whole.remote == (Span(0, 2 * 64, 128), Span(0, 4 * 64, 64), Span(1, 2 * 64, 128), Span(1, 4 * 64, 64))
    assert whole.descriptors == 4
