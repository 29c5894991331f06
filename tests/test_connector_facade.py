"""The single-process facades (``connector.connector``): what they owe the
remote at the boundary, over the loopback transport (real ZMQ handshakes on
127.0.0.1, a hand-driven clock)."""
from __future__ import annotations

import pytest

from loopback_support import Clock, Side, run

from kvplane.connector.driver import introduce
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.stats import PROTOCOL_VIOLATION, Anomaly, FailClosed
from kvplane.transport.loopback import LoopbackFabric

LEASE = 6.0


@pytest.fixture
def pair():
    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=LEASE, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0)
    p, d = Side(fabric, "P", clock, cfg), Side(fabric, "D", clock, cfg)
    introduce(p.driver, d.driver)
    yield clock, p, d
    for s in (p, d):
        s.worker.shutdown()


@pytest.mark.parametrize("how", ["request_finished", "abort"])
def test_a_d_request_ended_before_allocation_tells_p_to_free_now(pair, how):
    clock, p, d = pair
    p.sched.on_new_request("r1", {"do_remote_decode": True})
    _, params = p.sched.request_finished("r1", (1, 2))
    d.sched.on_new_request("d1", params)
    if how == "abort":
        d.sched.abort("d1")
    else:
        assert d.sched.request_finished("d1", ()) == (False, None)
    # P frees on D's notify, well before its lease would run out; D awaits nothing.
    assert run(clock, (d, p), LEASE / 3, until=lambda: "r1" in p.sending)
    assert p.driver.freed[-1][2] == "consumed"
    assert "d1" not in d.recving and d.driver.plane.get("decode_request", "d1") is None
    for side in (p, d):
        assert not [k for k in side.driver.plane.stats if isinstance(k, FailClosed) or isinstance(k, Anomaly)
                    and k.what == PROTOCOL_VIOLATION], side.driver.plane.stats
    assert d.held() == [] and p.held() == []
    # Ending it again is a no-op.
    assert d.sched.request_finished("d1", ()) == (False, None)
    d.sched.abort("d1")
