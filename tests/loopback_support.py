"""Two connectors (PlaneDriver + facades) over the loopback transport, on a
hand-driven clock: the setup shared by the loopback tests and the recorded
run behind the sequence-diagram tests."""
from __future__ import annotations

import time

import torch

from kvplane.connector.connector import KVPlaneScheduler, KVPlaneWorker
from kvplane.connector.driver import PlaneDriver
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

BLOCKS, ELEMS = 16, 256


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Side:
    """One engine: its driver, facades and a [BLOCKS, elems] KV cache."""

    def __init__(self, fabric: LoopbackFabric, name, clock, cfg, *, elems: int = ELEMS, **driver_kw):
        self.driver = PlaneDriver(engine_id=name, endpoint=LoopbackEndpoint(fabric, name), config=cfg, clock=clock,
                                  **driver_kw)
        self.sched, self.worker = KVPlaneScheduler(self.driver), KVPlaneWorker(self.driver)
        self.kv = torch.zeros(BLOCKS, elems)
        self.worker.register_kv_caches(self.kv)
        self.sending, self.recving = set(), set()

    def step(self):
        self.worker.start_load_kv(self.sched.build_connector_meta())
        s, r = self.worker.get_finished()
        self.sending |= s
        self.recving |= r

    def held(self):
        """Leak report without the long-lived engine connections (remote_agent)."""
        return [h for h in self.driver.plane.held() if h[0] not in ("remote_engine", "heartbeat")]


def run(clock, sides, seconds, dt=0.05, until=None) -> bool:
    """Step the sides while the clock advances; handshakes are real ZMQ, so
    each step also gives the handshake pool a moment."""
    end = clock.t + seconds
    while clock.t < end:
        for s in sides:
            s.step()
        if until is not None and until():
            return True
        time.sleep(0.002)
        clock.t += dt
    return False
