"""A short recorded loopback run for the sequence-diagram tests: P and D
(PlaneDriver over the loopback transport, real ZMQ handshakes, a
hand-driven clock), two pull requests that D keeps queued for a few
heartbeats, then reads; both planes' event logs as JSONL lines."""
from __future__ import annotations

import time

import torch

from kvplane.connector.connector import KVPlaneScheduler, KVPlaneWorker
from kvplane.connector.driver import PlaneDriver, introduce
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.eventlog import MemoryLog
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

BLOCKS, ELEMS = 16, 64
# An id a label must escape: Mermaid statement, entity and comment
# characters, a quote and markup (wire rules forbid only ':' and ',').
ODD_ID = 'r2;#"%%<b>'
REQUESTS = (("r1", "d1", (1, 2), (5, 6)), (ODD_ID, "d2", (3,), (7,)))


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class _Side:
    def __init__(self, fabric, name, clock, cfg):
        self.driver = PlaneDriver(engine_id=name, endpoint=LoopbackEndpoint(fabric, name), config=cfg, clock=clock)
        self.log = MemoryLog(config=cfg)
        self.driver.plane.recorder = self.log
        self.sched, self.worker = KVPlaneScheduler(self.driver), KVPlaneWorker(self.driver)
        self.kv = torch.zeros(BLOCKS, ELEMS)
        self.worker.register_kv_caches(self.kv)
        self.sending, self.recving = set(), set()

    def step(self):
        self.worker.start_load_kv(self.sched.build_connector_meta())
        s, r = self.worker.get_finished()
        self.sending |= s
        self.recving |= r


def _run(clock, sides, seconds, dt=0.05, until=None) -> bool:
    end = clock.t + seconds
    while clock.t < end:
        for s in sides:
            s.step()
        if until is not None and until():
            return True
        time.sleep(0.002)
        clock.t += dt
    return False


def recorded_pull() -> dict[str, list[str]]:
    """{"P": lines, "D": lines} of the run."""
    fabric, clock = LoopbackFabric(), _Clock()
    cfg = PlaneConfig(kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0)
    p, d = _Side(fabric, "P", clock, cfg), _Side(fabric, "D", clock, cfg)
    introduce(p.driver, d.driver)
    try:
        for pid, did, blocks, _ in REQUESTS:
            p.sched.on_new_request(pid, {"do_remote_decode": True})
            _, params = p.sched.request_finished(pid, blocks)
            d.sched.on_new_request(did, params)
        # Queued on D for a while: heartbeats keep P's leases alive.
        _run(clock, (d, p), 3.0)
        for _, did, blocks, local in REQUESTS:
            n, _ = d.sched.get_num_new_matched_tokens(did, 16 * len(blocks), 0)
            d.sched.update_state_after_alloc(did, local, n)
        done = {pid for pid, *_ in REQUESTS}
        assert _run(clock, (d, p), 5.0, until=lambda: done <= p.sending)
        return {"P": p.log.lines(), "D": d.log.lines()}
    finally:
        for s in (p, d):
            s.worker.shutdown()
