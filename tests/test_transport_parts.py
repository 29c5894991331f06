"""Tensor-parallel transfers: a part (index, of) of each block, over real NIXL
(two agents in one process, DRAM on CPU) and over the loopback fabric.

Part (i, k) is the i-th of k equal contiguous byte slices of a block, in every
region.  Each test runs on both endpoints; the loopback runs are core tests.
"""

import itertools

import pytest
import torch

from kvplane.transport.errors import IncompatibleLayout, InvalidPart
from kvplane.transport.faults import DropNotifications
from kvplane.transport.layout import CacheLayout, check_part
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

from transfer_support import complete

NB, BS = 8, 4096
_names = itertools.count()


def pattern(shape, seed, dtype=torch.uint8):
    """Seeded nonzero bytes viewed as ``dtype`` of ``shape`` (compare them as bytes)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(1, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


class Net:
    """Endpoints of one kind; every one is closed at the end of the test."""

    def __init__(self, kind):
        self.kind = kind
        self.fabric = LoopbackFabric() if kind == "loopback" else None
        self.endpoints = []

    def endpoint(self, role, *regions, block_size):
        n = next(_names)
        if self.kind == "nixl":
            from kvplane.transport.nixl_agent import NixlEndpoint

            ep = NixlEndpoint(f"{role}{n}")
        else:
            ep = LoopbackEndpoint(self.fabric, f"{role}{n}")
        self.endpoints.append(ep)
        for t in regions:
            ep.register_kv_cache(t, block_size)
        for other in self.endpoints[:-1]:  # everyone knows everyone
            assert other.add_remote(ep.local_metadata()) == ep.name
            assert ep.add_remote(other.local_metadata()) == other.name
        return ep

    def close(self):
        for ep in self.endpoints:
            ep.close()


@pytest.fixture(params=[pytest.param("loopback", marks=pytest.mark.core), "nixl"])
def net(request):
    if request.param == "nixl":
        pytest.importorskip("kvplane.transport.nixl_agent")
    n = Net(request.param)
    try:
        yield n
    finally:
        n.close()


def finish(initiator, h, target, notif=b""):
    """Drive both sides until the transfer is DONE (and ``notif`` reached the
    target), then release the handle."""
    got = complete(initiator, h, target, notif)
    initiator.release(h)
    return got


# ------------------------------------------------------------------ reads


def test_read_half_of_remote_blocks_into_whole_local_blocks(net):
    # Reader TP 2x the holder's: this reader rank reads part 1 of 2 of each block.
    half = BS // 2
    p_cache = pattern((NB, BS), 1)
    d_cache = torch.zeros(NB, half, dtype=torch.uint8)
    p = net.endpoint("P", p_cache, block_size=BS)
    d = net.endpoint("D", d_cache, block_size=half)
    h = d.post_read(p.name, p.describe_cache(), [5, 1, 6], [0, 3, 7], b"r:1", remote_part=(1, 2))
    assert h.nbytes == 3 * half and h.num_blocks == 3
    finish(d, h, p, b"r:1")
    assert torch.equal(d_cache[[0, 3, 7]], p_cache[[5, 1, 6], half:])
    assert not d_cache[[1, 2, 4, 5, 6]].any()
    # The other half, from another block, into another local block.
    h = d.post_read(p.name, p.describe_cache(), [2], [4], remote_part=(0, 2))
    finish(d, h, p)
    assert torch.equal(d_cache[4], p_cache[2, :half])


def test_whole_blocks_of_two_holders_fill_the_halves_of_local_blocks(net):
    # Holder TP 2x the reader's: holder rank j's whole block is part j of 2.
    half = BS // 2
    p0_cache, p1_cache = pattern((NB, half), 2), pattern((NB, half), 3)
    d_cache = torch.zeros(NB, BS, dtype=torch.uint8)
    p0 = net.endpoint("P", p0_cache, block_size=half)
    p1 = net.endpoint("P", p1_cache, block_size=half)
    d = net.endpoint("D", d_cache, block_size=BS)
    h0 = d.post_read(p0.name, p0.describe_cache(), [2, 3], [1, 4], b"a:1", local_part=(0, 2))
    h1 = d.post_read(p1.name, p1.describe_cache(), [6, 0], [1, 4], b"b:1", local_part=(1, 2))
    assert h0.nbytes == h1.nbytes == 2 * half
    finish(d, h0, p0, b"a:1")
    finish(d, h1, p1, b"b:1")
    assert torch.equal(d_cache[[1, 4], :half], p0_cache[[2, 3]])
    assert torch.equal(d_cache[[1, 4], half:], p1_cache[[6, 0]])
    assert not d_cache[[0, 2, 3, 5, 6, 7]].any()


def test_parts_on_both_sides(net):
    # Quarter 3 of the remote block into half 0 of a local block half as big.
    q = BS // 4
    p_cache = pattern((NB, BS), 4)
    d_cache = torch.zeros(NB, 2 * q, dtype=torch.uint8)
    p = net.endpoint("P", p_cache, block_size=BS)
    d = net.endpoint("D", d_cache, block_size=2 * q)
    h = d.post_read(p.name, p.describe_cache(), [7], [2], remote_part=(3, 4), local_part=(0, 2))
    assert h.nbytes == q
    finish(d, h, p)
    assert torch.equal(d_cache[2, :q], p_cache[7, 3 * q:])
    assert not d_cache[2, q:].any() and not d_cache[[0, 1, 3, 4, 5, 6, 7]].any()


# ------------------------------------------------------------------ writes


def test_write_with_parts(net):
    # Push mode: P pushes quarter 1 of its blocks into half 1 of D's.
    q = BS // 4
    p_cache = pattern((NB, BS), 5)
    d_cache = torch.zeros(NB, 2 * q, dtype=torch.uint8)
    p = net.endpoint("P", p_cache, block_size=BS)
    d = net.endpoint("D", d_cache, block_size=2 * q)
    h = p.post_write(d.name, d.describe_cache(), [0, 6], [3, 4], b"w:1", local_part=(1, 4), remote_part=(1, 2))
    assert h.op == "WRITE" and h.nbytes == 2 * q
    finish(p, h, d, b"w:1")
    assert torch.equal(d_cache[[0, 6], q:], p_cache[[3, 4], q:2 * q])
    assert not d_cache[:, :q].any() and not d_cache[[1, 2, 3, 4, 5, 7]].any()


def test_the_fault_wrapper_passes_parts_through(net):
    half = BS // 2
    p_cache = pattern((NB, BS), 6)
    d_cache = torch.zeros(NB, half, dtype=torch.uint8)
    p = net.endpoint("P", p_cache, block_size=BS)
    d = DropNotifications(net.endpoint("D", d_cache, block_size=half), rate=0.0)
    h = d.post_read(p.name, p.describe_cache(), [3], [3], remote_part=(1, 2))
    assert h.nbytes == half
    finish(d, h, p)
    assert torch.equal(d_cache[3], p_cache[3, half:])


# ------------------------------------------------------------------ multi-region


def test_multi_region_caches_move_the_part_in_every_region(net):
    layers, nb, elems = 3, 4, 256  # float16: 512 B blocks on P, 1 KiB on D
    p_layers = [pattern((nb, elems), 10 + i, torch.float16) for i in range(layers)]
    d_layers = [torch.zeros(nb, 2 * elems, dtype=torch.float16) for _ in range(layers)]
    p = net.endpoint("P", *p_layers, block_size=2 * elems)
    d = net.endpoint("D", *d_layers, block_size=4 * elems)
    assert len(d.describe_cache()["base_addrs"]) == layers
    h = d.post_read(p.name, p.describe_cache(), [2, 0], [1, 3], local_part=(1, 2))
    assert h.nbytes == 2 * 2 * elems * layers
    finish(d, h, p)
    for i in range(layers):
        assert torch.equal(d_layers[i][[1, 3], elems:].view(torch.uint8),
                           p_layers[i][[2, 0]].view(torch.uint8)), f"layer {i}"
        assert not d_layers[i][:, :elems].view(torch.uint8).any()
        assert not d_layers[i][[0, 2]].view(torch.uint8).any()
    # And the other way: part 1 of 2 of D's blocks into P's whole blocks.
    h = p.post_read(d.name, d.describe_cache(), [1], [0], remote_part=(1, 2))
    finish(p, h, d)
    for i in range(layers):
        assert torch.equal(p_layers[i][0].view(torch.uint8), d_layers[i][1, elems:].view(torch.uint8))


def test_nbytes_of_whole_block_transfers(net):
    p_layers = [pattern((NB, 512), 20 + i) for i in range(2)]
    d_layers = [torch.zeros(NB, 512, dtype=torch.uint8) for _ in range(2)]
    p = net.endpoint("P", *p_layers, block_size=512)
    d = net.endpoint("D", *d_layers, block_size=512)
    h = d.post_read(p.name, p.describe_cache(), [1, 2, 3], [4, 5, 6])
    assert h.nbytes == 3 * 512 * 2
    finish(d, h, p)
    assert all(torch.equal(d_layers[i][[4, 5, 6]], p_layers[i][[1, 2, 3]]) for i in range(2))


# ------------------------------------------------------------------ errors

BAD_PARTS = [(2, 2), (-1, 2), (0, 0), (0, -1), (True, 2), (0, True), (0.0, 1), (0, 2.0), "01", (0, 1, 2),
             None, 1]


@pytest.mark.parametrize("part", BAD_PARTS, ids=repr)
@pytest.mark.parametrize("side", ["remote_part", "local_part"])
def test_bad_parts_are_refused_before_posting(net, part, side):
    p = net.endpoint("P", pattern((NB, BS), 7), block_size=BS)
    d_cache = torch.zeros(NB, BS, dtype=torch.uint8)
    d = net.endpoint("D", d_cache, block_size=BS)
    with pytest.raises(InvalidPart, match=side.split("_")[0] + " part"):
        d.post_read(p.name, p.describe_cache(), [0], [0], b"bad", **{side: part})
    with pytest.raises(ValueError):
        d.post_write(p.name, p.describe_cache(), [0], [0], b"bad", **{side: part})
    assert_nothing_posted(net, d, d_cache, p)


def test_indivisible_block_sizes_are_refused_before_posting(net):
    p_cache = pattern((NB, BS), 8)
    d_cache = torch.zeros(NB, BS, dtype=torch.uint8)
    p = net.endpoint("P", p_cache, block_size=BS)
    d = net.endpoint("D", d_cache, block_size=BS)
    desc = p.describe_cache()
    with pytest.raises(IncompatibleLayout, match="remote block size 4096 B does not divide into 3"):
        d.post_read(p.name, desc, [0], [0], b"bad", remote_part=(0, 3))
    with pytest.raises(IncompatibleLayout, match="local block size 4096 B does not divide into 3"):
        d.post_write(p.name, desc, [0], [0], b"bad", local_part=(1, 3), remote_part=(0, 2))
    assert_nothing_posted(net, d, d_cache, p)


def test_unequal_slices_and_region_counts_are_refused_before_posting(net):
    p_cache = pattern((NB, BS), 9)
    d_cache = torch.zeros(NB, BS, dtype=torch.uint8)
    p = net.endpoint("P", p_cache, block_size=BS)
    d = net.endpoint("D", d_cache, block_size=BS)
    desc = p.describe_cache()
    with pytest.raises(IncompatibleLayout, match="slice size mismatch"):
        d.post_read(p.name, desc, [0], [0], b"bad", remote_part=(1, 2))  # 2048 B into 4096 B
    with pytest.raises(IncompatibleLayout, match="slice size mismatch"):
        d.post_write(p.name, desc, [0], [0], b"bad", remote_part=(0, 2), local_part=(0, 4))
    with pytest.raises(IncompatibleLayout, match="block size mismatch"):  # whole blocks: as before
        d.post_read(p.name, {**desc, "block_size": BS // 2, "num_blocks": NB * 2}, [0], [0], b"bad")
    two_regions = {**desc, "base_addrs": desc["base_addrs"] * 2}
    with pytest.raises(IncompatibleLayout, match="region count mismatch"):
        d.post_read(p.name, two_regions, [0], [0], b"bad", remote_part=(0, 2), local_part=(1, 2))
    # Block ids are still checked with parts.
    with pytest.raises(IndexError, match="remote block id 8"):
        d.post_read(p.name, desc, [8], [0], b"bad", remote_part=(0, 2), local_part=(1, 2))
    assert_nothing_posted(net, d, d_cache, p)


def assert_nothing_posted(net, d, d_cache, p):
    """Nothing was handed to NIXL and no transfer ran: the cache is as it was,
    and the next (valid) transfer's notification is the only one P gets."""
    assert not d_cache.any()
    if net.kind == "nixl":
        assert "initialize_xfer" not in d.call_times.max_s
    h = d.post_read(p.name, p.describe_cache(), [0], [0], b"good")
    got = finish(d, h, p, b"good")
    got.extend(p.poll_notifs())
    assert [m for _, m in got] == [b"good"]


# ------------------------------------------------------------------ parts of different sizes


def test_parts_of_different_sizes_on_one_endpoint(net):
    """Halves, then quarters into halves, from the same endpoint: each
    transfer builds its own descriptors, one per block (parts are strided)."""
    p_cache, d_cache = pattern((NB, BS), 11), torch.zeros(NB, BS // 2, dtype=torch.uint8)
    p = net.endpoint("P", p_cache, block_size=BS)
    d = net.endpoint("D", d_cache, block_size=BS // 2)
    desc = p.describe_cache()
    for blk, part in ((0, (0, 2)), (1, (1, 2)), (2, (1, 2))):
        finish(d, d.post_read(p.name, desc, [blk], [blk], remote_part=part), p)
    h = d.post_read(p.name, desc, [3, 4], [3, 4], remote_part=(2, 4), local_part=(1, 2))
    assert h.descriptors == 2
    finish(d, h, p)
    assert torch.equal(d_cache[[0, 1, 2], :], torch.stack([p_cache[0, :BS // 2], p_cache[1, BS // 2:],
                                                            p_cache[2, BS // 2:]]))
    assert torch.equal(d_cache[[3, 4], BS // 4:], p_cache[[3, 4], BS // 2:3 * BS // 4])
    assert not d_cache[[3, 4], :BS // 4].any()


# ------------------------------------------------------------------ layout


def test_part_size_and_check_part():
    lay = CacheLayout("DRAM", 0, 64, 3, (0x1000, 0x2000))
    assert lay.part_size(4) == 16
    assert check_part([1, 2], "local") == (1, 2)
    with pytest.raises(IncompatibleLayout, match="does not divide into 3"):
        lay.part_size(3)
