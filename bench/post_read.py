"""What posting one READ of N blocks costs the reader: per-transfer descriptor
lists (``get_xfer_descs`` x2 + ``initialize_xfer``) against prepared lists
(``make_prepped_xfer`` with indices), both paths on the same two real NIXL
agents in one process, alternating rep by rep.

The cache is shaped like an engine's: one region per layer (``--regions``),
small blocks.  Timed: the ``post_read`` call alone (checks, the progress call
before the post, the request and ``transfer``), and post -> DONE; the READ's
bytes are verified.  Also timed alone: one ``progress`` call (what the post
makes first).

    python -m bench.post_read [--regions 32] [--blocks 512] [--block-bytes 4096] [--reps 200] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import time

from .nixl import _spin
from .timing import median, pct

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

PATHS = ("per-transfer lists", "prepared lists")
# The endpoint's timed NIXL calls of one post, by path.
REQUEST_CALL = {PATHS[0]: "initialize_xfer", PATHS[1]: "make_prepped_xfer"}


class CallSamples:
    """Stands in for the endpoint's CallTimes: keeps every sample of the calls
    a post makes, so the request's cost is seen apart from ``transfer``."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def note(self, call: str, seconds: float) -> None:
        self.last[call] = seconds * 1e6


def run(regions: int, blocks: int, block_bytes: int, reps: int) -> dict:
    import torch

    from kvplane.transport.nixl_agent import NixlEndpoint

    torch.set_num_threads(1)
    a, b = NixlEndpoint("postbench-P"), NixlEndpoint("postbench-D")
    gen = torch.Generator().manual_seed(3)
    src = [torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8, generator=gen) for _ in range(regions)]
    dst = [torch.zeros_like(t) for t in src]
    try:
        for s, d in zip(src, dst):
            a.register_kv_cache(s, block_bytes)
            b.register_kv_cache(d, block_bytes)
        a.add_remote(b.local_metadata())
        b.add_remote(a.local_metadata())
        desc = a.describe_cache()
        half = blocks // 2
        cases = {f"{n} blocks, {kind}": (ids, ids2)
                 for n in (1, 16, 64) if 2 * n <= blocks
                 for kind, ids, ids2 in (("contiguous", list(range(n)), list(range(half, half + n))),
                                         ("every other", list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))))}
        post: dict[tuple[str, str], list[float]] = {(c, p): [] for c in cases for p in PATHS}
        done: dict[tuple[str, str], list[float]] = {(c, p): [] for c in cases for p in PATHS}
        progress: list[float] = []
        request: dict[tuple[str, str], list[float]] = {(c, p): [] for c in cases for p in PATHS}
        transfer: dict[tuple[str, str], list[float]] = {(c, p): [] for c in cases for p in PATHS}
        calls = CallSamples()
        b.call_times = calls  # type: ignore[assignment]
        verified = True
        for r in range(reps + 2):
            for case, (remote_ids, local_ids) in cases.items():
                order = PATHS if r % 2 == 0 else PATHS[::-1]
                for path in order:
                    b.use_prepped = path == PATHS[1]
                    calls.last.clear()
                    t0 = time.perf_counter()
                    h = b.post_read("postbench-P", desc, remote_ids, local_ids, b"done")
                    t1 = time.perf_counter()
                    _spin(lambda h=h: b.poll_transfer(h) == "DONE", [a.poll_notifs])
                    t2 = time.perf_counter()
                    b.release(h)
                    if r >= 2:  # the first rounds prepare the remote's lists and wire UCX
                        post[case, path].append((t1 - t0) * 1e6)
                        done[case, path].append((t2 - t0) * 1e6)
                        request[case, path].append(calls.last[REQUEST_CALL[path]])
                        transfer[case, path].append(calls.last["transfer"])
                    if r == reps + 1:
                        verified = verified and all(torch.equal(d[local_ids], s[remote_ids])
                                                    for s, d in zip(src, dst))
            t0 = time.perf_counter()
            b.progress()
            progress.append((time.perf_counter() - t0) * 1e6)
        out: dict = {"regions": regions, "blocks": blocks, "block_bytes": block_bytes, "reps": reps,
                     "verified": verified, "progress_us": {"p50": median(progress), "p99": pct(progress, 0.99)},
                     "prepared_lists": {"prepared": b.prepped.prepared, "released": b.prepped.released},
                     "cases": []}
        for case in cases:
            row: dict = {"case": case}
            for path in PATHS:
                row[path] = {"post_p50_us": median(post[case, path]), "post_p99_us": pct(post[case, path], 0.99),
                             "done_p50_us": median(done[case, path]),
                             "request_p50_us": median(request[case, path]),
                             "transfer_p50_us": median(transfer[case, path])}
            row["post_p50_ratio"] = row[PATHS[1]]["post_p50_us"] / row[PATHS[0]]["post_p50_us"]
            row["request_p50_ratio"] = row[PATHS[1]]["request_p50_us"] / row[PATHS[0]]["request_p50_us"]
            out["cases"].append(row)
        return out
    finally:
        a.close()
        b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regions", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run(args.regions, args.blocks, args.block_bytes, args.reps)
    print(f"{args.regions} regions x {args.blocks} blocks x {args.block_bytes} B, {args.reps} reps each, "
          f"alternating; bytes verified: {res['verified']}")
    print("µs, old (per-transfer lists) / new (prepared lists); request: initialize_xfer with its lists built "
          "/ make_prepped_xfer; transfer: NIXL's transfer() (posting UCX)")
    print(f"{'case':<24} {'post p50':>17} {'ratio':>6} {'post p99':>17} {'request p50':>17} {'ratio':>6} "
          f"{'transfer p50':>17} {'post->DONE p50':>17}")
    for row in res["cases"]:
        o, n = row[PATHS[0]], row[PATHS[1]]
        print(f"{row['case']:<24} {o['post_p50_us']:>8.1f}/{n['post_p50_us']:<8.1f} {row['post_p50_ratio']:>5.2f}x "
              f"{o['post_p99_us']:>8.1f}/{n['post_p99_us']:<8.1f} "
              f"{o['request_p50_us']:>8.1f}/{n['request_p50_us']:<8.1f} {row['request_p50_ratio']:>5.2f}x "
              f"{o['transfer_p50_us']:>8.1f}/{n['transfer_p50_us']:<8.1f} "
              f"{o['done_p50_us']:>8.1f}/{n['done_p50_us']:<8.1f}")
    print(f"one progress call alone: p50 {res['progress_us']['p50']:.1f} µs, p99 {res['progress_us']['p99']:.1f} µs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
