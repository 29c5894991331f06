"""The descriptors a transfer hands the backend: contiguous block runs coalesced.

A transfer moves pairs (remote block, local block), a part of each block
(``layout.BlockPart``) in every region.  Where consecutive pairs are
consecutive on both sides and both sides move whole blocks, their bytes are
contiguous in memory on both sides, so the run is one descriptor per region
instead of one per block (measured over UCX here: the per-descriptor work is
what a READ of small blocks pays for).  A part of a block (``of > 1``) is a
strided slice: consecutive blocks' slices are not adjacent, so those stay one
descriptor per block.  The real NIXL endpoint builds its descriptor lists
from this plan; the loopback copies by it, so both move the same bytes.
Blocks of different sizes on the two sides move slice by slice
(``plan_slices``, from ``block_sizes.slice_pairs``).
"""
from __future__ import annotations

from typing import Sequence

import attrs

from .block_sizes import SlicePair
from .errors import IncompatibleLayout
from .layout import BlockPart, CacheLayout, check_part


@attrs.frozen
class Span:
    """``length`` bytes at ``offset`` from the start of region ``region``."""

    region: int
    offset: int
    length: int


@attrs.frozen
class TransferPlan:
    """Paired spans: ``local[i]`` and ``remote[i]`` are equally long."""

    local: tuple[Span, ...]
    remote: tuple[Span, ...]

    @property
    def descriptors(self) -> int:
        return len(self.local)

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.local)


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int], *, coalesce: bool = True
               ) -> list[tuple[int, int, int]]:
    """(first local block, first remote block, count) of each run of pairs
    consecutive on both sides, in transfer order; every pair its own run
    when ``coalesce`` is false."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_ids, remote_ids):
        if coalesce and runs:
            l0, r0, n = runs[-1]
            if lb == l0 + n and rb == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs


def plan_transfer(local: CacheLayout, remote: CacheLayout, local_ids: Sequence[int], remote_ids: Sequence[int],
                  local_part: BlockPart, remote_part: BlockPart, slice_bytes: int,
                  local_first_region: int | None = None) -> TransferPlan:
    """The spans moving ``local_part`` of ``local_ids`` to or from
    ``remote_part`` of ``remote_ids`` (checked by the caller: equal lengths,
    ids in range, ``slice_bytes`` the parts' common size, regions paired by
    ``CacheLayout.check_regions``), region-major: remote region ``i`` with
    local region ``i`` (+ ``local_first_region``: a peer's layer slice)."""
    whole = local_part[1] == 1 and remote_part[1] == 1
    runs = block_runs(local_ids, remote_ids, coalesce=whole)
    lskip, rskip = local_part[0] * slice_bytes, remote_part[0] * slice_bytes
    lspans: list[Span] = []
    rspans: list[Span] = []
    first = local_first_region or 0
    for region in range(len(remote.base_addrs)):
        for lb, rb, n in runs:
            length = n * slice_bytes
            lspans.append(Span(first + region, lb * local.block_size + lskip, length))
            rspans.append(Span(region, rb * remote.block_size + rskip, length))
    return TransferPlan(tuple(lspans), tuple(rspans))


def addresses(layout: CacheLayout, spans: Sequence[Span]) -> list[tuple[int, int, int]]:
    """(address, length, device) of each span, as NIXL's descriptor lists take them."""
    return [(layout.base_addrs[s.region] + s.offset, s.length, layout.device_id) for s in spans]


def plan_slices(local: CacheLayout, remote: CacheLayout, pairs: Sequence[SlicePair]) -> TransferPlan:
    """The spans moving each pair's remote slice to or from its local slice
    (``block_sizes.slice_pairs``: blocks of different sizes), region-major;
    a span that continues the previous one on both sides extends it.  Every
    slice must be equally long on both sides and every id in range: a
    ValueError subclass names the first that is not, before anything is
    posted."""
    if not pairs:
        raise ValueError("a transfer needs at least one slice")
    if len(remote.base_addrs) != len(local.base_addrs):
        raise IncompatibleLayout(f"region count mismatch: local {len(local.base_addrs)}, "
                                 f"remote {len(remote.base_addrs)}")
    offsets: list[tuple[int, int, int]] = []  # (local offset, remote offset, length) in each region
    for p in pairs:
        local_part, remote_part = check_part(p.local_part, "local"), check_part(p.remote_part, "remote")
        local.check_block_ids([p.local_block], "local")
        remote.check_block_ids([p.remote_block], "remote")
        size = local.part_size(local_part[1], "local")
        if remote.part_size(remote_part[1], "remote") != size:
            raise IncompatibleLayout(f"slice size mismatch: local part {local_part} of a {local.block_size} B "
                                     f"block is {size} B, remote part {remote_part} of a {remote.block_size} B "
                                     f"block is {remote.part_size(remote_part[1])} B")
        lo, ro = p.local_block * local.block_size + local_part[0] * size, \
            p.remote_block * remote.block_size + remote_part[0] * size
        if offsets and offsets[-1][0] + offsets[-1][2] == lo and offsets[-1][1] + offsets[-1][2] == ro:
            offsets[-1] = (offsets[-1][0], offsets[-1][1], offsets[-1][2] + size)
        else:
            offsets.append((lo, ro, size))
    lspans = tuple(Span(region, lo, n) for region in range(len(local.base_addrs)) for lo, _, n in offsets)
    rspans = tuple(Span(region, ro, n) for region in range(len(local.base_addrs)) for _, ro, n in offsets)
    return TransferPlan(lspans, rspans)
