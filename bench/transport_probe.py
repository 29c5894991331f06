"""Probe real NIXL on this machine: notification latency and READ throughput.

Two polled agents in one process, DRAM on CPU.  Not a timed test: prints a
table.  Usage: python bench/transport_probe.py [--iters N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvplane.transport.nixl_agent import NixlEndpoint  # noqa: E402

MiB = 1 << 20


def pump(d: NixlEndpoint, p: NixlEndpoint, h=None, want: bytes | None = None, timeout=30.0) -> None:
    """Drive both sides (no progress thread) until the transfer / notif is done."""
    end = time.monotonic() + timeout
    done, seen = h is None, want is None
    while not (done and seen):
        if time.monotonic() > end:
            raise TimeoutError("probe step timed out")
        if not done:
            done = d.poll_transfer(h) == "DONE"
        for _, m in p.poll_notifs():
            seen = seen or m == want
        d.poll_notifs()


def notif_latency(d, p, iters):
    lat = []
    for i in range(iters):
        msg = b"lat:%d" % i
        t0 = time.perf_counter()
        d.send_notif(p.name, msg)
        pump(d, p, want=msg)
        lat.append(time.perf_counter() - t0)
    return lat


def read_throughput(total_bytes, iters, block=MiB):
    nb = max(1, total_bytes // block)
    d, p = NixlEndpoint(f"Dt{total_bytes}"), NixlEndpoint(f"Pt{total_bytes}")
    try:
        dst = torch.zeros(nb, block, dtype=torch.uint8)
        src = torch.randint(0, 256, (nb, block), dtype=torch.uint8)
        d.register_kv_cache(dst, block)
        p.register_kv_cache(src, block)
        name = d.add_remote(p.local_metadata())
        p.add_remote(d.local_metadata())
        desc, ids = p.describe_cache(), list(range(nb))
        times = []
        for i in range(iters + 1):  # first one warms the connection
            dst.zero_()
            t0 = time.perf_counter()
            h = d.post_read(name, desc, ids, ids, b"t:%d" % i)
            pump(d, p, h, b"t:%d" % i)
            dt = time.perf_counter() - t0
            d.release(h)
            if i:
                times.append(dt)
        assert torch.equal(dst, src), "READ bytes differ"
        ctimes = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            ctimes.append(time.perf_counter() - t0)
        return nb * block, statistics.median(times), statistics.median(ctimes)
    finally:
        d.close()
        p.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    t0 = time.perf_counter()
    d, p = NixlEndpoint("Dn"), NixlEndpoint("Pn")
    print(f"agent creation x2: {time.perf_counter() - t0:.3f} s")
    d.add_remote(p.local_metadata())
    p.add_remote(d.local_metadata())
    notif_latency(d, p, 3)  # wire up
    lat = sorted(notif_latency(d, p, max(50, a.iters * 5)))
    d.close()
    p.close()
    print(f"notification latency (send -> poll sees it, one process): "
          f"p50 {lat[len(lat) // 2] * 1e6:.1f} us, p90 {lat[int(len(lat) * 0.9)] * 1e6:.1f} us, "
          f"min {lat[0] * 1e6:.1f} us, n={len(lat)}")
    print()
    print(f"{'size':>8} | {'NIXL READ':>12} | {'GB/s':>7} | {'torch copy':>12} | {'GB/s':>7}")
    print("-" * 60)
    for size in (1 * MiB, 64 * MiB):
        nbytes, t_read, t_copy = read_throughput(size, a.iters)
        print(f"{nbytes // MiB:>5} MiB | {t_read * 1e3:>9.3f} ms | {nbytes / t_read / 1e9:>7.2f} | "
              f"{t_copy * 1e3:>9.3f} ms | {nbytes / t_copy / 1e9:>7.2f}")
    print("(READ time includes post, UCX progress and the completion notif; bytes verified)")


if __name__ == "__main__":
    main()
