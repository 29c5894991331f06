"""Prepared NIXL descriptor lists: built once per cache, a transfer names indices.

Building both descriptor lists and a transfer request for every READ
(``get_xfer_descs`` + ``initialize_xfer``) was most of what posting cost on
the decode side.  NIXL can instead prepare a side's list once
(``prep_xfer_dlist``) and make each transfer from indices into two prepared
lists (``make_prepped_xfer``; NIXL merges contiguous descriptors itself).

A prepared list holds one descriptor per (region, block, slice) of a cache,
region-major, for one slice count ``of`` (1: whole blocks), so the slice
``part = (index, of)`` of block ``b`` in region ``r`` is descriptor
``(r * num_blocks + b) * of + index``.  The local lists live until the cache
changes (a region added) or the endpoint closes; a remote's lists until it is
removed or re-added (a new incarnation never uses an old incarnation's list).
Every list dropped is released; :class:`PreppedLists` keeps at most
``MAX_PER_OWNER`` lists per owner (a peer changing its layout over and over
cannot grow it) and refuses lists above ``MAX_DESCRIPTORS`` (a peer's claimed
num_blocks is not trusted with memory; the caller then builds the transfer's
own lists as before).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from .layout import BlockPart, CacheLayout

# Descriptors in one prepared list (x3 int64 while built: 48 MiB at most).
MAX_DESCRIPTORS = 1 << 21
# Prepared lists kept per owner (the local cache, or one remote agent).
MAX_PER_OWNER = 4

LOCAL = ""  # the owner key of the local cache's lists

PrepFn = Callable[[str, np.ndarray, str], Any]


def descriptor_table(layout: CacheLayout, of: int) -> np.ndarray:
    """(address, length, device) of every (region, block, slice), region-major."""
    size = layout.block_size // of
    offsets = np.arange(layout.num_blocks * of, dtype=np.int64) * size
    bases = np.asarray(layout.base_addrs, dtype=np.int64)
    table = np.empty((len(bases) * offsets.size, 3), dtype=np.int64)
    table[:, 0] = (bases[:, None] + offsets[None, :]).reshape(-1)
    table[:, 1] = size
    table[:, 2] = layout.device_id
    return table


def fits(layout: CacheLayout, of: int) -> bool:
    return len(layout.base_addrs) * layout.num_blocks * of <= MAX_DESCRIPTORS


def indices(layout: CacheLayout, block_ids: list[int], part: BlockPart) -> np.ndarray:
    """Descriptor indices of ``part`` of ``block_ids`` (ids checked by the
    caller) in every region, region-major: the pairing order of both sides."""
    index, of = part
    ids = np.asarray(block_ids, dtype=np.int64) * of + index
    per_region = layout.num_blocks * of
    out = (np.arange(len(layout.base_addrs), dtype=np.int64)[:, None] * per_region + ids[None, :])
    return out.reshape(-1).astype(np.int32)


class PreppedLists:
    """Prepared lists by owner (``LOCAL`` or a remote agent's name), each
    keyed by (layout, of); ``prep(owner, table, mem_type)`` makes one."""

    def __init__(self, prep: PrepFn) -> None:
        self._prep = prep
        self._lists: dict[str, OrderedDict[tuple[CacheLayout, int], Any]] = {}
        self.prepared = 0  # lists made, ever
        self.released = 0  # lists released, ever
        self.release_failures = 0

    def get(self, owner: str, layout: CacheLayout, of: int) -> Any:
        mine = self._lists.setdefault(owner, OrderedDict())
        key = (layout, of)
        handle = mine.get(key)
        if handle is not None:
            mine.move_to_end(key)
            return handle
        handle = self._prep(owner, descriptor_table(layout, of), layout.mem_type)
        self.prepared += 1
        mine[key] = handle
        while len(mine) > MAX_PER_OWNER:
            _, old = mine.popitem(last=False)
            self._release(old)
        return handle

    def live(self, owner: str) -> int:
        return len(self._lists.get(owner, ()))

    def handles(self, owner: str) -> tuple[Any, ...]:
        """``owner``'s live lists, oldest first."""
        return tuple(self._lists.get(owner, {}).values())

    def drop(self, owner: str) -> None:
        """Release every list of ``owner`` (removed, re-added or closed)."""
        for handle in self._lists.pop(owner, {}).values():
            self._release(handle)

    def drop_all(self) -> None:
        for owner in list(self._lists):
            self.drop(owner)

    def _release(self, handle: Any) -> None:
        # A release that fails still drops the list (NIXL frees it with its
        # agent) and must not stop the owner's other lists being released.
        self.released += 1
        try:
            handle.release()
        except Exception:
            self.release_failures += 1
