"""A bare NIXL READ: what the main job's data path is measured against.

Two fresh ``NixlEndpoint`` agents in the calling process, DRAM, no plane,
no pipes: the reader posts a READ with a notification (as the job's READs
carry their completion) and polls it in a tight loop while the source
progresses UCX in the same loop (such a READ completes only when its target
progresses), as ``bench/nixl.py`` measures NIXL READ throughput.  Timed as the job's transfers are (the endpoint's
post-to-done record), for transfers of the sizes given, so the two figures
compare the same bytes in the same blocks.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Sequence

from kvplane.transport.transfer_times import TransferSample

_names = itertools.count()
TIMEOUT_S = 5.0


def size_sample(sizes: Sequence[int], at_most: int) -> list[int]:
    """``at_most`` sizes spread evenly over the sorted ``sizes`` (all when fewer)."""
    xs = sorted(sizes)
    if len(xs) <= at_most:
        return xs
    return [xs[(i * (len(xs) - 1)) // (at_most - 1)] for i in range(at_most)] if at_most > 1 else [xs[len(xs) // 2]]


def bare_reads(sizes: Sequence[int], block_bytes: int, *, reps: int = 3, name: str = "bare",
               between: Callable[[], None] = lambda: None, budget_s: float = 2.0) -> list[TransferSample]:
    """READ each of ``sizes`` bytes (whole ``block_bytes`` blocks, contiguous)
    ``reps`` times, round-robin, after one warm-up READ; the samples of every
    timed READ, fewer if ``budget_s`` ran out first (a loaded machine: the
    caller's report must not wait on this).  Each READ's bytes are checked;
    ``between`` runs after each (a caller that must keep saying it is alive)."""
    import torch

    from kvplane.transport.nixl_agent import NixlEndpoint

    if not sizes:
        return []
    counts = [max(1, -(-s // block_bytes)) for s in sizes]
    nblocks = max(counts)
    n = next(_names)
    src_ep, dst_ep = NixlEndpoint(f"{name}-src{n}"), NixlEndpoint(f"{name}-dst{n}")
    try:
        src = torch.arange(nblocks * block_bytes, dtype=torch.int64).remainder_(251).to(torch.uint8)
        src = src.reshape(nblocks, block_bytes)
        dst = torch.zeros_like(src)
        src_ep.register_kv_cache(src, block_bytes)
        dst_ep.register_kv_cache(dst, block_bytes)
        remote = dst_ep.add_remote(src_ep.local_metadata())
        src_ep.add_remote(dst_ep.local_metadata())
        desc = src_ep.describe_cache()

        def read(k: int) -> None:
            ids = list(range(k))
            h = dst_ep.post_read(remote, desc, ids, ids, b"bare")  # a completion, as the job's READs carry
            deadline = time.monotonic() + TIMEOUT_S
            while dst_ep.poll_transfer(h) != "DONE":
                src_ep.progress()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bare READ of {k} blocks not done in {TIMEOUT_S:g} s")
            dst_ep.release(h)

        read(nblocks)  # connection set-up and first-touch costs
        if not torch.equal(dst, src):
            raise RuntimeError("bare READ moved the wrong bytes")
        dst_ep.transfer_times.samples.clear()
        end = time.monotonic() + budget_s
        for k in [k for _ in range(reps) for k in counts]:
            if time.monotonic() > end:
                break
            dst[:k].zero_()
            read(k)
            if not torch.equal(dst[:k], src[:k]):
                raise RuntimeError("bare READ moved the wrong bytes")
            between()
        return list(dst_ep.transfer_times.samples)
    finally:
        dst_ep.close()
        src_ep.close()
