"""ControlPlane robustness: unknown, duplicate and late events are counted and
never raise; protocol errors fail the machine closed; stale timers are
skipped; timers fire in deadline order."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_support import connect, held_by, names, new_request, of_type, plane, run_timers
from kvplane.statemachines import actions as A
from kvplane.statemachines.recv_failure import RecvFailure
from kvplane.statemachines import events as E
from kvplane.statemachines.base import TimerFired
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.plane import ControlPlane
from kvplane.statemachines.stats import Anomaly, FailClosed, Final, Ignored, SourceEnded

P0 = "P0"


def reading(p: ControlPlane, rid="r1", peer="p1", now=0.0):
    p.handle(new_request(rid, P0, peer), now)
    connect(p, P0, now)
    p.handle(E.BlocksAllocated(request_id=rid, block_ids=(1, 2), num_remote_tokens=32), now)
    out = p.handle(E.StartLoad(request_id=rid), now)
    assert names(out) == ["PostRead"]
    return out[0]


# ----------------------------------------------------------- unknown and late
def test_unknown_ids_are_counted_anomalies():
    p = plane()
    assert p.handle(E.ReadDone(request_id="nope"), 1.0) == []
    assert p.handle(E.LeaseHeartbeat(request_id="nope"), 1.0) == []
    assert p.handle(E.ConsumerDone(request_id="nope", consumer="D", expected_consumers=1), 1.0) == []
    assert p.handle(TimerFired("lease", "nope", 1.0), 1.0) == []
    assert p.handle(E.EngineActivity(engine_id="nope"), 1.0) == []
    assert p.handle(E.EngineReady(kind="bogus", request_id="x", engine_id=P0), 1.0) == []
    assert p.stats[Anomaly("unknown_id", "decode_request", "ReadDone")] == 1
    assert p.stats[Anomaly("unknown_id", "lease", "LeaseHeartbeat")] == 1
    assert p.stats[Anomaly("unknown_id", "lease", "ConsumerDone")] == 1
    assert p.stats[Anomaly("unknown_id", "lease", "TimerFired")] == 1
    assert p.stats[Anomaly("unknown_id", "remote_engine", "EngineActivity")] == 1
    assert p.stats[Anomaly("unknown_kind", "bogus", "EngineReady")] == 1
    assert [a[0] for a in p.anomalies] == ["unknown_id"] * 5 + ["unknown_kind"]
    assert p.anomalies[0][1:4] == ("decode_request", "nope", "ReadDone")
    # No empty machines were created for them.
    assert sum(p.live().values()) == 0


def test_duplicate_and_late_events_are_counted_ignores():
    p = plane()
    reading(p)
    assert p.handle(new_request("r1", P0, "p1"), 1.0) == []  # duplicate on_new_request
    assert p.handle(E.StartLoad(request_id="r1"), 1.0) == []  # the worker repeats start_load_kv
    assert p.stats[Ignored("decode_request", "READING", "NewRequest")] == 1
    assert p.stats[Ignored("decode_request", "READING", "StartLoad")] == 1
    out = p.handle(E.ReadDone(request_id="r1"), 2.0)
    assert of_type(out, A.ReportRecv) == [A.ReportRecv("r1", True, ())]
    # Late duplicate completion and late failure: ignored, no second report.
    assert p.handle(E.ReadDone(request_id="r1"), 3.0) == []
    assert p.handle(E.ReadFailed(request_id="r1"), 3.0) == []
    assert p.stats[Ignored("decode_request", "RECV_DONE", "ReadDone")] == 1
    assert p.stats[Ignored("decode_request", "RECV_DONE", "ReadFailed")] == 1
    # After the request is gone, events for it are unknown ids.
    p.handle(E.RequestRunning(request_id="r1"), 4.0)
    p.handle(E.RequestFinished(request_id="r1"), 5.0)
    assert p.get("decode_request", "r1") is None
    assert p.handle(E.ReadDone(request_id="r1"), 6.0) == []
    assert p.stats[Anomaly("unknown_id", "decode_request", "ReadDone")] == 1
    assert p.stats[Final("decode_request", "RELEASED")] == 1


def test_duplicate_consumer_notification_cannot_free_blocks_early():
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(1,), expected_consumers=2), 0.0)
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="D1", expected_consumers=2), 1.0) == []
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="D1", expected_consumers=2), 1.5) == []
    assert p.get("lease", "p1").state == "PARTIALLY_READ"
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="D2", expected_consumers=2), 2.0) == [
        A.FreeBlocks("p1", (1,), "consumed")]
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="D2", expected_consumers=2), 3.0) == []
    assert p.stats[Anomaly("unknown_id", "lease", "ConsumerDone")] == 1


# ------------------------------------------------------------- fail closed
def test_protocol_error_fails_the_decode_request_closed():
    p = plane()
    reading(p)
    assert p.get("remote_engine", P0).refs >= {("decode_request", "r1")}
    out = p.handle(E.RequestFinished(request_id="r1"), 1.0)  # finished before its recv was reported
    assert out == [A.ReleaseXfer("r1", True), A.ReportRecv("r1", False, (1, 2), RecvFailure.ABORTED)]
    assert p.get("decode_request", "r1") is None
    assert p.stats[Anomaly("protocol_violation", "decode_request", "RequestFinished")] == 1
    assert p.stats[FailClosed("decode_request")] == 1
    assert p.stats[Final("decode_request", "ABORTED")] == 1
    what, kind, key, event, detail = p.anomalies[-1]
    assert (what, kind, key, event) == ("protocol_violation", "decode_request", "r1", "RequestFinished")
    assert "before its recv was reported" in detail
    # Its engine reference and heartbeat are gone too.
    assert ("decode_request", "r1") not in p.get("remote_engine", P0).refs
    assert p.heartbeats.registered(P0) == ()
    assert held_by(p, "r1") == []


def test_a_completion_with_the_wrong_count_is_refused_not_obeyed():
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(1, 2), expected_consumers=1), 0.0)
    # The notif disagrees with the planned consumer count: refused, nothing freed.
    out = p.handle(E.ConsumerDone(request_id="p1", consumer="d", expected_consumers=3), 1.0)
    assert out == [A.RefuseWrongCount("p1", "d", "wrong_consumer_count")]
    assert p.get("lease", "p1").state == "LEASED" and p.get("lease", "p1").consumers == frozenset()
    # The planned consumer's own completion still frees the blocks, once.
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="d", expected_consumers=1), 2.0) == [
        A.FreeBlocks("p1", (1, 2), "consumed")]
    assert p.held() == []


def test_a_lease_is_bound_to_its_consumers():
    """The first expected_consumers senders bind the lease; a stranger's
    heartbeat extends nothing and its completion frees nothing."""
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(1,), expected_consumers=1), 0.0)
    p.handle(E.LeaseHeartbeat(request_id="p1", sender="D"), 1.0)
    lease = p.get("lease", "p1")
    expiry = lease.expiry
    assert lease.bound == frozenset({"D"})
    assert p.handle(E.LeaseHeartbeat(request_id="p1", sender="X"), 5.0) == [
        A.RefuseForeignSender("p1", "X", "foreign_sender")]
    assert lease.expiry == expiry
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="X", expected_consumers=1), 5.0) == [
        A.RefuseForeignSender("p1", "X", "foreign_sender")]
    assert p.get("lease", "p1").state == "LEASED"
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="D", expected_consumers=1), 5.0) == [
        A.FreeBlocks("p1", (1,), "consumed")]


def test_two_planned_consumers_bind_two_senders():
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(1,), expected_consumers=2), 0.0)
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="D1", expected_consumers=2), 1.0) == []
    assert p.handle(E.LeaseHeartbeat(request_id="p1", sender="D2"), 1.0) == []
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="D3", expected_consumers=2), 2.0) == [
        A.RefuseForeignSender("p1", "D3", "foreign_sender")]
    assert p.handle(E.ConsumerDone(request_id="p1", consumer="D2", expected_consumers=2), 3.0) == [
        A.FreeBlocks("p1", (1,), "consumed")]


def test_a_second_grant_merges_blocks_and_frees_each_once():
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(1, 2)), 0.0)
    assert p.handle(E.LeaseGranted(request_id="p1", block_ids=(2, 3)), 1.0) == []
    out = p.handle(E.ConsumerDone(request_id="p1", consumer="d", expected_consumers=1), 2.0)
    assert out == [A.FreeBlocks("p1", (1, 2, 3), "consumed")]
    assert p.held() == []


def test_a_repeated_handshake_keeps_the_engine_and_its_best_clock_sample():
    p = plane()
    reading(p)
    engine = p.get("remote_engine", P0)
    best = (engine.clock_offset, engine.best_rtt)
    # A slower sample never replaces the best one; a faster one does.
    assert p.handle(E.HandshakeOk(engine_id=P0, samples=[(9.0, best[1] * 10)]), 1.0) == []
    assert (engine.clock_offset, engine.best_rtt) == best and engine.state == "CONNECTED"
    p.handle(E.HandshakeOk(engine_id=P0, samples=[(7.0, best[1] / 10)]), 1.0)
    assert engine.clock_offset == 7.0
    assert p.get("decode_request", "r1").state == "READING"


def test_peer_disconnect_fails_the_engine_closed_and_its_requesters():
    p = plane()
    reading(p)
    out = p.handle(E.PeerDisconnected(engine_id=P0), 1.0)
    assert names(out) == ["RemoveRemoteAgent", "ReleaseXfer", "ReportRecv"]
    assert out[1].cancel is True and out[2].ok is False
    assert p.get("remote_engine", P0) is None and p.get("decode_request", "r1").state == "RECV_FAILED"
    assert p.held() == []


def test_protocol_error_on_a_fresh_push_keeps_no_machine():
    p = plane()
    assert p.handle(E.WriteDone(request_id="p1"), 0.0) == []
    assert p.get("push_write", "p1") is None
    assert p.stats[Anomaly("unknown_id", "push_write", "WriteDone")] == 1


# ------------------------------------------------- a push lives only while its lease holds the blocks
@pytest.mark.parametrize("order", ["ready_then_reg", "reg_then_ready"])
def test_push_readied_without_a_held_lease_takes_nothing(order):
    """Blocks handed to a push with no lease holding them (never granted, or
    already reclaimed): the push never has them, no handshake starts, and a
    registration alone only waits out its deadline."""
    p = plane()
    reg = E.PushRegistered(request_id="p1", engine_id="D0", remote_request_id="r1", remote_block_ids=(1,))
    ready = E.PushReady(request_id="p1", block_ids=(7,))
    first, second = (ready, reg) if order == "ready_then_reg" else (reg, ready)
    assert p.handle(first, 0.0) == []
    assert p.handle(second, 0.0) == []
    assert p.get("remote_engine", "D0") is None and p.held() == []
    if order == "ready_then_reg":
        assert p.stats[Anomaly("source_not_held", "push_write", "PushReady")] == 1
        assert p.get("push_write", "p1").state == "REGISTERED"
        assert run_timers(p, 1000.0) == []
    else:
        assert p.stats[SourceEnded("push_write", "PushReady")] == 1
    assert p.get("push_write", "p1") is None and p.stats[Final("push_write", "FAILED")] == 1


def test_push_that_finds_its_lease_gone_ends_instead_of_acting():
    """The plane's last line: whatever event a push that needs its blocks
    gets while the lease does not hold them, it ends and uses nothing (here
    the lease is removed behind the plane's back)."""
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7,)), 0.0)
    p.handle(E.PushRegistered(request_id="p1", engine_id="D0", remote_request_id="r1", remote_block_ids=(1,)), 0.0)
    p.handle(E.PushReady(request_id="p1", block_ids=(7,)), 0.0)
    assert p.get("push_write", "p1").state == "CONNECTING"
    del p.instances["lease"]["p1"]
    out = connect(p, "D0", 1.0)
    assert of_type(out, A.PostWrite) == []
    assert p.get("push_write", "p1") is None
    assert p.stats[SourceEnded("push_write", "EngineReady")] == 1
    assert p.get("remote_engine", "D0").refs == set()


# ------------------------------------------------------------------ timers
def test_stale_timers_are_skipped():
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(1,)), 0.0)
    p.handle(E.LeaseHeartbeat(request_id="p1"), 15.0)  # expiry 30 -> 35
    assert p.next_deadline() == 35.0
    assert p.fire_due(30.0) == []
    assert p.get("lease", "p1").state == "LEASED"
    assert p.fire_due(35.0) == [A.FreeBlocks("p1", (1,), "expired")]
    # Timers of machines that are gone never fire, and are not counted as unknown ids.
    q = plane()
    reading(q)
    q.handle(E.ReadDone(request_id="r1"), 1.0)
    q.handle(E.RequestRunning(request_id="r1"), 1.0)
    q.handle(E.RequestFinished(request_id="r1"), 1.0)
    fired = run_timers(q, 10_000.0)
    assert [a for _, a in fired if not isinstance(a, A.RemoveRemoteAgent)] == []
    assert not [k for k in q.stats if isinstance(k, Ignored) or isinstance(k, Anomaly) and k.what.startswith("unknown")]
    assert q.next_deadline() is None


def test_fire_due_order_and_next_deadline():
    p = plane()
    assert p.next_deadline() is None and p.fire_due(1e9) == []
    for key, duration in [("c", 30.0), ("a", 10.0), ("b", 20.0), ("a2", 10.0)]:
        p.handle(E.LeaseGranted(request_id=key, block_ids=(), duration=duration), 0.0)
    assert p.next_deadline() == 10.0
    assert p.fire_due(9.999) == []
    # All due ones fire, earliest first, ties in arming order.
    assert [a.request_id for a in p.fire_due(25.0)] == ["a", "a2", "b"]
    assert p.next_deadline() == 30.0
    assert [a.request_id for a in p.fire_due(30.0)] == ["c"]
    assert p.next_deadline() is None


def test_a_late_fire_due_catches_up_in_order():
    p = plane()
    p.handle(new_request("r1", P0, "p1"), 0.0)
    connect(p, P0, 0.0)
    # One call long after everything: heartbeats, STALE, and eviction after the last heartbeat.
    out = p.fire_due(1000.0)
    assert names(out) == ["SendHeartbeat"]
    assert p.get("remote_engine", P0).state in ("CONNECTED", "STALE")  # the heartbeat reference holds it


def test_only_external_actions_leave_the_plane():
    p = plane()
    acts = reading(p), *p.handle(E.ReadDone(request_id="r1"), 1.0)
    acts += tuple(a for _, a in run_timers(p, 1000.0))
    assert acts and all(not type(a).internal for a in acts)


# --------------------------------------------- engine eviction and heartbeats
def test_heartbeats_reconnect_an_engine_evicted_while_requests_are_queued():
    """A transient disconnect of P must not silently stop the heartbeats of
    requests still queued on D: the next heartbeat tick reconnects."""
    d = plane()
    d.handle(new_request("r1", P0, "p1"), 0.0)
    connect(d, P0, 0.0)
    out = d.handle(E.PeerDisconnected(engine_id=P0, reason="reset"), 7.0)
    assert names(out) == ["RemoveRemoteAgent"]
    assert d.get("remote_engine", P0) is None
    fired = [a for _, a in run_timers(d, 9.0)]  # the tick (at 4.33) starts a handshake (timeout 5 s)
    assert of_type(fired, A.SendHeartbeat) and of_type(fired, A.StartHandshake)
    connect(d, P0, 9.0)
    assert ("heartbeat", P0) in d.get("remote_engine", P0).refs
    # Queued far longer than the engine TTL: the engine stays, heartbeats flow
    # (every 5 s from 9.33).
    fired = [a for _, a in run_timers(d, 600.0)]
    assert of_type(fired, A.RemoveRemoteAgent) == []
    assert len(of_type(fired, A.SendHeartbeat)) == (600 - 10) // 5 + 1


# ------------------------------------------------- never raises (property)
KEYS = ["r1", "r2"]
PEERS = ["p1", "p2"]
ENGINES = ["P0", "P1"]

events = st.one_of(
    st.builds(lambda k, e, p, push, exp: E.NewRequest(request_id=k, engine_id=e, remote_request_id=p, push=push,
                                                      remote_expiry=exp),
              st.sampled_from(KEYS), st.sampled_from(ENGINES), st.sampled_from(PEERS), st.booleans(),
              st.none() | st.floats(0, 200)),
    st.builds(lambda k, n, aw: E.BlocksAllocated(request_id=k, block_ids=(1,), num_remote_tokens=n, awaiting=aw),
              st.sampled_from(KEYS), st.sampled_from([0, 16]), st.booleans()),
    *(st.builds(lambda k, c=c: c(request_id=k), st.sampled_from(KEYS))
      for c in (E.StartLoad, E.ReadDone, E.ReadFailed, E.PushDone, E.RequestRunning, E.Abort)),
    st.builds(lambda k, h: E.RequestFinished(request_id=k, block_ids=(1,), hold_for_next_turn=h),
              st.sampled_from(KEYS), st.booleans()),
    st.builds(lambda k: E.LeaseGranted(request_id=k, block_ids=(9,)), st.sampled_from(PEERS + KEYS)),
    st.builds(lambda k: E.LeaseHeartbeat(request_id=k), st.sampled_from(PEERS + KEYS)),
    st.builds(lambda k, c, n: E.ConsumerDone(request_id=k, consumer=c, expected_consumers=n),
              st.sampled_from(PEERS + KEYS), st.sampled_from(["D0", "D1"]), st.sampled_from([1, 2])),
    st.builds(lambda k: E.LeaseAbort(request_id=k), st.sampled_from(PEERS)),
    st.builds(lambda k, e: E.PushRegistered(request_id=k, engine_id=e, remote_request_id="x"),
              st.sampled_from(PEERS), st.sampled_from(ENGINES)),
    *(st.builds(lambda k, c=c: c(request_id=k), st.sampled_from(PEERS))
      for c in (E.WriteDone, E.WriteFailed, E.PushAbort)),
    st.builds(lambda k: E.PushReady(request_id=k, block_ids=(9,)), st.sampled_from(PEERS)),
    st.builds(lambda e, o: E.HandshakeOk(engine_id=e, samples=((o, 0.01),)), st.sampled_from(ENGINES),
              st.floats(-10, 10)),
    *(st.builds(lambda e, c=c: c(engine_id=e), st.sampled_from(ENGINES))
      for c in (E.HandshakeFailed, E.EngineActivity, E.PeerDisconnected)),
)
steps = st.lists(st.tuples(st.sampled_from([0.0, 0.5, 3.0, 20.0, 90.0]), events), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_any_event_sequence_never_raises_and_reports_at_most_once(seq):
    p = plane()
    now = 0.0
    reports: dict[str, int] = {}
    for dt, ev in seq:
        now += dt
        out = p.fire_due(now)
        if isinstance(ev, E.NewRequest) and p.get("decode_request", ev.request_id) is None:
            reports[ev.request_id] = 0  # a new life of this request id
        out += p.handle(ev, now)
        for a in out:
            assert not type(a).internal
            if isinstance(a, A.ReportRecv):
                reports[a.request_id] = reports.get(a.request_id, 0) + 1
        assert all(n <= 1 for n in reports.values()), reports
        for kind, insts in p.instances.items():
            for inst in insts.values():
                assert not p.machines[kind].is_terminal(inst)
    # Whatever holds a resource is resolved by a timer, except requests waiting
    # for the scheduler or worker, and the engines their heartbeats keep.
    run_timers(p, now + 2_000.0)
    for kind, key, state, holds in p.held():
        if kind in ("remote_engine", "heartbeat"):  # the engine, and the batch's reference to it
            assert p.heartbeats.registered(key), (kind, key, state)
        else:
            assert kind == "decode_request" and state in ("HEARTBEATING", "NOTIFY_ONLY"), (kind, key, state, holds)


def test_a_handshake_completing_after_eviction_removes_the_agent_it_added():
    p = plane()
    p.handle(new_request("r1", P0, "p1"), 0.0)  # the heartbeat reference starts the handshake
    p.handle(E.Abort(request_id="r1"), 0.1)
    # The attempts time out with nobody answering; the engine is evicted.
    run_timers(p, 1000.0)
    assert p.get("remote_engine", P0) is None
    # The slow peer finally answers; the transport has added its agent.
    out = p.handle(E.HandshakeOk(engine_id=P0, samples=((0.0, 0.001),)), 1000.0)
    assert out == [A.RemoveRemoteAgent(P0)]
    assert p.stats[Anomaly("unknown_id", "remote_engine", "HandshakeOk")] == 1
    assert p.get("remote_engine", P0) is None


def test_a_lease_shorter_than_six_seconds_is_refused():
    # d // 6 would be a zero heartbeat interval: the batcher would re-arm forever.
    with pytest.raises(ValueError, match="kv_lease_duration"):
        PlaneConfig(kv_lease_duration=5)
    assert PlaneConfig(kv_lease_duration=6).heartbeat_interval == 1


def test_stats_keys_are_records_with_the_report_labels():
    p = plane()
    p.handle(E.ReadDone(request_id="nope"), 0.0)
    p.handle(E.ReadDone(request_id="nope"), 1.0)
    (key,) = [k for k in p.stats if isinstance(k, Anomaly)]
    assert key == Anomaly("unknown_id", "decode_request", "ReadDone") and p.stats[key] == 2
    # The labels reports print (and the main job's summary keys) are the records' str().
    assert str(key) == "unknown_id:decode_request:ReadDone"
    assert str(Ignored("lease", "LEASED", "LeaseGranted")) == "ignored:lease:LEASED:LeaseGranted"
    assert [str(Final("lease", "EXPIRED")), str(FailClosed("lease")), str(SourceEnded("push_write", "PushReady"))] == [
        "final:lease:EXPIRED", "fail_closed:lease", "source_ended:push_write:PushReady"]


# ------------------------------------------------------- engine references
def test_engine_references_are_a_set_of_requester_pairs():
    """An engine's references read as the (kind, key) pairs they were, though
    kept as keys per kind; a request's reference goes with its READ."""
    p = plane()
    reading(p, "r1", "p1")
    reading(p, "r2", "p2")
    refs = p.get("remote_engine", P0).refs
    assert set(refs) >= {("decode_request", "r1"), ("decode_request", "r2")}
    assert ("decode_request", "r3") not in refs and ("push_write", "r1") not in refs
    assert "r1" not in refs and (["unhashable"], "r1") not in refs  # not a pair of a kind and a key: absent
    assert len(refs) == len(set(refs))
    p.handle(E.ReadDone(request_id="r1"), 1.0)
    assert ("decode_request", "r1") not in refs and ("decode_request", "r2") in refs
    # A clone's references are its own.
    q = p.clone()
    q.handle(E.ReadDone(request_id="r2"), 1.0)
    assert ("decode_request", "r2") in refs and ("decode_request", "r2") not in q.get("remote_engine", P0).refs


def test_requesters_read_as_pairs():
    from kvplane.statemachines.machines.remote_engine import Requesters

    refs = Requesters([("decode_request", "r1"), ("heartbeat", "P0")])
    assert bool(refs) and len(refs) == 2 and refs == {("decode_request", "r1"), ("heartbeat", "P0")}
    refs.by_kind["decode_request"].discard("r1")
    assert refs == {("heartbeat", "P0")} and sorted(refs) == [("heartbeat", "P0")] and len(refs) == 1
    assert ("lease", "x") not in refs and "lease" not in refs.by_kind  # asking adds no kind
    refs.by_kind["heartbeat"].discard("P0")
    assert not refs and refs == set() and len(refs) == 0 and list(refs) == []
    copy = refs.copy()
    copy.by_kind["heartbeat"].add("P1")
    assert not refs and copy == {("heartbeat", "P1")} and repr(copy) == "Requesters([('heartbeat', 'P1')])"


# ------------------------------------------------------------ internal queue
def test_the_internal_queue_is_empty_between_calls_and_after_a_raise():
    # handle() keeps one internal-event list that is empty between calls:
    # a cascade takes a fresh one, and a row that raises (a bug) leaves
    # nothing behind for the next stimulus to run.
    p = plane()
    reading(p)  # StartLoad's cascade: EngineAcquire, EngineReady
    assert p._queue == []

    def raising(ev, now, out, queue, note):
        queue.append(E.ReadDone(request_id="ghost"))  # an unknown id: counted if it ever ran
        raise RuntimeError("a row failed")

    p._dispatch = raising  # type: ignore[method-assign]  # the one dispatch, failing once
    with pytest.raises(RuntimeError):
        p.handle(E.RequestRunning(request_id="r1"), 1.0)
    del p._dispatch
    assert p._queue == []
    assert names(p.handle(E.ReadDone(request_id="r1"), 2.0)) == ["ReleaseXfer", "ReportRecv"]
    assert p._queue == []
    assert p.stats[Anomaly("unknown_id", "decode_request", "ReadDone")] == 0  # the ghost never ran


# ------------------------------------------------------------ one interpreter
def test_a_raising_guard_is_traced_to_its_machine_file():
    """The plane interprets the tables: a guard is called where its machine
    file defines it, so a traceback through one names that file and line,
    and no generated code (``<string>``, a compiled row) stands in between."""
    import traceback

    p = plane()
    p.handle(E.LeaseGranted(request_id="l1", block_ids=(1,)), 0.0)
    p.get("lease", "l1").bound = None  # corrupt: the sender guard's ``in`` raises TypeError
    with pytest.raises(TypeError) as info:
        p.handle(E.LeaseHeartbeat(request_id="l1", sender="d0"), 1.0)
    frames = traceback.extract_tb(info.tb)
    files = [f.filename.replace("\\", "/") for f in frames]
    assert files[-1].endswith("statemachines/machines/lease.py"), files
    assert [f.name for f in frames][-2:] == ["foreign_sender", "admits"]
    assert all(name.endswith(".py") and not name.startswith("<") for name in files), files
    assert any(name.endswith("statemachines/plane.py") for name in files)
    assert p._queue == []
