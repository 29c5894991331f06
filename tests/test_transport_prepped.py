"""Prepared descriptor lists (transport/prepped.py) over real NIXL: the
indices pick the same bytes as the per-transfer lists, every list is released
on every removal path, and a re-added (restarted) peer gets fresh ones.

Checked here on nixl's handles through their ``_released`` slot (the only
view of a release the bindings give).
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

from kvplane.transport.descriptors import addresses, plan_transfer  # noqa: E402
from kvplane.transport.errors import MetadataRejected  # noqa: E402
from kvplane.transport.layout import BlockIdOutOfRange, CacheLayout  # noqa: E402
from kvplane.transport.nixl_agent import NixlEndpoint  # noqa: E402
from kvplane.transport.prepped import LOCAL, MAX_PER_OWNER, descriptor_table, indices  # noqa: E402

NB, BS, REGIONS = 16, 256, 3


def _cache(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (NB, BS), dtype=torch.uint8, generator=gen) for _ in range(REGIONS)]


def _endpoint(name: str, cache: list[torch.Tensor]) -> NixlEndpoint:
    ep = NixlEndpoint(name)
    for t in cache:
        ep.register_kv_cache(t, BS)
    return ep


def _read(d: NixlEndpoint, p: NixlEndpoint, remote_ids, local_ids, **parts) -> None:
    h = d.post_read(p.name, p.describe_cache(), remote_ids, local_ids, b"n", **parts)
    for _ in range(100_000):
        p.progress()
        if d.poll_transfer(h) == "DONE":
            break
    else:
        raise AssertionError("READ did not finish")
    d.release(h)


@pytest.mark.parametrize("part", [(0, 1), (1, 2), (3, 4)])
def test_indices_pick_the_planned_bytes(part):
    layout = CacheLayout("DRAM", 0, BS, NB, (1 << 20, 1 << 24, 1 << 28))
    ids = [5, 6, 7, 2, 15, 0]
    table = descriptor_table(layout, part[1])
    picked = [tuple(int(x) for x in table[i]) for i in indices(layout, ids, part)]
    size = BS // part[1]
    # What the per-transfer plan moves, one descriptor per block (uncoalesced), region-major.
    plan = plan_transfer(layout, layout, ids, ids, (part[0], part[1]) if part[1] > 1 else (0, 2),
                         (0, 2), size if part[1] > 1 else BS // 2)
    assert [a for a, _, _ in picked] == [a for a, _, _ in addresses(layout, plan.local)]
    assert {(ln, dev) for _, ln, dev in picked} == {(size, 0)}


def test_lists_are_reused_and_released_on_remove_and_close():
    src, dst = _cache(1), [torch.zeros(NB, BS, dtype=torch.uint8) for _ in range(REGIONS)]
    p, d = _endpoint("prep-P", src), _endpoint("prep-D", dst)
    try:
        assert d.prepped.live(LOCAL) == 0  # the cache may still grow
        p.add_remote(d.local_metadata())
        d.add_remote(p.local_metadata())
        assert d.prepped.live(LOCAL) == 1  # prepared once the first peer is added
        _read(d, p, [3, 4, 9], [0, 1, 2])
        _read(d, p, [10], [12])
        assert all(torch.equal(dt[[0, 1, 2, 12]], s[[3, 4, 9, 10]]) for s, dt in zip(src, dst))
        (remote_list,) = d.prepped.handles("prep-P")
        assert d.prepped.prepared == 2  # the local one and P's, each once
        with pytest.raises(BlockIdOutOfRange):
            d.post_read("prep-P", p.describe_cache(), [NB], [0])
        d.remove_remote("prep-P")
        assert remote_list._released and d.prepped.live("prep-P") == 0
        (local_list,) = d.prepped.handles(LOCAL)
    finally:
        d.close()
        p.close()
    assert local_list._released
    assert d.prepped.prepared == d.prepped.released == 2 and d.prepped.release_failures == 0


def test_a_restarted_peer_gets_fresh_lists():
    dst = [torch.zeros(NB, BS, dtype=torch.uint8) for _ in range(REGIONS)]
    d = _endpoint("prep-D2", dst)
    p1 = _endpoint("prep-P2", _cache(2))
    try:
        d.add_remote(p1.local_metadata())
        p1.add_remote(d.local_metadata())
        _read(d, p1, [1], [1])
        (old,) = d.prepped.handles("prep-P2")
        p1.close()
        # The same name again, other memory: NIXL refuses a name it holds
        # (the old lists stay with the old agent), so the driver removes first.
        src2 = _cache(3)
        p2 = _endpoint("prep-P2", src2)
        try:
            with pytest.raises(MetadataRejected):
                d.add_remote(p2.local_metadata())
            assert not old._released
            d.remove_remote("prep-P2")
            assert old._released and d.prepped.live("prep-P2") == 0
            d.add_remote(p2.local_metadata())
            p2.add_remote(d.local_metadata())
            _read(d, p2, [2, 3], [4, 5])
            (new,) = d.prepped.handles("prep-P2")
            assert new is not old
            d.remove_remote("prep-P2")
            assert new._released
            d.add_remote(p2.local_metadata())
            _read(d, p2, [7], [8])
            assert d.prepped.handles("prep-P2")[0] is not new
            assert all(torch.equal(dt[[4, 5, 8]], s[[2, 3, 7]]) for s, dt in zip(src2, dst))
        finally:
            p2.close()
    finally:
        d.close()
    assert d.prepped.prepared == d.prepped.released and d.prepped.release_failures == 0


def test_lists_per_owner_are_bounded():
    src, dst = _cache(4), [torch.zeros(NB, BS, dtype=torch.uint8) for _ in range(REGIONS)]
    p, d = _endpoint("prep-P3", src), _endpoint("prep-D3", dst)
    try:
        p.add_remote(d.local_metadata())
        d.add_remote(p.local_metadata())
        for of in (1, 2, 4, 8, 16, 32):  # a list per slice count on each side
            part = (of - 1, of)
            _read(d, p, [of % NB], [of % NB], remote_part=part, local_part=part)
        assert d.prepped.live("prep-P3") == MAX_PER_OWNER
        assert d.prepped.live(LOCAL) == MAX_PER_OWNER
        assert d.prepped.prepared - d.prepped.released == 2 * MAX_PER_OWNER
    finally:
        d.close()
        p.close()
    assert d.prepped.prepared == d.prepped.released


def test_without_prepared_lists_the_same_bytes_move():
    src, dst = _cache(5), [torch.zeros(NB, BS, dtype=torch.uint8) for _ in range(REGIONS)]
    p = _endpoint("prep-P4", src)
    d = NixlEndpoint("prep-D4", prepped=False)
    try:
        for t in dst:
            d.register_kv_cache(t, BS)
        p.add_remote(d.local_metadata())
        d.add_remote(p.local_metadata())
        _read(d, p, [0, 1, 2, 8], [3, 4, 5, 6])
        assert d.prepped.prepared == 0
        assert all(torch.equal(dt[[3, 4, 5, 6]], s[[0, 1, 2, 8]]) for s, dt in zip(src, dst))
    finally:
        d.close()
        p.close()
