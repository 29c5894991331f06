"""The connector (PlaneDriver + facades) over the loopback transport, with
deterministic faults a real run cannot produce on demand.  Real ZMQ
handshakes on 127.0.0.1; time is a hand-driven clock.  After every fault
both planes must hold nothing once the dust settles."""
from __future__ import annotations

import pytest
import torch

from loopback_support import ELEMS, Clock, Side, run

from kvplane.connector.driver import introduce
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.stats import PROTOCOL_VIOLATION, UNKNOWN_ID, Anomaly, FailClosed
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

@pytest.fixture
def pair():
    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0)
    p, d = Side(fabric, "P", clock, cfg), Side(fabric, "D", clock, cfg)
    introduce(p.driver, d.driver)
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
    introduce(p.driver, d.driver)
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
    fabric.drop_notifs(sender="D", receiver="P", prefix=b"r1-")  # the lease's exported name
    start_pull(p, d)
    assert run(clock, (d, p), 3, until=lambda: "d1" in d.recving)
    assert torch.equal(d.kv[5:8], p.kv[1:4])
    assert p.driver.plane.get("lease", "r1").state == "LEASED"
    assert run(clock, (d, p), 10, until=lambda: "r1" in p.sending)
    assert p.driver.freed == [("r1", (1, 2, 3), "expired")]
    assert d.held() == [] and p.held() == []


def test_duplicated_completion_frees_the_blocks_once(pair):
    fabric, clock, p, d = pair
    fabric.duplicate_notifs(sender="D", receiver="P", prefix=b"r1-", copies=3)
    start_pull(p, d)
    assert run(clock, (d, p), 3, until=lambda: "r1" in p.sending)
    run(clock, (d, p), 1)
    assert p.driver.freed == [("r1", (1, 2, 3), "consumed")]
    # The copies are counted ignores: of a lease that is gone, or (polled
    # after it was freed) of a name that died with it.
    assert (p.driver.plane.stats[Anomaly("unknown_id", "lease", "ConsumerDone")]
            + p.driver.counters["notifs_unknown_lease"]) == 2
    assert d.held() == [] and p.held() == []


def test_killed_prefill_fails_the_read_and_evicts_the_engine(pair):
    fabric, clock, p, d = pair
    fabric.hang_transfers(initiator="D")  # the READ is in flight when P dies
    start_pull(p, d)
    assert run(clock, (d, p), 2, until=lambda: d.driver.xfers != {})
    fabric.kill("P")
    assert run(clock, (d,), 3, until=lambda: "d1" in d.recving)
    assert d.driver.counters["engines_evicted"] == 1
    # D then tries to tell P (it may have restarted: test_nixl_restart.py);
    # P is not even stepped, so that handshake times out and the engine backs off.
    assert d.driver.counters["farewells"] == 1
    assert run(clock, (d,), 3, until=lambda: d.driver.plane.get("decode_request", "d1#farewell") is None)
    assert d.driver.plane.get("remote_engine", "P").state == "HANDSHAKE_FAILED"
    assert d.held() == [] and d.driver.xfers == {}


def test_malformed_notifications_are_counted_not_raised(pair):
    fabric, clock, p, d = pair
    peer = d.driver.endpoint
    peer.add_remote(p.driver.endpoint.local_metadata())
    junk = (b"", b"\xff\xfe", b"no-colon", b"r1:abc", b"PUSH_REG:\x00garbage", b"HB:,", b"nobody:1")
    for msg in junk:
        peer.send_notif("P", msg)
    run(clock, (p,), 0.2)
    # Six are malformed; the well-formed completion for an unknown lease is a counted ignore.
    assert p.driver.counters["notifs_malformed"] == 6
    assert p.driver.counters["notifs_unknown_lease"] == 1
    assert p.held() == []


@pytest.mark.parametrize("case", ["allowed", "no_key", "not_allow_listed", "wrong_server_key"])
def test_side_channel_is_authenticated_by_default(case):
    """Real ZMQ, default drivers (CURVE with an allow-list): D gets P's
    metadata only when P trusts D's key and D holds P's.  Without P's key D
    does not even try; with a key P does not allow (it knows P's public key),
    or the wrong key for P, no metadata is served; the recv fails cleanly."""
    import zmq

    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=6, handshake_timeout=2.0, handshake_max_attempts=1, recv_timeout=3.0)
    p, d = Side(fabric, "P", clock, cfg), Side(fabric, "D", clock, cfg)
    try:
        if case == "allowed":
            introduce(p.driver, d.driver)
        elif case == "not_allow_listed":
            d.driver.trust_peer("P", p.driver.public_key)
        elif case == "wrong_server_key":
            p.driver.trust_peer("D", d.driver.public_key)
            d.driver.trust_peer("P", zmq.curve_keypair()[0])
        start_pull(p, d)
        assert run(clock, (d, p), 5, until=lambda: "d1" in d.recving)
        if case == "allowed":
            assert torch.equal(d.kv[5:8], p.kv[1:4]) and d.driver.counters["handshakes_ok"] == 1
            assert p.driver.server.served_by_client == {"D": 3}  # 3 clock samples, User-Id from the allow-list
        else:
            assert d.worker.get_block_ids_with_load_errors() == {5, 6, 7}
            assert run(clock, (d, p), 60, until=lambda: d.driver.counters["handshakes_failed"]
                       + d.driver.counters["handshakes_refused_no_key"] >= 1)
            assert d.driver.counters["handshakes_ok"] == 0 and p.driver.server.requests_served == 0
            assert d.driver.agents == {}
            if case == "no_key":
                assert d.driver.counters["handshakes_refused_no_key"] >= 1 and d.driver.counters["handshakes_started"] == 0
            if case == "not_allow_listed":
                assert p.driver.server.auth_refused >= 1
        assert d.held() == []
        run(clock, (d, p), 10, until=lambda: "r1" in p.sending)
        assert p.held() == []
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


def _push_reg(request_id, engine_id="D", **extra) -> bytes:
    # Raw bytes: the encoder refuses the bad values a forged PUSH_REG may carry.
    import msgpack
    from kvplane.transport.wire import PUSH_REG_PREFIX

    reg = {"request_id": request_id, "engine_id": engine_id, "decode_request_id": "d-" + request_id,
           "block_ids": [5, 6], "host": "127.0.0.1", "port": 1}
    return PUSH_REG_PREFIX + msgpack.packb({**reg, **extra}, use_bin_type=True)


def _lease(p, rid, blocks=(1,)) -> str:
    """Grant P a lease on ``rid``; returns the name P exported for it."""
    p.sched.on_new_request(rid, {"do_remote_decode": True})
    _, params = p.sched.request_finished(rid, blocks)
    return params["remote_request_id"]


def test_push_reg_deadline_is_parsed_and_a_malformed_one_counted(pair):
    fabric, clock, p, d = pair
    peer = d.driver.endpoint
    peer.add_remote(p.driver.endpoint.local_metadata())
    good = {"none": ({}, None), "float": ({"deadline": 1234.5}, 1234.5), "int": ({"deadline": 1234}, 1234.0),
            "nil": ({"deadline": None}, None)}
    bad = {"str": "soon", "bool": True, "nan": float("nan"), "inf": float("inf"), "list": [1.0]}
    for rid, (extra, _) in good.items():
        peer.send_notif("P", _push_reg(_lease(p, rid), **extra))
    for rid, value in bad.items():
        peer.send_notif("P", _push_reg(_lease(p, rid), deadline=value))
    run(clock, (p,), 0.2)
    for rid, (_, want) in good.items():
        w = p.driver.plane.get("push_write", rid)
        assert w.state == "REGISTERED" and w.remote_deadline == want, rid
    # A registration with a bad deadline is malformed as a whole: no push, counted.
    assert p.driver.counters["notifs_malformed"] == len(bad)
    assert all(p.driver.plane.get("push_write", rid) is None for rid in bad)


def _start_hung_push(fabric, clock, p, d) -> None:
    """P leases r1 for a push; D (d1) registers; P's WRITE hangs in flight."""
    fabric.hang_transfers(initiator="P")
    p.sched.on_new_request("r1", {"do_remote_decode": True, "push": True})
    _, params = p.sched.request_finished("r1", (1, 2, 3))
    d.sched.on_new_request("d1", {**params, "push": True})
    n, _ = d.sched.get_num_new_matched_tokens("d1", 48, 0)
    d.sched.update_state_after_alloc("d1", (5, 6, 7), n)
    assert run(clock, (d, p), 3, until=lambda: p.driver.xfers != {})


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
    introduce(p.driver, d.driver)
    try:
        _start_hung_push(fabric, clock, p, d)
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


# ----------------------------------------------- forged messages (issue 9, items 6 and 7)
def _agent(fabric, p, name, trust=True):
    """Another NIXL agent that holds P's metadata; ``trust``: P trusts its engine."""
    import zmq

    ep = LoopbackEndpoint(fabric, name)
    ep.add_remote(p.driver.endpoint.local_metadata())
    if trust:
        p.driver.trust_peer(name, zmq.curve_keypair()[0])
    return ep


def test_a_forged_completion_frees_nothing(pair):
    """Only the lease's bound consumer, naming it by its exported name with
    the planned count, frees it; every forgery is a counted ignore."""
    fabric, clock, p, d = pair
    name = _lease(p, "r1", (1, 2))
    assert name.startswith("r1-") and len(name) == len("r1-") + 32
    stranger, other = _agent(fabric, p, "S", trust=False), _agent(fabric, p, "X")
    raw_d = d.driver.endpoint
    raw_d.add_remote(p.driver.endpoint.local_metadata())
    stranger.send_notif("P", f"{name}:1".encode())  # not an engine P knows
    other.send_notif("P", b"r1:1")  # a guessed id, not the exported name
    raw_d.send_notif("P", f"HB:{name}".encode())  # D binds the lease
    other.send_notif("P", f"{name}:1".encode())  # the right name, the wrong sender
    raw_d.send_notif("P", f"{name}:2".encode())  # the right sender, a count P never planned
    run(clock, (p,), 0.2)
    c = p.driver.counters
    assert (c["notifs_unknown_sender"], c["notifs_unknown_lease"], c["refused_foreign_sender"],
            c["refused_wrong_consumer_count"]) == (1, 1, 1, 1)
    lease = p.driver.plane.get("lease", "r1")
    assert lease.state == "LEASED" and lease.bound == frozenset({"D"}) and p.driver.freed == []
    raw_d.send_notif("P", f"{name}:1".encode())
    run(clock, (p,), 0.2)
    assert p.driver.freed == [("r1", (1, 2), "consumed")] and p.held() == []


def test_a_forged_heartbeat_extends_nothing(pair):
    """A trusted engine that is not the lease's consumer heartbeats it every
    second (it even knows the name): the lease still expires one extension
    after its consumer's last heartbeat."""
    fabric, clock, p, d = pair
    cfg = p.driver.config
    granted = clock.t
    name = _lease(p, "r1")
    other, raw_d = _agent(fabric, p, "X"), d.driver.endpoint
    raw_d.add_remote(p.driver.endpoint.local_metadata())
    raw_d.send_notif("P", f"HB:{name}".encode())
    run(clock, (p,), 0.1)
    last_real = clock.t
    assert p.driver.plane.get("lease", "r1").bound == frozenset({"D"})
    forged = 0
    while "r1" not in p.sending and clock.t < last_real + 4 * cfg.kv_lease_duration:
        other.send_notif("P", f"HB:{name}".encode())
        forged += 1
        run(clock, (p,), 1.0)
    assert p.driver.freed == [("r1", (1,), "expired")]
    # Expired as D's heartbeat left it (the clock steps 0.05 s; a forged beat comes each second).
    assert clock.t <= max(granted + cfg.kv_lease_duration, last_real + cfg.lease_extension) + 1.1
    assert p.driver.counters["refused_foreign_sender"] in (forged - 1, forged)  # the last may land after expiry
    assert p.held() == []


def test_push_reg_only_from_the_engine_it_names_for_a_lease_p_holds(pair):
    fabric, clock, p, d = pair
    name, bound_name = _lease(p, "r1"), _lease(p, "r2")
    stranger, other = _agent(fabric, p, "S", trust=False), _agent(fabric, p, "X")
    raw_d = d.driver.endpoint
    raw_d.add_remote(p.driver.endpoint.local_metadata())
    d_url = d.driver.side_channel_url
    host, port = d_url[len("tcp://"):].rsplit(":", 1)
    raw_d.send_notif("P", f"HB:{bound_name}".encode())  # r2 is D's
    run(clock, (p,), 0.1)
    stranger.send_notif("P", _push_reg(name, engine_id="S"))  # unknown agent
    other.send_notif("P", _push_reg(name, engine_id="D", host="10.6.6.6"))  # X repoints D
    raw_d.send_notif("P", _push_reg("r1", engine_id="D"))  # a lease name P never gave out
    raw_d.send_notif("P", _push_reg(_lease(d, "held-by-d"), engine_id="D"))  # not P's lease either
    other.send_notif("P", _push_reg(bound_name, engine_id="X"))  # r2 is bound to D
    run(clock, (p,), 0.2)
    assert p.driver.counters["notifs_unknown_sender"] == 1 and p.driver.counters["push_regs_refused"] == 4
    assert "D" not in p.driver.directory and "X" not in p.driver.directory
    assert p.driver.plane.live()["push_write"] == 0
    raw_d.send_notif("P", _push_reg(name, engine_id="D", host=host, port=int(port)))
    run(clock, (p,), 0.1)
    assert p.driver.directory["D"] == d_url
    assert p.driver.plane.get("push_write", "r1").state == "REGISTERED"


def test_a_forged_push_completion_is_refused():
    """D waits for P's WRITE (hung); another engine D trusts says it is done:
    refused, D still waits, then gives up on its own deadline."""
    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=6, transfer_timeout=30.0, recv_timeout=8.0, handshake_timeout=2.0,
                      expiry_safety_margin=2.0)
    p, d = Side(fabric, "P", clock, cfg), Side(fabric, "D", clock, cfg)
    introduce(p.driver, d.driver)
    try:
        _start_hung_push(fabric, clock, p, d)
        other = _agent(fabric, d, "X")
        other.send_notif("D", b"d1:1")
        run(clock, (d,), 0.1)
        assert d.driver.counters["refused_push_done_foreign_sender"] == 1
        assert d.driver.plane.get("decode_request", "d1").state == "AWAITING_PUSH"
        assert run(clock, (d, p), 10, until=lambda: "d1" in d.recving)
        assert d.worker.get_block_ids_with_load_errors() == {5, 6, 7}  # failed, not "done"
        assert run(clock, (d, p), 40, until=lambda: "r1" in p.sending)
        assert d.held() == [] and p.held() == []
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


def test_insecure_drivers_talk_without_keys():
    """The opt-out for tests and benchmarks: plaintext side channel, any sender."""
    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0)
    p, d = Side(fabric, "P", clock, cfg, insecure=True), Side(fabric, "D", clock, cfg, insecure=True)
    try:
        assert p.driver.public_key is None and p.driver.server.insecure
        start_pull(p, d)
        assert run(clock, (d, p), 3, until=lambda: "d1" in d.recving and "r1" in p.sending)
        assert torch.equal(d.kv[5:8], p.kv[1:4]) and d.held() == [] and p.held() == []
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


@pytest.mark.parametrize("finish_first", [True, False])
def test_notify_only_full_prefix_hit_runs_at_once_and_releases_p(pair, finish_first):
    """Nobody awaits a notify-only recv: the scheduler runs and finishes the
    request at once (before or after the notify went out), its machine takes
    that without a protocol error or a hold, and the notify still frees P's lease."""
    fabric, clock, p, d = pair
    p.sched.on_new_request("r1", {"do_remote_decode": True})
    _, params = p.sched.request_finished("r1", (1, 2))
    d.sched.on_new_request("d1", params)
    d.sched.update_state_after_alloc("d1", (), 0, awaiting=False)
    if not finish_first:
        assert run(clock, (d, p), 3, until=lambda: d.driver.plane.get("decode_request", "d1") is None)
    d.sched.request_running("d1")
    assert d.sched.request_finished("d1", (), hold_for_next_turn=True) == (False, None)
    assert run(clock, (d, p), 3, until=lambda: "r1" in p.sending)
    assert p.driver.freed[-1][2] == "consumed"
    assert "d1" not in d.recving
    for side in (p, d):
        assert not [k for k in side.driver.plane.stats if isinstance(k, FailClosed) or isinstance(k, Anomaly)
                    and k.what in (UNKNOWN_ID, PROTOCOL_VIOLATION)], side.driver.plane.stats
    assert d.held() == [] and p.held() == []
