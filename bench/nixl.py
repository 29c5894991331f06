"""Item 4: real NIXL on this machine (two agents in one process, DRAM, UCX on loopback).

Notification round trip, heartbeat -> lease extension through two
PlaneDrivers, READ throughput against a torch copy of the same bytes (the
memory-bandwidth limit of this box), and handshake time (ZMQ + add_remote).
Everything stays in one process: on this box UCX uses shared-memory/cma, so
the throughput numbers are an upper bound for loopback, not a network figure.
"""
from __future__ import annotations

import gc
import time

from .report import Table, ratio
from .timing import median, pct

MIB = 1 << 20


def _spin(cond, polls, timeout: float = 5.0) -> None:
    deadline = time.perf_counter() + timeout
    while not cond():
        for p in polls:
            p()
        if time.perf_counter() > deadline:
            raise TimeoutError("NIXL did not deliver within the bench timeout")


def _pair(nbytes_per_block: int, blocks: int):
    import torch

    from kvplane.transport.nixl_agent import NixlEndpoint

    a, b = NixlEndpoint("bench-P"), NixlEndpoint("bench-D")
    src = torch.empty((blocks, nbytes_per_block), dtype=torch.uint8)
    # A per-block pattern, cheap to write and to check after the READ.
    src.copy_(torch.arange(blocks, dtype=torch.uint8).unsqueeze(1).expand(blocks, nbytes_per_block))
    dst = torch.zeros((blocks, nbytes_per_block), dtype=torch.uint8)
    a.register_kv_cache(src, nbytes_per_block)
    b.register_kv_cache(dst, nbytes_per_block)
    a.add_remote(b.local_metadata())
    b.add_remote(a.local_metadata())
    return a, b, src, dst


def notif_rtt(a, b, iters: int) -> list[float]:
    got = {"a": 0, "b": 0}

    def poll():
        # Without a progress thread the sender must poll too, or UCX never
        # finishes wiring the connection (a first notif is otherwise lost).
        got["a"] += len(a.poll_notifs())
        got["b"] += len(b.poll_notifs())

    for _ in range(20):  # warm-up until one message gets through each way
        nb = got["b"]
        a.send_notif("bench-D", b"warm")
        try:
            _spin(lambda nb=nb: got["b"] > nb, [poll], timeout=0.5)
            na = got["a"]
            b.send_notif("bench-P", b"warm")
            _spin(lambda na=na: got["a"] > na, [poll], timeout=0.5)
            break
        except TimeoutError:
            continue
    out = []
    for i in range(iters + 5):
        na, nb = got["a"], got["b"]
        t0 = time.perf_counter()
        a.send_notif("bench-D", b"ping")
        _spin(lambda nb=nb: got["b"] > nb, [poll])
        b.send_notif("bench-P", b"pong")
        _spin(lambda na=na: got["a"] > na, [poll])
        if i >= 5:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def read_bw(a, b, src, dst, blocks: int, reps: int) -> tuple[list[float], list[float], bool]:
    import torch

    desc = a.describe_cache()
    ids = list(range(blocks))
    nbytes = blocks * src.shape[1]
    nixl_s, copy_s = [], []
    ok = True
    for r in range(reps + 1):
        dst[:blocks].zero_()
        t0 = time.perf_counter()
        h = b.post_read("bench-P", desc, ids, ids, b"done")
        _spin(lambda h=h: b.poll_transfer(h) == "DONE", [a.poll_notifs])
        dt = time.perf_counter() - t0
        b.release(h)
        ok = ok and torch.equal(dst[:blocks], src[:blocks])
        t0 = time.perf_counter()
        dst[:blocks].copy_(src[:blocks])
        dc = time.perf_counter() - t0
        if r > 0:  # the first READ preps descriptor lists
            nixl_s.append(nbytes / dt / 1e9)
            copy_s.append(nbytes / dc / 1e9)
    return nixl_s, copy_s, ok


def coalesced_vs_scattered(reps: int) -> list[tuple[str, int, list[float], bool]]:
    """READ 8 blocks of 128 KiB (1 MiB) contiguous on both sides (coalesced:
    one descriptor) and scattered (every other block: eight), interleaved."""
    import torch

    from kvplane.transport.nixl_agent import NixlEndpoint

    bs = 128 * 1024
    a, b = NixlEndpoint("bench-Pc"), NixlEndpoint("bench-Dc")
    src = torch.randint(0, 256, (16, bs), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst = torch.zeros_like(src)
    try:
        a.register_kv_cache(src, bs)
        b.register_kv_cache(dst, bs)
        a.add_remote(b.local_metadata())
        b.add_remote(a.local_metadata())
        desc = a.describe_cache()
        cases = {"contiguous": list(range(8)), "scattered": list(range(0, 16, 2))}
        got: dict[str, tuple[list[float], int, bool]] = {k: ([], 0, True) for k in cases}
        for r in range(reps + 1):
            for label, ids in cases.items():
                dst.zero_()
                t0 = time.perf_counter()
                h = b.post_read("bench-Pc", desc, ids, ids, b"done")
                _spin(lambda h=h: b.poll_transfer(h) == "DONE", [a.poll_notifs])
                dt = time.perf_counter() - t0
                b.release(h)
                gbps, _n, ok = got[label]
                ok = ok and torch.equal(dst[ids], src[ids])
                if r > 0:
                    gbps.append(8 * bs / dt / 1e9)
                got[label] = (gbps, h.descriptors, ok)
        return [(label, n, xs, ok) for label, (xs, n, ok) in got.items()]
    finally:
        a.close()
        b.close()


def handshake_times(a, iters: int) -> tuple[list[float], list[float], list[float]]:
    import zmq

    from kvplane.transport.handshake import HandshakeServer, build_payload, handshake
    from kvplane.transport.nixl_agent import NixlEndpoint

    payload = build_payload(engine_id="bench-P", compat_hash="bench", tp_rank=0, metadata=a.local_metadata(),
                            cache=a.describe_cache())
    # Authenticated, as the drivers are by default (CURVE, allow-list).
    server_keys, client_keys = zmq.curve_keypair(), zmq.curve_keypair()
    server = HandshakeServer("tcp://127.0.0.1:0", lambda pp, tp: payload, curve_keypair=server_keys,
                             allowed_clients={client_keys[0]: "bench-C"})
    auth = dict(server_public_key=server_keys[0], client_keypair=client_keys)
    server.serve_in_thread(poll_ms=1)
    c = NixlEndpoint("bench-C")
    zmq1, zmq3, add = [], [], []
    try:
        for i in range(iters + 1):
            t0 = time.perf_counter()
            handshake(server.url, "bench-P", "bench", 5.0, samples=1, **auth)
            t1 = time.perf_counter()
            res = handshake(server.url, "bench-P", "bench", 5.0, samples=3, **auth)  # what the Handshaker asks for
            t2 = time.perf_counter()
            name = c.add_remote(res.metadata)
            t3 = time.perf_counter()
            c.remove_remote(name)
            if i > 0:
                zmq1.append((t1 - t0) * 1e3)
                zmq3.append((t2 - t1) * 1e3)
                add.append((t3 - t2) * 1e3)
    finally:
        server.close()
        c.close()
    return zmq1, zmq3, add


def hb_to_extension(iters: int) -> tuple[list[float], int]:
    """D's heartbeat timer fires -> HB: notif over NIXL -> P's plane extends the lease."""
    import torch

    from kvplane.connector.connector import KVPlaneScheduler, KVPlaneWorker
    from kvplane.connector.driver import PlaneDriver, introduce
    from kvplane.statemachines.config import PlaneConfig
    from kvplane.transport.nixl_agent import NixlEndpoint

    cfg = PlaneConfig()
    # Each side's clock is real time plus an offset the bench moves: D jumps one
    # heartbeat interval so its timer is due, P jumps far enough that the
    # extension (now + 2/3 lease) moves the deadline, without the lease expiring.
    off = {"P": 0.0, "D": 0.0}

    def side(name):
        ep = NixlEndpoint(name)
        drv = PlaneDriver(engine_id=name, endpoint=ep, config=cfg, clock=lambda: time.monotonic() + off[name])
        kv = torch.zeros(8, 1024)
        KVPlaneWorker(drv).register_kv_caches(kv)
        return drv, KVPlaneScheduler(drv), kv

    P, Ps, _kp = side("P")
    D, Ds, _kd = side("D")
    introduce(P, D)
    try:
        Ps.on_new_request("r1", {"do_remote_decode": True})
        _, params = Ps.request_finished("r1", [1, 2, 3])
        Ds.on_new_request("d1", params)  # heartbeats start at arrival; the engine handshake starts now
        _spin(lambda: (e := D.plane.get("remote_engine", "P")) is not None and e.state == "CONNECTED",
              [P.step, D.step], timeout=10)
        lease = P.plane.get("lease", "r1")
        out = []
        for i in range(iters + 2):
            before = lease.extensions
            off["D"] += cfg.heartbeat_interval
            off["P"] += cfg.kv_lease_duration - cfg.lease_extension + 1
            t0 = time.perf_counter()
            D.step()
            _spin(lambda before=before: lease.extensions > before, [P.step, D.step])
            if i >= 2:
                out.append((time.perf_counter() - t0) * 1e6)
        return out, lease.extensions
    finally:
        for drv in (P, D):
            drv.close()
            drv.endpoint.close()


def run(quick: bool) -> list[Table]:
    try:
        import torch  # noqa: F401

        from kvplane.transport.nixl_agent import NixlEndpoint  # noqa: F401
    except ImportError as exc:
        t = Table("nixl.skipped", "Real NIXL", ["item", "result"])
        t.add("NIXL", f"skipped: {exc}")
        return [t]
    import torch

    torch.set_num_threads(1)  # the box has 2 cores; NIXL polling needs the other
    iters = 50 if quick else 300
    lat = Table("nixl.latency", "Real NIXL latencies (two agents, one process, UCX loopback, no progress thread)",
                ["measurement", "median", "p90", "p99", "unit", "samples"])
    a, b, src, dst = _pair(MIB, 256)
    try:
        rtt = notif_rtt(a, b, iters)
        lat.add("notification round trip (send_notif -> poll -> reply -> poll)", median(rtt), pct(rtt, 0.9),
                pct(rtt, 0.99), "µs", len(rtt), what="notif_rtt_us", median=median(rtt), p99=pct(rtt, 0.99))
        hb, ext = hb_to_extension(30 if quick else 200)
        lat.add("heartbeat -> lease extension (D.step fires HB, P.step extends)", median(hb), pct(hb, 0.9),
                pct(hb, 0.99), "µs", len(hb), what="hb_to_extension_us", median=median(hb), p99=pct(hb, 0.99))
        z1, z3, add = handshake_times(a, 10 if quick else 50)
        for label, xs, key in (("handshake, ZMQ request/reply, 1 clock sample", z1, "zmq1_ms"),
                               ("handshake, ZMQ, 3 clock samples (as the Handshaker)", z3, "zmq3_ms"),
                               ("add_remote (NIXL metadata load)", add, "add_remote_ms")):
            lat.add(label, median(xs), pct(xs, 0.9), pct(xs, 0.99), "ms", len(xs), what=key, median=median(xs))
        lat.add("handshake total (ZMQ 3 samples + add_remote)", median(z3) + median(add), None, None, "ms",
                len(z3), what="handshake_total_ms", median=median(z3) + median(add))
        lat.notes += [
            f"heartbeat -> extension: each sample moves D's clock one heartbeat interval and P's past the extension "
            f"point, so every D.step sends one HB: batch and every sample extends the lease ({ext} extensions); it "
            "includes D's whole step (timers, poll) and P's polling loop (notif decode, plane.handle).",
            "Handshake: authenticated (CURVE, allow-list; a fresh REQ socket per attempt, so each pays the CURVE "
            "key exchange); HandshakeServer answered by a thread polling every 1 ms (the drivers poll once per "
            "step instead, which adds up to one step of latency).",
        ]
        bw = Table("nixl.read", "Real NIXL READ throughput vs a torch copy of the same bytes (DRAM -> DRAM)",
                   ["size", "NIXL READ GB/s", "torch copy_ GB/s", "NIXL / torch", "bytes verified", "reps"])
        for blocks, reps in ((1, 20 if quick else 200), (256, 2 if quick else 8)):
            n, c, ok = read_bw(a, b, src, dst, blocks, reps)
            bw.add(f"{blocks} MiB", median(n), median(c), ratio(median(n), median(c)), "yes" if ok else "NO", reps,
                   size_mib=blocks, nixl_gbps=median(n), torch_gbps=median(c), verified=ok)
        for label, ndesc, xs, ok in coalesced_vs_scattered(20 if quick else 200):
            bw.add(f"1 MiB as 8 x 128 KiB blocks, {label} ({ndesc} descriptor{'s' if ndesc > 1 else ''})",
                   median(xs), None, None, "yes" if ok else "NO", len(xs), size_mib=1, blocks=8, descriptors=ndesc,
                   nixl_gbps=median(xs), verified=ok)
        bw.notes += [
            "8 x 128 KiB: contiguous block ids are coalesced into one descriptor, every other block stays eight "
            "(descriptors.plan_transfer); interleaved rounds.",
            "READ time is post -> DONE polled by the reader, with the passive side polling too (no progress thread); "
            "1 MiB = one block, 256 MiB = 256 contiguous blocks of 1 MiB in one transfer (one descriptor). Median of the reps after one "
            "warm-up READ.",
            "torch copy_ of the same tensor slices on one thread: the memory-bandwidth limit of this box.",
        ]
    finally:
        a.close()
        b.close()
        del src, dst
        gc.collect()
    return [lat, bw]
