"""A prefill engine that restarts under the same engine id, over real NIXL
and real ZMQ in one process.

D still holds the old incarnation's NIXL agent when the new P's params
arrive.  The params name the new incarnation (its driver's token, also in
its handshake replies), so D drops the old agent, handshakes afresh and
reads the new P's blocks; the new P frees them at once.  A P that dies
before D reads: the READ fails (the agent is gone), D recomputes, and D's
word to P (a fresh handshake) fails too; D holds nothing either way.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

from kvplane.connector.connector import KVPlaneScheduler, KVPlaneWorker  # noqa: E402
from kvplane.connector.driver import PlaneDriver, introduce  # noqa: E402
from kvplane.statemachines.config import PlaneConfig  # noqa: E402

CFG = PlaneConfig(kv_lease_duration=30, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0,
                  kv_load_failure_policy="fail")


class Node:
    def __init__(self, engine_id: str):
        from kvplane.transport.nixl_agent import NixlEndpoint

        self.driver = PlaneDriver(engine_id=engine_id, endpoint=NixlEndpoint(engine_id), config=CFG)
        self.sched, self.worker = KVPlaneScheduler(self.driver), KVPlaneWorker(self.driver)
        self.kv = torch.zeros(8, 1024)
        self.worker.register_kv_caches(self.kv)
        self.sending: set = set()
        self.recving: set = set()
        self.failed: set = set()
        self.closed = False

    def step(self) -> None:
        self.worker.start_load_kv(self.sched.build_connector_meta())
        s, r = self.worker.get_finished()
        self.sending |= s
        self.recving |= r
        self.failed |= self.worker.get_failed_requests()

    def held(self) -> list:
        return [h for h in self.driver.plane.held() if h[0] not in ("remote_engine", "heartbeat")]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.worker.shutdown()


def spin(until, *nodes: Node, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for n in nodes:
            n.step()
        if until():
            return True
        time.sleep(0.002)
    return False


def pull(p: Node, d: Node, rid: str, did: str) -> None:
    p.kv[[1, 2, 3]] = torch.rand(3, p.kv.shape[1])
    p.sched.on_new_request(rid, {"do_remote_decode": True})
    _, params = p.sched.request_finished(rid, (1, 2, 3))
    d.sched.on_new_request(did, params)
    n, _ = d.sched.get_num_new_matched_tokens(did, 48, 0)
    d.sched.update_state_after_alloc(did, (5, 6, 7), n)


@pytest.fixture
def nodes():
    made: list[Node] = []

    def make(name: str) -> Node:
        made.append(Node(name))
        return made[-1]

    yield make
    for n in made:
        n.close()


@pytest.mark.parametrize("comes_back", [True, False])
def test_a_restarted_prefill_is_read_and_frees_its_lease(nodes, comes_back):
    d, p1 = nodes("D"), nodes("P")
    introduce(p1.driver, d.driver)
    pull(p1, d, "r1", "d1")
    assert spin(lambda: "d1" in d.recving and "r1" in p1.sending, d, p1, timeout=10)
    assert torch.equal(d.kv[5:8], p1.kv[1:4])
    assert d.driver.plane.get("remote_engine", "P").state == "CONNECTED"
    # D's READ was made from P's prepared descriptor list (transport/prepped.py).
    prepped = d.driver.endpoint.prepped
    assert prepped.live("P") == 1
    (old_list,) = prepped.handles("P")

    if comes_back:
        # P restarts under the same engine id (a new NIXL agent, a new port)
        # and grants a lease; D still holds the old agent.
        p1.close()
        p = nodes("P")
        introduce(p.driver, d.driver)
        pull(p, d, "r2", "d2")
    else:
        # P grants a lease and dies before D reads it.
        p = p1
        pull(p, d, "r2", "d2")
        p.close()
    live = [n for n in (d, p) if not n.closed]
    t0 = time.monotonic()
    assert spin(lambda: "d2" in d.recving, *live, timeout=10)
    if comes_back:
        assert d.failed == set()  # read from the new incarnation, not recomputed
        assert torch.equal(d.kv[5:8], p.kv[1:4])
        assert d.driver.counters["farewells"] == 0
        # The old incarnation's list was released when its agent was dropped;
        # the new one's READ was made from a fresh list.
        assert old_list._released
        (new_list,) = prepped.handles("P")
        assert new_list is not old_list and not new_list._released
        assert prepped.release_failures == 0
        # The new P hears of it at once, not at the lease's expiry (30 s).
        assert spin(lambda: "r2" in p.sending, *live, timeout=2 * CFG.handshake_timeout)
        assert p.driver.freed == [("r2", (1, 2, 3), "consumed")]
        assert time.monotonic() - t0 < 2 * CFG.handshake_timeout < CFG.kv_lease_duration
        assert p.held() == []
        assert d.held() == []
        return
    assert d.failed == {"d2"}  # the READ failed: D recomputes
    # D holds nothing once its handshake for its word to P failed.
    assert spin(lambda: d.driver.plane.get("decode_request", "d2#farewell") is None, *live,
                timeout=2 * CFG.handshake_timeout)
    assert d.held() == [] and d.driver.counters["farewells"] == 1
    # An engine evicted: its agent and its prepared list went together.
    assert d.driver.counters["engines_evicted"] == 1 and "P" not in d.driver.agents
    assert old_list._released and prepped.live("P") == 0
