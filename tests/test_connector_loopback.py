"""The connector (PlaneDriver + facades) over the loopback transport, with
deterministic faults a real run cannot produce on demand.  Real ZMQ
handshakes on 127.0.0.1; time is a hand-driven clock.  After every fault
both planes must hold nothing once the dust settles."""
from __future__ import annotations

import pytest
import torch

from connector.connector import KVPlaneScheduler, KVPlaneWorker
from connector.driver import PlaneDriver
from statemachines.config import PlaneConfig
from transport.loopback import LoopbackEndpoint, LoopbackFabric

BLOCKS, ELEMS = 16, 256


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Side:
    def __init__(self, fabric, name, clock, cfg):
        self.driver = PlaneDriver(engine_id=name, endpoint=LoopbackEndpoint(fabric, name), config=cfg, clock=clock)
        self.sched, self.worker = KVPlaneScheduler(self.driver), KVPlaneWorker(self.driver)
        self.kv = torch.zeros(BLOCKS, ELEMS)
        self.worker.register_kv_caches(self.kv)
        self.sending, self.recving = set(), set()

    def step(self):
        self.worker.start_load_kv(self.sched.build_connector_meta())
        s, r = self.worker.get_finished()
        self.sending |= s
        self.recving |= r

    def held(self):
        """Leak report without the long-lived engine connections (remote_agent)."""
        return [h for h in self.driver.plane.held() if h[0] != "remote_engine"]


@pytest.fixture
def pair():
    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0)
    p, d = Side(fabric, "P", clock, cfg), Side(fabric, "D", clock, cfg)
    yield fabric, clock, p, d
    for s in (p, d):
        s.worker.shutdown()


def start_pull(p, d, blocks=(1, 2, 3), local=(5, 6, 7)):
    p.kv[list(blocks)] = torch.arange(len(blocks) * ELEMS, dtype=torch.float32).reshape(len(blocks), ELEMS) + 1
    p.sched.on_new_request("r1", {"do_remote_decode": True})
    _, params = p.sched.request_finished("r1", blocks)
    d.sched.on_new_request("d1", params)
    n, _ = d.sched.get_num_new_matched_tokens("d1", 16 * len(blocks), 0)
    d.sched.update_state_after_alloc("d1", local, n)


def run(clock, sides, seconds, dt=0.05, until=None):
    """Step both sides while the clock advances; handshakes are real ZMQ, so
    each step also gives the handshake pool a moment."""
    import time

    end = clock.t + seconds
    while clock.t < end:
        for s in sides:
            s.step()
        if until is not None and until():
            return True
        time.sleep(0.002)
        clock.t += dt
    return False


def test_pull_copies_the_bytes_and_releases_everything(pair):
    fabric, clock, p, d = pair
    start_pull(p, d)
    assert run(clock, (d, p), 3, until=lambda: "d1" in d.recving and "r1" in p.sending)
    assert torch.equal(d.kv[5:8], p.kv[1:4])
    assert d.held() == [] and p.held() == []


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_transfer_is_reported_once_per_the_load_failure_policy(policy):
    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=6, transfer_timeout=2.0, kv_load_failure_policy=policy)
    p, d = Side(fabric, "P", clock, cfg), Side(fabric, "D", clock, cfg)
    try:
        fabric.fail_transfers(initiator="D")
        start_pull(p, d)
        assert run(clock, (d, p), 3, until=lambda: "d1" in d.recving)
        if policy == "recompute":
            assert d.worker.get_block_ids_with_load_errors() == {5, 6, 7}
            assert d.worker.get_failed_requests() == set()
        else:
            assert d.worker.get_failed_requests() == {"d1"}
            assert d.worker.get_block_ids_with_load_errors() == set()
        # P hears nothing (the READ failed): its lease expires by itself.
        assert run(clock, (d, p), 10, until=lambda: "r1" in p.sending)
        assert p.driver.freed[-1][2] == "expired"
        assert d.held() == [] and p.held() == []
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


def test_hung_transfer_hits_its_deadline_and_is_released(pair):
    fabric, clock, p, d = pair
    fabric.hang_transfers(initiator="D")
    start_pull(p, d)
    assert run(clock, (d, p), 5, until=lambda: "d1" in d.recving)
    assert d.driver.counters["transfers_cancelled"] == 1 and d.driver.xfers == {}
    assert d.driver.failed_recving == set() and d.worker.get_block_ids_with_load_errors() == {5, 6, 7}
    run(clock, (d, p), 10, until=lambda: "r1" in p.sending)
    assert d.held() == [] and p.held() == []


def test_lost_completion_notification_leaves_the_lease_to_expire(pair):
    fabric, clock, p, d = pair
    fabric.drop_notifs(sender="D", receiver="P", prefix=b"r1:")
    start_pull(p, d)
    assert run(clock, (d, p), 3, until=lambda: "d1" in d.recving)
    assert torch.equal(d.kv[5:8], p.kv[1:4])
    assert p.driver.plane.get("lease", "r1").state == "LEASED"
    assert run(clock, (d, p), 10, until=lambda: "r1" in p.sending)
    assert p.driver.freed == [("r1", (1, 2, 3), "expired")]
    assert d.held() == [] and p.held() == []


def test_duplicated_completion_frees_the_blocks_once(pair):
    fabric, clock, p, d = pair
    fabric.duplicate_notifs(sender="D", receiver="P", prefix=b"r1:", copies=3)
    start_pull(p, d)
    assert run(clock, (d, p), 3, until=lambda: "r1" in p.sending)
    run(clock, (d, p), 1)
    assert p.driver.freed == [("r1", (1, 2, 3), "consumed")]
    assert p.driver.plane.stats["unknown_id:lease:ConsumerDone"] == 2
    assert d.held() == [] and p.held() == []


def test_killed_prefill_fails_the_read_and_evicts_the_engine(pair):
    fabric, clock, p, d = pair
    fabric.hang_transfers(initiator="D")  # the READ is in flight when P dies
    start_pull(p, d)
    assert run(clock, (d, p), 2, until=lambda: d.driver.xfers != {})
    fabric.kill("P")
    assert run(clock, (d,), 3, until=lambda: "d1" in d.recving)
    assert d.driver.plane.get("remote_engine", "P") is None
    assert d.driver.counters["engines_evicted"] == 1
    assert d.held() == [] and d.driver.xfers == {}


def test_malformed_notifications_are_counted_not_raised(pair):
    fabric, clock, p, d = pair
    peer = d.driver.endpoint
    peer.add_remote(p.driver.endpoint.local_metadata())
    junk = (b"", b"\xff\xfe", b"no-colon", b"r1:abc", b"PUSH_REG:\x00garbage", b"HB:,", b"nobody:1")
    for msg in junk:
        peer.send_notif("P", msg)
    run(clock, (p,), 0.2)
    # Six are malformed; the well-formed completion for an unknown id is a counted ignore.
    assert p.driver.counters["notifs_malformed"] == 6
    assert p.driver.plane.stats["unknown_id:lease:ConsumerDone"] == 1
    assert p.held() == []


@pytest.mark.parametrize("right_key", [True, False])
def test_curve_authenticated_side_channel(right_key):
    """P's side channel requires CURVE: D handshakes with P's public key; a
    D holding the wrong key gets no metadata, and its request fails cleanly."""
    import zmq

    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=6, handshake_timeout=0.5, handshake_max_attempts=1, recv_timeout=3.0)
    p_keys = zmq.curve_keypair()
    p = Side.__new__(Side)
    p.driver = PlaneDriver(engine_id="P", endpoint=LoopbackEndpoint(fabric, "P"), config=cfg, clock=clock,
                           curve_keypair=p_keys)
    p.sched, p.worker = KVPlaneScheduler(p.driver), KVPlaneWorker(p.driver)
    p.kv = torch.zeros(BLOCKS, ELEMS)
    p.worker.register_kv_caches(p.kv)
    p.sending, p.recving = set(), set()
    d = Side(fabric, "D", clock, cfg)
    try:
        key = p_keys[0] if right_key else zmq.curve_keypair()[0]
        d.driver.learn_engine("P", p.driver.side_channel_url, server_public_key=key)
        start_pull(p, d)
        assert run(clock, (d, p), 5, until=lambda: "d1" in d.recving)
        if right_key:
            assert torch.equal(d.kv[5:8], p.kv[1:4]) and d.driver.counters["handshakes_ok"] == 1
        else:
            # The recv gives up on its own deadline; the handshake (real ZMQ,
            # real seconds) then times out: no metadata was ever served.
            assert d.worker.get_block_ids_with_load_errors() == {5, 6, 7}
            assert run(clock, (d, p), 60, until=lambda: d.driver.counters["handshakes_failed"] == 1)
            assert d.driver.counters["handshakes_ok"] == 0 and p.driver.server.requests_served == 0
        assert d.held() == []
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


def _push_reg(request_id, **extra) -> bytes:
    # Raw bytes: the encoder refuses the bad values a forged PUSH_REG may carry.
    import msgpack
    from transport.wire import PUSH_REG_PREFIX

    reg = {"request_id": request_id, "engine_id": "D", "decode_request_id": "d-" + request_id,
           "block_ids": [5, 6], "host": "127.0.0.1", "port": 1}
    return PUSH_REG_PREFIX + msgpack.packb({**reg, **extra}, use_bin_type=True)


def test_push_reg_deadline_is_parsed_and_a_malformed_one_counted(pair):
    fabric, clock, p, d = pair
    peer = d.driver.endpoint
    peer.add_remote(p.driver.endpoint.local_metadata())
    good = {"none": ({}, None), "float": ({"deadline": 1234.5}, 1234.5), "int": ({"deadline": 1234}, 1234.0),
            "nil": ({"deadline": None}, None)}
    bad = {"str": "soon", "bool": True, "nan": float("nan"), "inf": float("inf"), "list": [1.0]}
    for rid, (extra, _) in good.items():
        peer.send_notif("P", _push_reg(rid, **extra))
    for rid, value in bad.items():
        peer.send_notif("P", _push_reg(rid, deadline=value))
    run(clock, (p,), 0.2)
    for rid, (_, want) in good.items():
        w = p.driver.plane.get("push_write", rid)
        assert w.state == "REGISTERED" and w.remote_deadline == want, rid
    # A registration with a bad deadline is malformed as a whole: no push, counted.
    assert p.driver.counters["notifs_malformed"] == len(bad)
    assert all(p.driver.plane.get("push_write", rid) is None for rid in bad)


@pytest.mark.parametrize("d_ahead", [100.0, -50.0])
def test_hung_push_write_is_cancelled_before_the_decoder_gives_up(d_ahead):
    """Push over the loopback with D's clock ``d_ahead`` s off P's: the
    PUSH_REG carries D's give-up time, P bounds its hung WRITE by it (less the
    margin) and cancels it while D still waits; then D gives up, nothing held."""
    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=6, transfer_timeout=30.0, recv_timeout=8.0, handshake_timeout=2.0,
                      expiry_safety_margin=2.0)
    p = Side(fabric, "P", clock, cfg)
    d = Side(fabric, "D", lambda: clock.t + d_ahead, cfg)
    try:
        fabric.hang_transfers(initiator="P")
        p.sched.on_new_request("r1", {"do_remote_decode": True, "push": True})
        _, params = p.sched.request_finished("r1", (1, 2, 3))
        d.sched.on_new_request("d1", {**params, "push": True})
        n, _ = d.sched.get_num_new_matched_tokens("d1", 48, 0)
        d.sched.update_state_after_alloc("d1", (5, 6, 7), n)
        assert run(clock, (d, p), 3, until=lambda: p.driver.xfers != {})
        gives_up = d.driver.plane.get("decode_request", "d1").deadline  # D's clock
        w = p.driver.plane.get("push_write", "r1")
        assert w.state == "WRITING" and w.remote_deadline == gives_up
        offset = p.driver.plane.get("remote_engine", "D").clock_offset
        assert offset == pytest.approx(d_ahead, abs=0.1)
        assert w.deadline == pytest.approx(gives_up - offset - 2.0)
        assert run(clock, (d, p), 10, until=lambda: p.driver.counters["transfers_cancelled"] == 1)
        assert clock.t + d_ahead < gives_up - 1.0  # cancelled while D still waits (margin 2 s, step 0.05 s)
        assert d.driver.plane.get("decode_request", "d1").state == "AWAITING_PUSH"
        assert run(clock, (d, p), 10, until=lambda: "d1" in d.recving)
        assert d.worker.get_block_ids_with_load_errors() == {5, 6, 7}
        assert run(clock, (d, p), 15, until=lambda: "r1" in p.sending)
        assert d.held() == [] and p.held() == [] and p.driver.xfers == {}
    finally:
        p.worker.shutdown()
        d.worker.shutdown()
