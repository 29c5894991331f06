"""A bare NIXL READ: what the main job's data path is measured against.

Two private ``NixlEndpoint`` agents in the calling process, DRAM, no plane,
no pipes: the reader posts a READ with a notification (as the job's READs
carry their completion) and polls it in a tight loop while the source
progresses UCX in the same loop (such a READ completes only when its target
progresses), as ``bench/nixl.py`` measures NIXL READ throughput.  Timed as
the job's transfers are (the endpoint's post-to-done record).

The main job's D rank 0 makes one such READ of the size of each READ it
made, when it is next idle, so that the two figures compare the same bytes
under the same load, in the same run.
"""
from __future__ import annotations

import itertools
import time
from typing import Sequence

from kvplane.transport.transfer_times import TransferSample

_names = itertools.count()
TIMEOUT_S = 5.0


def size_sample(sizes: Sequence[int], at_most: int) -> list[int]:
    """``at_most`` sizes spread evenly over the sorted ``sizes`` (all when fewer)."""
    xs = sorted(sizes)
    if len(xs) <= at_most:
        return xs
    return [xs[(i * (len(xs) - 1)) // (at_most - 1)] for i in range(at_most)] if at_most > 1 else [xs[len(xs) // 2]]


class BareReader:
    """A source and a reader agent with ``num_blocks`` blocks of
    ``block_bytes`` each; :meth:`read` READs the first ``k`` blocks."""

    def __init__(self, block_bytes: int, num_blocks: int, *, name: str = "bare") -> None:
        import torch

        from kvplane.transport.nixl_agent import NixlEndpoint

        self.torch = torch
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        n = next(_names)
        self.src_ep, self.dst_ep = NixlEndpoint(f"{name}-src{n}"), NixlEndpoint(f"{name}-dst{n}")
        try:
            src = torch.arange(num_blocks * block_bytes, dtype=torch.int64).remainder_(251).to(torch.uint8)
            self.src = src.reshape(num_blocks, block_bytes)
            self.dst = torch.zeros_like(self.src)
            self.src_ep.register_kv_cache(self.src, block_bytes)
            self.dst_ep.register_kv_cache(self.dst, block_bytes)
            self.remote = self.dst_ep.add_remote(self.src_ep.local_metadata())
            self.src_ep.add_remote(self.dst_ep.local_metadata())
            self.desc = self.src_ep.describe_cache()
            self._read(num_blocks)  # connection set-up and first-touch costs, not timed
            self.dst_ep.transfer_times.samples.clear()
        except BaseException:
            self.close()
            raise

    @property
    def samples(self) -> list[TransferSample]:
        return self.dst_ep.transfer_times.samples

    def read(self, nbytes: int) -> None:
        """READ the blocks that hold ``nbytes`` (at most all of them); the
        bytes are checked after the READ is timed."""
        k = min(self.num_blocks, max(1, -(-nbytes // self.block_bytes)))
        self.dst[:k].zero_()
        self._read(k)

    def _read(self, k: int) -> None:
        ids = list(range(k))
        h = self.dst_ep.post_read(self.remote, self.desc, ids, ids, b"bare")
        deadline = time.monotonic() + TIMEOUT_S
        while self.dst_ep.poll_transfer(h) != "DONE":
            self.src_ep.progress()
            if time.monotonic() > deadline:
                self.dst_ep.release(h)
                raise TimeoutError(f"bare READ of {k} blocks not done in {TIMEOUT_S:g} s")
        self.dst_ep.release(h)
        if not self.torch.equal(self.dst[:k], self.src[:k]):
            raise RuntimeError("bare READ moved the wrong bytes")

    def close(self) -> None:
        for ep in (getattr(self, "dst_ep", None), getattr(self, "src_ep", None)):
            if ep is not None:
                ep.close()


def bare_reads(sizes: Sequence[int], block_bytes: int, *, reps: int = 3, name: str = "bare") -> list[TransferSample]:
    """READ each of ``sizes`` bytes ``reps`` times, round-robin; the samples."""
    if not sizes:
        return []
    reader = BareReader(block_bytes, max(1, -(-max(sizes) // block_bytes)), name=name)
    try:
        for _ in range(reps):
            for size in sizes:
                reader.read(size)
        return list(reader.samples)
    finally:
        reader.close()
