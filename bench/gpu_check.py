"""Functional GPU check: VRAM registration, READ and notification between two
polled NIXL agents in one process; verifies bytes and prints GB/s.

Self-contained (no kvplane imports) so it runs on a bare GPU box with just
torch + a nixl wheel.  Exits 2 with a clear message when CUDA is absent.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")


def load_nixl():
    for mod in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(mod), mod
        except ImportError:
            continue
    raise SystemExit("gpu_check: no NIXL package found (tried nixl, nixl_cu12, nixl_cu13)")


def drive(a, b, h, want: bytes, timeout=60.0) -> None:
    """No progress thread: poll the initiator's transfer and the target's notifs."""
    end = time.monotonic() + timeout
    done = seen = False
    while not (done and seen):
        if time.monotonic() > end:
            raise SystemExit(f"gpu_check: READ did not finish in {timeout} s (done={done}, notif={seen})")
        if not done:
            state = a.check_xfer_state(h)
            if state == "ERR":
                raise SystemExit("gpu_check: transfer failed (ERR)")
            done = state == "DONE"
        for msgs in b.get_new_notifs().values():
            seen = seen or want in msgs
        a.get_new_notifs()


def main(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing to check.", file=sys.stderr)
        return 2
    api, modname = load_nixl()
    mib = int(argv[0]) if argv else 256
    block = 1 << 20
    nb = mib
    dev = torch.device("cuda", 0)
    torch.cuda.init()  # a CUDA context must exist before the agents are created
    print(f"nixl module: {modname}; device: {torch.cuda.get_device_name(dev)}; {mib} MiB")

    cfg = lambda: api.nixl_agent_config(enable_prog_thread=False)  # noqa: E731
    t0 = time.perf_counter()
    a, b = api.nixl_agent("gpuA", cfg()), api.nixl_agent("gpuB", cfg())
    print(f"agent creation x2: {time.perf_counter() - t0:.3f} s")
    src = torch.randint(0, 256, (nb, block), dtype=torch.uint8, device=dev)
    dst = torch.zeros(nb, block, dtype=torch.uint8, device=dev)
    a.register_memory(dst)
    b.register_memory(src)
    name = a.add_remote_agent(b.get_agent_metadata())
    name = name.decode() if isinstance(name, bytes) else name
    b.add_remote_agent(a.get_agent_metadata())

    def descs(t):
        return [(t.data_ptr() + i * block, block, 0) for i in range(nb)]

    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", descs(dst), "VRAM")
    remote = a.prep_xfer_dlist(name, descs(src), "VRAM")
    ids = list(range(nb))
    best = None
    for i in range(3):
        dst.zero_()
        torch.cuda.synchronize()
        msg = b"gpu:%d" % i
        t0 = time.perf_counter()
        h = a.make_prepped_xfer("READ", local, ids, remote, ids, msg)
        a.transfer(h)
        drive(a, b, h, msg)
        dt = time.perf_counter() - t0
        a.release_xfer_handle(h)
        best = dt if best is None else min(best, dt)
    torch.cuda.synchronize()
    if not torch.equal(dst, src):
        print("gpu_check: FAILED, bytes differ", file=sys.stderr)
        return 1
    nbytes = nb * block
    t0 = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    tc = time.perf_counter() - t0
    print(f"bytes verified: {nbytes} ({mib} MiB); NIXL READ best {best * 1e3:.2f} ms = "
          f"{nbytes / best / 1e9:.2f} GB/s; torch device copy {nbytes / tc / 1e9:.1f} GB/s")

    lat = []
    for i in range(50):
        m = b"n:%d" % i
        t0 = time.perf_counter()
        a.send_notif(name, m)
        # Tight loop on purpose (latency probe on a many-core GPU box), but bounded.
        while time.perf_counter() - t0 < 5.0:
            got = b.get_new_notifs()
            a.get_new_notifs()
            if any(m in v for v in got.values()):
                break
        else:
            raise SystemExit("gpu_check: notification not delivered within 5 s")
        lat.append(time.perf_counter() - t0)
    lat.sort()
    print(f"notification latency p50 {lat[25] * 1e6:.1f} us, min {lat[0] * 1e6:.1f} us")
    print("gpu_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
