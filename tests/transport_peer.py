"""Child process for the cross-process transport tests (not a test module).

Runs a NixlEndpoint with a patterned DRAM cache behind a HandshakeServer,
prints ``URL <url>`` once ready and ``NOTIF <sender> <hex>`` per notification,
and exits when its parent goes away, stdin closes, or after ``--lifetime`` s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def pattern(num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    """Deterministic, block-distinct bytes both sides can compute."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, block_size), dtype=torch.uint8, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="peer")
    ap.add_argument("--engine-id", default="engine-P")
    ap.add_argument("--compat-hash", default="h1")
    ap.add_argument("--num-blocks", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--lifetime", type=float, default=60.0)
    a = ap.parse_args()

    from kvplane.transport.handshake import HandshakeServer, build_payload
    from kvplane.transport.nixl_agent import NixlEndpoint

    cache = pattern(a.num_blocks, a.block_size, a.seed)
    ep = NixlEndpoint(a.name)
    ep.register_kv_cache(cache, a.block_size)
    payload = build_payload(
        engine_id=a.engine_id, compat_hash=a.compat_hash, tp_rank=0,
        metadata=ep.local_metadata(), cache=ep.describe_cache(),
    )
    # Plaintext: these tests are about NIXL across processes, not the side channel's auth.
    server = HandshakeServer("tcp://127.0.0.1:0", lambda pp, tp: payload if tp == 0 else None, insecure=True)
    print("URL", server.url, flush=True)
    parent = os.getppid()
    end = time.monotonic() + a.lifetime
    try:
        while time.monotonic() < end and os.getppid() == parent:
            server.poll_once(5)  # the wait doubles as the loop's sleep
            for sender, msg in ep.poll_notifs():
                print("NOTIF", sender, msg.hex(), flush=True)
    finally:
        server.close()
        ep.close()


if __name__ == "__main__":
    main()
