"""Seed bug scenarios, as unit tests on the pure core.

Two ControlPlanes stand for a decode instance (D) and a prefill instance (P);
the tests play the transport, carrying actions from one plane to the other by
hand, and read time only from the planes' own timers.
"""
from __future__ import annotations

import math

import pytest

from core_support import connect, heartbeats_to_leases, held_by, names, new_request, of_type, plane, run_timers
from kvplane.statemachines import actions as A
from kvplane.statemachines.recv_failure import RecvFailure
from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.heartbeat_phase import phase
from kvplane.statemachines.stats import Final

P_ENGINE, D_ENGINE = "P0", "D0"
SCHEDULES = pytest.mark.parametrize("spread", [True, False], ids=["spread", "lockstep"])


def heartbeat_times(engine: str, after: float, cfg: PlaneConfig, count: int) -> list[float]:
    """When an engine whose first id registered at ``after`` sends its first
    ``count`` batches: one interval apart, the first one interval on
    (lockstep) or at the engine's next slot ``phase + k * interval`` (spread)."""
    interval = cfg.heartbeat_interval
    if not cfg.heartbeat_spread:
        return [after + n * interval for n in range(1, count + 1)]
    offset = phase(engine, interval)
    first = math.floor((after - offset) / interval) + 1
    return [offset + (first + n) * interval for n in range(count)]


class Side:
    """One plane plus a scripted transport for handshakes; records every action with its time."""

    def __init__(self, plane, handshake="ok", offset=0.0):
        self.plane, self.handshake, self.offset = plane, handshake, offset
        self.log: list[tuple[float, object]] = []

    def _take(self, acts, now):
        """Log ``acts``, answer handshakes; returns them with what the answers produced."""
        acts = list(acts)
        for a in acts:
            self.log.append((now, a))
        for a in of_type(acts, A.StartHandshake):
            if self.handshake == "ok":
                acts += self._take(connect(self.plane, a.engine_id, now, self.offset), now)
            elif self.handshake == "fail":
                acts += self._take(self.plane.handle(E.HandshakeFailed(engine_id=a.engine_id, reason="refused"), now),
                                   now)
            # "silent": the peer never answers; the handshake times out
        return acts

    def handle(self, ev, now):
        return self._take(self.plane.handle(ev, now), now)

    def until(self, t):
        """Fire timers up to ``t``, each at its own deadline."""
        while (at := self.plane.next_deadline()) is not None and at <= t:
            self._take(self.plane.fire_due(at), at)

    def sent(self, cls):
        return [a for _, a in self.log if isinstance(a, cls)]


# --------------------------------------------------------- (a) full-prefix hit
@pytest.mark.parametrize("awaiting", [True, False])
@pytest.mark.parametrize("outcome", ["ready", "lost", "exhausted", "timer"])
def test_full_prefix_hit_reported_exactly_when_awaited(awaiting, outcome):
    """ready: EngineReady; lost: the peer disconnects during the handshake;
    exhausted: the handshake attempt fails; timer: the peer never answers, and
    the attempt times out (the request waits that long, no backoff, never
    until its own deadline)."""
    cfg = PlaneConfig(recv_timeout=10.0, handshake_backoff=4.0) if outcome == "timer" else PlaneConfig()
    handshake = {"ready": "ok", "lost": "silent", "exhausted": "fail", "timer": "silent"}[outcome]
    d = Side(plane(**attrs_of(cfg)), handshake=handshake)
    p = Side(plane())
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(1, 2, 3)), 0.0)

    d.handle(new_request("r1", P_ENGINE, "p1"), 0.0)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(5,), num_remote_tokens=0, awaiting=awaiting), 0.5)
    d.handle(E.StartLoad(request_id="r1"), 0.5)
    if outcome == "lost":
        d.handle(E.PeerDisconnected(engine_id=P_ENGINE, reason="connection refused"), 0.7)
    if outcome == "timer":
        timeout = d.plane.get("remote_engine", P_ENGINE).retry_at  # the attempt's timeout
        assert timeout <= 0.5 + cfg.handshake_timeout < 0.5 + cfg.recv_timeout
        d.until(timeout - 0.001)
        assert d.plane.get("decode_request", "r1").state == ("HANDSHAKING" if awaiting else "NOTIFYING")
        d.until(timeout)
        assert d.plane.get("remote_engine", P_ENGINE).state == "HANDSHAKE_FAILED"
        assert held_by(d.plane, "r1") == []
    d.until(1000.0)

    reports = d.sent(A.ReportRecv)
    if awaiting:
        assert len(reports) == 1
        # Reported done however the notify to P fared: a full prefix hit loads
        # nothing, so nothing can have failed to load.
        assert reports[0].request_id == "r1" and reports[0].ok is True and reports[0].failed_block_ids == ()
    else:
        assert reports == []
    notifs = d.sent(A.SendNotif)
    assert notifs == ([A.SendNotif(P_ENGINE, "p1", 1)] if outcome == "ready" else [])

    # Nothing is held for the request, and no heartbeat keeps P's lease alive.
    assert held_by(d.plane, "r1") == []
    assert "p1" not in d.plane.heartbeats.registered(P_ENGINE)
    if awaiting:
        assert d.plane.get("decode_request", "r1").state == "RECV_DONE"
        d.handle(E.RequestRunning(request_id="r1"), 1000.0)
        d.handle(E.RequestFinished(request_id="r1"), 1000.0)
    assert d.plane.get("decode_request", "r1") is None
    assert d.plane.held() == []

    # P: the notification frees the lease at once; without it the lease expires.
    for a in notifs:
        p.handle(E.ConsumerDone(request_id="p1", consumer=D_ENGINE, expected_consumers=a.expected_consumers), 1.0)
    p.until(1000.0)
    (freed,) = [(t, a) for t, a in p.log if isinstance(a, A.FreeBlocks)]
    assert freed[1].block_ids == (1, 2, 3)
    assert freed[0] == (1.0 if outcome == "ready" else p.plane.config.kv_lease_duration)
    assert p.plane.held() == []


def attrs_of(cfg: PlaneConfig) -> dict:
    import attrs

    return attrs.asdict(cfg)


def test_full_prefix_hit_on_an_already_connected_engine():
    d = Side(plane())
    d.handle(new_request("r0", P_ENGINE, "p0"), 0.0)
    assert d.plane.get("remote_engine", P_ENGINE).state == "CONNECTED"
    d.handle(new_request("r1", P_ENGINE, "p1"), 1.0)
    d.handle(E.BlocksAllocated(request_id="r1", num_remote_tokens=0, awaiting=True), 1.0)
    out = d.handle(E.StartLoad(request_id="r1"), 1.0)
    assert names(out) == ["SendNotif", "ReportRecv"] and out[1].ok is True
    assert held_by(d.plane, "r1") == []
    assert d.plane.heartbeats.registered(P_ENGINE) == ("p0",)


# ------------------------------------------------------------- (b) decode crash
@SCHEDULES
@pytest.mark.parametrize("duration", [30.0, 12.0, 60.0])
def test_decode_crash_lease_expires_within_one_extension(duration, spread):
    cfg = dict(kv_lease_duration=duration, heartbeat_spread=spread)
    d, p = Side(plane(**cfg)), Side(plane(**cfg))
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), 0.0)
    d.handle(new_request("r1", P_ENGINE, "p1"), 0.0)

    interval = d.plane.config.heartbeat_interval
    crash_at = 10 * interval + interval / 2
    last_hb = None
    while (at := d.plane.next_deadline()) is not None and at <= crash_at:
        out = d.plane.fire_due(at)
        if of_type(out, A.SendHeartbeat):
            last_hb = at
            heartbeats_to_leases(out, p.plane, at)
        assert of_type(p.plane.fire_due(at), A.FreeBlocks) == []
    sends = heartbeat_times(P_ENGINE, 0.0, d.plane.config, 12)
    assert last_hb == pytest.approx(max(t for t in sends if t <= crash_at))
    # D is gone from here on: nothing more reaches P.
    extension = duration * 2 // 3
    assert p.plane.next_deadline() == last_hb + extension
    assert p.plane.fire_due(last_hb + extension - 0.001) == []
    freed = p.plane.fire_due(last_hb + extension)
    assert freed == [A.FreeBlocks("p1", (7, 8), "expired")]
    assert last_hb + extension < last_hb + PlaneConfig().decoder_kv_blocks_ttl
    assert p.plane.held() == [] and p.plane.next_deadline() is None


# ------------------------------------------------------------------ (c) overload
@pytest.mark.parametrize("deliver_heartbeats", [True, False])
def test_overloaded_decoder_keeps_the_lease_alive_while_queued(deliver_heartbeats):
    d, p = Side(plane()), Side(plane())
    lease_d = p.plane.config.kv_lease_duration
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), 0.0)
    d.handle(new_request("r1", P_ENGINE, "p1", remote_block_ids=(7, 8)), 0.0)

    queued_for = 10 * lease_d
    t = 0.0
    while t < queued_for:
        t += 1.0
        out = d.plane.fire_due(t)
        if deliver_heartbeats:
            heartbeats_to_leases(out, p.plane, t)
        expired = of_type(p.plane.fire_due(t), A.FreeBlocks)
        if not deliver_heartbeats:
            # Control: without the heartbeats the lease does expire.
            if expired:
                assert t == lease_d
                return
            continue
        assert expired == []
        assert p.plane.get("lease", "p1").state == "LEASED"
    assert deliver_heartbeats, "without heartbeats the lease should have expired"

    # Finally scheduled: allocate, load, read.
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), t)
    out = d.handle(E.StartLoad(request_id="r1"), t)
    (read,) = of_type(out, A.PostRead)
    assert (read.remote_request_id, read.remote_block_ids, read.local_block_ids) == ("p1", (7, 8), (1, 2))
    out = d.handle(E.ReadDone(request_id="r1"), t + 0.1)
    assert [(r.ok, r.request_id) for r in of_type(out, A.ReportRecv)] == [(True, "r1")]
    # The READ's completion notification reaches P.
    freed = p.handle(E.ConsumerDone(request_id="p1", consumer=D_ENGINE, expected_consumers=read.expected_consumers),
                     t + 0.1)
    assert freed == [A.FreeBlocks("p1", (7, 8), "consumed")]
    assert p.plane.held() == []
    # Heartbeats for p1 stop.
    d.until(t + 100)
    assert all(t2 <= t for t2, a in d.log if isinstance(a, A.SendHeartbeat))


# ------------------------------------------------------------ (d) turn-2 read gate
def _read_turn2(remote_expiry, offset, now, samples=None):
    """A reader whose remote sent ``remote_expiry`` (in the remote clock)."""
    r = plane()
    r.handle(new_request("t2", D_ENGINE, "r1", remote_expiry=remote_expiry), now - 1.0)
    r.handle(E.BlocksAllocated(request_id="t2", block_ids=(4, 5), num_remote_tokens=64), now - 1.0)
    r.handle(E.StartLoad(request_id="t2"), now - 1.0)
    out = r.handle(E.HandshakeOk(engine_id=D_ENGINE, samples=samples or ((offset, 0.001),)), now)
    return r, out


@pytest.mark.parametrize("remote_expiry,offset,now,allowed", [
    (50.0, 0.0, 100.0, False),      # already expired
    (100.0, 70.0, 30.0, False),     # fine in the remote clock, expired in ours (remote is 70 s ahead)
    (100.0, 0.0, 30.0, True),       # the same expiry without the offset
    (100.0, -70.0, 90.0, True),     # the remote clock is behind: more time left than it looks
    (104.0, 0.0, 100.0, False),     # within the 5 s margin
    (105.0, 0.0, 100.0, False),     # exactly at the margin
    (105.5, 0.0, 100.0, True),      # just outside it
    (580.0, 0.0, 100.0, True),      # far away
    (None, 0.0, 100.0, True),       # no expiry sent
])
def test_turn2_read_gate(remote_expiry, offset, now, allowed):
    r, out = _read_turn2(remote_expiry, offset, now)
    if allowed:
        assert names(out) == ["PostRead"]
        assert r.get("decode_request", "t2").state == "READING"
    else:
        assert names(out) == ["ReportRecv"]
        assert out[0] == A.ReportRecv("t2", False, (4, 5), RecvFailure.DECLINED)
        assert held_by(r, "t2") == []
        assert r.heartbeats.registered(D_ENGINE) == ()


def test_turn2_gate_uses_the_lowest_rtt_clock_sample():
    # The high-RTT sample claims the remote clock is 70 s ahead (which would
    # decline); the precise one says 0, so the read goes ahead.
    r, out = _read_turn2(100.0, None, 30.0, samples=((70.0, 0.5), (0.0, 0.001), (-3.0, 0.2)))
    assert names(out) == ["PostRead"]
    r, out = _read_turn2(100.0, None, 30.0, samples=((0.0, 0.5), (70.0, 0.001)))
    assert names(out) == ["ReportRecv"] and out[0].ok is False


def _finished_with_hold(d: Side, at: float):
    d.handle(new_request("r1", P_ENGINE, "p1"), 0.0)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), 0.0)
    d.handle(E.StartLoad(request_id="r1"), 0.0)
    d.handle(E.ReadDone(request_id="r1"), 0.5)
    d.handle(E.RequestRunning(request_id="r1"), 0.5)
    return d.handle(E.RequestFinished(request_id="r1", block_ids=(1, 2, 3), hold_for_next_turn=True), at)


def test_decoder_hold_is_a_fixed_ttl_lease_freed_at_480s():
    d = Side(plane())
    finished_at = 20.0
    assert _finished_with_hold(d, finished_at) == []
    hold = d.plane.get("lease", "r1")
    assert hold.state == "LEASED" and hold.deadline == finished_at + 480.0
    # A turn-2 reader's heartbeats do not extend a decoder's hold.
    t = finished_at
    while t < finished_at + 470:
        t += 5.0
        assert d.plane.handle(E.LeaseHeartbeat(request_id="r1"), t) == []
        d.until(t)
        assert d.plane.get("lease", "r1").deadline == finished_at + 480.0
    d.until(finished_at + 480.0 - 0.001)
    assert d.sent(A.FreeBlocks) == []
    d.until(finished_at + 480.0)
    assert [(t, a) for t, a in d.log if isinstance(a, A.FreeBlocks)] == [
        (finished_at + 480.0, A.FreeBlocks("r1", (1, 2, 3), "expired"))]
    assert d.plane.held() == [] or all(h[0] in ("remote_engine", "heartbeat") for h in d.plane.held())


def test_turn2_read_of_a_decoder_hold_end_to_end():
    d = Side(plane())
    _finished_with_hold(d, 20.0)
    expiry = d.plane.get("lease", "r1").deadline  # exported in D's clock
    d_ahead = 100.0  # D's clock reads 100 s more than P's

    # Early read on P: allowed; its completion frees D's hold before the TTL.
    p_now = 50.0
    r, out = _read_turn2(expiry, d_ahead, p_now)
    (read,) = of_type(out, A.PostRead)
    r.handle(E.ReadDone(request_id="t2"), p_now + 1)
    freed = d.handle(E.ConsumerDone(request_id=read.remote_request_id, consumer=P_ENGINE,
                                    expected_consumers=read.expected_consumers), p_now + 1 + d_ahead)
    assert freed == [A.FreeBlocks("r1", (1, 2, 3), "consumed")]

    # Late read on P (3 s before the hold expires, in P's clock): declined.
    r, out = _read_turn2(expiry, d_ahead, expiry - d_ahead - 3.0)
    assert names(out) == ["ReportRecv"] and out[0].ok is False


# ------------------------------------------------------------------ (e) push mode
def _lease_and_push(p: Side, pid: str, now: float, order: str, rid="r1"):
    p.handle(E.LeaseGranted(request_id=pid, block_ids=(7, 8)), now)
    reg = E.PushRegistered(request_id=pid, engine_id=D_ENGINE, remote_request_id=rid, remote_block_ids=(1, 2))
    ready = E.PushReady(request_id=pid, block_ids=(7, 8))
    first, second = (reg, ready) if order == "reg_first" else (ready, reg)
    assert p.handle(first, now) == []
    return p.handle(second, now)


@pytest.mark.parametrize("order", ["reg_first", "ready_first"])
def test_push_write_both_orders(order):
    p = Side(plane())
    out = _lease_and_push(p, "p1", 0.0, order)
    # First use of the engine: handshake, then the WRITE.
    assert names(out) == ["StartHandshake", "PostWrite"]
    write = out[1]
    assert (write.remote_request_id, write.local_block_ids, write.remote_block_ids) == ("r1", (7, 8), (1, 2))
    assert p.plane.get("push_write", "p1").state == "WRITING"
    out = p.handle(E.WriteDone(request_id="p1"), 2.0)
    assert out == [A.ReleaseXfer("p1", False), A.FreeBlocks("p1", (7, 8), "consumed")]
    assert p.plane.get("push_write", "p1") is None and p.plane.get("lease", "p1") is None
    assert [h[0] for h in p.plane.held()] == ["remote_engine"]
    assert p.plane.get("remote_engine", D_ENGINE).refs == set()


def test_push_end_to_end_with_the_decoder():
    d, p = Side(plane()), Side(plane())
    d.handle(new_request("r1", P_ENGINE, "p1", push=True), 0.0)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), 0.5)
    (reg,) = of_type(d.handle(E.StartLoad(request_id="r1"), 0.5), A.SendPushRegistration)
    assert d.plane.get("decode_request", "r1").state == "AWAITING_PUSH"
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), 1.0)
    out = p.handle(E.PushRegistered(request_id=reg.remote_request_id, engine_id=D_ENGINE,
                                    remote_request_id=reg.request_id, remote_block_ids=reg.block_ids), 1.0)
    assert out == []
    (write,) = of_type(p.handle(E.PushReady(request_id="p1", block_ids=(7, 8)), 2.0), A.PostWrite)
    assert (write.remote_request_id, write.remote_block_ids) == ("r1", (1, 2))
    # The WRITE lands; P learns from its transfer, D from the notification.
    assert of_type(p.handle(E.WriteDone(request_id="p1"), 3.0), A.FreeBlocks)
    assert d.handle(E.PushDone(request_id=write.remote_request_id), 3.0) == [A.ReportRecv("r1", True, ())]
    assert held_by(d.plane, "r1") == [] and held_by(p.plane, "p1") == []


def test_push_completion_from_a_stranger_is_refused_by_the_table():
    """Only the engine a request reads from may complete its push: the
    decode_request row refuses (and the plane keeps waiting) a completion
    from anyone else, however often it comes; the real one still lands."""
    d = Side(plane())
    d.handle(new_request("r1", P_ENGINE, "p1", push=True), 0.0)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), 0.0)
    d.handle(E.StartLoad(request_id="r1"), 0.0)
    for _ in range(3):
        out = d.handle(E.PushDone(request_id="r1", sender="mallory"), 1.0)
        assert out == [A.RefuseForeignSender("r1", "mallory", "push_done_foreign_sender")]
    assert d.plane.get("decode_request", "r1").state == "AWAITING_PUSH"
    assert d.handle(E.PushDone(request_id="r1", sender=P_ENGINE), 2.0) == [A.ReportRecv("r1", True, ())]
    # Late or duplicate, from anyone: ignored, counted.
    assert d.handle(E.PushDone(request_id="r1", sender="mallory"), 3.0) == []


def test_push_never_arrives_fails_the_decoder_recv():
    d = Side(plane())
    d.handle(new_request("r1", P_ENGINE, "p1", push=True), 0.0)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), 0.0)
    (reg,) = of_type(d.handle(E.StartLoad(request_id="r1"), 0.0), A.SendPushRegistration)
    d.until(1000.0)
    cfg = d.plane.config
    assert [(t, a) for t, a in d.log if isinstance(a, A.ReportRecv)] == [
        (min(cfg.recv_timeout, cfg.push_registration_timeout), A.ReportRecv("r1", False, (1, 2), RecvFailure.PUSH_TIMEOUT))]
    # The registration told P when D would give up.
    assert reg.deadline == min(cfg.recv_timeout, cfg.push_registration_timeout)
    assert held_by(d.plane, "r1") == []


def _push_margin(cfg) -> float:
    return min(cfg.expiry_safety_margin, cfg.push_registration_timeout / 4)


def _push_with_deadline(p: Side, now: float, remote_deadline):
    """Lease p1 and register D's push with ``remote_deadline`` (D's clock),
    then finish the prefill; the engine handshake answers at once."""
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), now)
    p.handle(E.PushRegistered(request_id="p1", engine_id=D_ENGINE, remote_request_id="r1", remote_block_ids=(1, 2),
                              remote_deadline=remote_deadline), now)
    return p.handle(E.PushReady(request_id="p1", block_ids=(7, 8)), now)


@pytest.mark.parametrize("d_ahead", [100.0, -50.0, 0.0])
@pytest.mark.parametrize("left", [-0.25, 0.0, 0.25])
def test_push_write_declined_when_the_decoder_gives_up_too_soon(d_ahead, left):
    """D's deadline (its clock, ``d_ahead`` s ahead of ours) leaves ``left``
    seconds beyond the margin when the engine is ready: no time left, no WRITE."""
    p = Side(plane(), offset=d_ahead)
    cfg, now = p.plane.config, 10.0
    margin = _push_margin(cfg)
    out = _push_with_deadline(p, now, now + d_ahead + margin + left)
    if left <= 0:
        assert names(out) == ["StartHandshake"]
        assert p.plane.get("push_write", "p1") is None
        assert p.plane.stats[Final("push_write", "FAILED")] == 1
        # Nothing posted, the engine reference is back, the lease is untouched.
        assert p.sent(A.PostWrite) == [] and p.plane.get("remote_engine", D_ENGINE).refs == set()
        assert p.plane.get("lease", "p1").state == "LEASED"
    else:
        assert names(out) == ["StartHandshake", "PostWrite"]
        w = p.plane.get("push_write", "p1")
        assert w.state == "WRITING" and w.deadline == pytest.approx(now + left)


@pytest.mark.parametrize("d_ahead", [100.0, -50.0])
@pytest.mark.parametrize("bound", ["decoder", "transfer", "no_deadline"])
def test_write_deadline_is_the_earlier_of_transfer_timeout_and_decoder_deadline(d_ahead, bound):
    p = Side(plane(kv_lease_duration=1000.0), offset=d_ahead)
    cfg, now = p.plane.config, 10.0
    # D's deadline less the margin, in our clock, is ``room`` seconds away.
    room = cfg.transfer_timeout + (-7.0 if bound == "decoder" else 7.0)
    remote = None if bound == "no_deadline" else now + room + _push_margin(cfg) + d_ahead
    assert of_type(_push_with_deadline(p, now, remote), A.PostWrite)
    expected = now + (room if bound == "decoder" else cfg.transfer_timeout)
    assert p.plane.get("push_write", "p1").deadline == pytest.approx(expected)
    # A WRITE that never completes is cancelled at that deadline.
    p.until(expected - 0.001)
    assert p.plane.get("push_write", "p1").state == "WRITING"
    p.until(expected + 0.001)
    assert p.plane.get("push_write", "p1") is None
    ((t, cancel),) = [(t, a) for t, a in p.log if isinstance(a, A.ReleaseXfer)]
    assert cancel == A.ReleaseXfer("p1", True) and t == pytest.approx(expected)


@pytest.mark.parametrize("d_ahead", [100.0, -50.0])
@pytest.mark.parametrize("decoder_bound", ["push_registration_timeout", "recv_timeout"])
def test_hung_write_is_cancelled_before_the_decoder_gives_up(d_ahead, decoder_bound):
    """D registers and waits; P's WRITE hangs.  P cancels it at least the
    margin before D (clock ``d_ahead`` s ahead of P's) reports the recv failed
    and may reuse its blocks; D's registration carries exactly the deadline
    it then gives up at."""
    short = {"push_registration_timeout": 20.0, "recv_timeout": 15.0}[decoder_bound]
    cfg = dict(transfer_timeout=1000.0, kv_lease_duration=1000.0, **{decoder_bound: short})
    d, p = Side(plane(**cfg)), Side(plane(**cfg), offset=d_ahead)
    d.handle(new_request("r1", P_ENGINE, "p1", push=True), d_ahead + 0.0)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), d_ahead + 0.5)
    (reg,) = of_type(d.handle(E.StartLoad(request_id="r1"), d_ahead + 0.5), A.SendPushRegistration)
    assert reg.deadline == d.plane.get("decode_request", "r1").deadline == d_ahead + 0.5 + short
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), 1.0)
    p.handle(E.PushRegistered(request_id=reg.remote_request_id, engine_id=D_ENGINE, remote_request_id=reg.request_id,
                              remote_block_ids=reg.block_ids, remote_deadline=reg.deadline), 1.0)
    assert of_type(p.handle(E.PushReady(request_id="p1", block_ids=(7, 8)), 2.0), A.PostWrite)

    p.until(500.0)
    d.until(d_ahead + 500.0)
    ((cancelled_at, cancel),) = [(t, a) for t, a in p.log if isinstance(a, A.ReleaseXfer)]
    assert cancel.cancel is True
    ((gave_up_at, report),) = [(t, a) for t, a in d.log if isinstance(a, A.ReportRecv)]
    assert report == A.ReportRecv("r1", False, (1, 2), RecvFailure.PUSH_TIMEOUT) and gave_up_at == reg.deadline
    # In P's clock D gives up at gave_up_at - d_ahead; the WRITE was over a margin before.
    margin = _push_margin(p.plane.config)
    assert gave_up_at - d_ahead - cancelled_at == pytest.approx(margin) and margin > 0
    assert held_by(d.plane, "r1") == [] and p.plane.get("push_write", "p1") is None


def test_active_push_keeps_the_engine_connected_then_silence_evicts_it():
    p = Side(plane())
    ttl = p.plane.config.engine_ttl
    last_activity = None
    for k, t in enumerate(range(0, 300, 25)):  # a WRITE every 25 s: within half the 60 s TTL
        p.until(t)
        _lease_and_push(p, f"p{k}", float(t), "reg_first")
        p.until(t + 1.0)
        p.handle(E.WriteDone(request_id=f"p{k}"), t + 1.0)
        last_activity = t + 1.0
        for probe in (t + 0.5, t + 1.0):
            assert p.plane.get("remote_engine", D_ENGINE).state == "CONNECTED", probe
    assert last_activity > 3 * ttl  # the pushes spanned several TTL boundaries
    assert p.sent(A.RemoveRemoteAgent) == []
    assert len(p.sent(A.StartHandshake)) == 1
    # Silence: STALE half a TTL after the last activity, evicted one TTL after it.
    assert p.plane.next_deadline() == last_activity + ttl / 2
    p.until(last_activity + ttl / 2)
    assert p.plane.get("remote_engine", D_ENGINE).state == "STALE"
    p.until(last_activity + ttl - 0.001)
    assert p.sent(A.RemoveRemoteAgent) == []
    p.until(last_activity + ttl)
    assert [(t, a) for t, a in p.log if isinstance(a, A.RemoveRemoteAgent)] == [
        (last_activity + ttl, A.RemoveRemoteAgent(D_ENGINE))]
    assert p.plane.get("remote_engine", D_ENGINE) is None and p.plane.held() == []


def test_engine_referenced_by_an_in_flight_write_is_never_evicted():
    p = Side(plane(transfer_timeout=10_000.0, kv_lease_duration=30_000.0))
    ttl = p.plane.config.engine_ttl
    _lease_and_push(p, "p1", 0.0, "ready_first")
    for k in range(1, 11):  # ten TTLs of silence while the WRITE is in flight
        p.until(k * ttl + 0.5)
        assert p.plane.get("remote_engine", D_ENGINE).state in ("CONNECTED", "STALE")
    assert p.plane.get("remote_engine", D_ENGINE).state == "STALE"
    assert p.sent(A.RemoveRemoteAgent) == []
    p.handle(E.WriteDone(request_id="p1"), 10 * ttl + 1)
    assert p.plane.get("remote_engine", D_ENGINE).state == "CONNECTED"
    # Unreferenced now: evicted after one TTL of silence, not before.
    p.until(10 * ttl + 1 + ttl - 0.001)
    assert p.sent(A.RemoveRemoteAgent) == []
    p.until(10 * ttl + 1 + ttl)
    assert p.sent(A.RemoveRemoteAgent) == [A.RemoveRemoteAgent(D_ENGINE)]


def test_engine_referenced_by_an_in_flight_read_is_never_evicted():
    d = Side(plane(transfer_timeout=10_000.0, recv_timeout=10_000.0))
    ttl = d.plane.config.engine_ttl
    d.handle(new_request("r1", P_ENGINE, "p1"), 0.0)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1,), num_remote_tokens=16), 0.0)
    assert of_type(d.handle(E.StartLoad(request_id="r1"), 0.0), A.PostRead)
    d.until(10 * ttl)
    assert d.sent(A.RemoveRemoteAgent) == []
    assert d.plane.get("remote_engine", P_ENGINE).state in ("CONNECTED", "STALE")


@pytest.mark.parametrize("missing", ["prefill", "registration", "handshake"])
def test_push_deadlines_fail_the_push(missing):
    # A handshake that outlasts the push deadline (the attempt times out after 100 s).
    p = Side(plane(kv_lease_duration=1000.0, handshake_timeout=100.0),
             handshake="silent" if missing == "handshake" else "ok")
    cfg = p.plane.config
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), 0.0)
    if missing != "registration":
        p.handle(E.PushRegistered(request_id="p1", engine_id=D_ENGINE, remote_request_id="r1"), 0.0)
    if missing != "prefill":
        p.handle(E.PushReady(request_id="p1", block_ids=(7, 8)), 0.0)
    state = {"prefill": "REGISTERED", "registration": "AWAITING_REG", "handshake": "CONNECTING"}[missing]
    assert p.plane.get("push_write", "p1").state == state
    p.until(cfg.push_registration_timeout - 0.001)
    assert p.plane.get("push_write", "p1").state == state
    p.until(cfg.push_registration_timeout)
    assert p.plane.get("push_write", "p1") is None
    assert p.plane.stats[Final("push_write", "FAILED")] == 1
    assert p.sent(A.PostWrite) == []
    # Nothing written: the lease is not consumed, and expires on its own.
    assert p.plane.get("lease", "p1").state == "LEASED"
    p.until(2000.0)
    assert p.sent(A.FreeBlocks) == [A.FreeBlocks("p1", (7, 8), "expired")]
    assert p.plane.held() == []


# ------------------------------------------------------- (f) heartbeat batching
ENGINE_RANKS = {"E0": [(0,), (1,), (0, 1)], "E1": [(0, 1, 2, 3)], "E2": [(0,)]}


@SCHEDULES
def test_heartbeats_batched_per_engine_and_interval_to_every_rank(spread):
    d = plane(heartbeat_spread=spread)
    interval = d.config.heartbeat_interval
    ids: dict[str, set] = {e: set() for e in ENGINE_RANKS}
    first_arrival: dict[str, float] = {}
    k = 0
    for i in range(10):
        for e, rank_sets in ENGINE_RANKS.items():
            t = 0.125 * k  # arrivals spread over [0, 4)
            peer = f"{e}-p{i}"
            d.handle(new_request(f"r{k}", e, peer, remote_ranks=rank_sets[i % len(rank_sets)]), t)
            ids[e].add(peer)
            first_arrival.setdefault(e, t)
            k += 1
    for e in ENGINE_RANKS:
        connect(d, e, 4.0)
    assert max(first_arrival.values()) < interval

    sent = [(t, a) for t, a in run_timers(d, 30.0) if isinstance(a, A.SendHeartbeat)]
    for e, rank_sets in ENGINE_RANKS.items():
        mine = [(t, a) for t, a in sent if a.engine_id == e]
        times = [t for t, _ in mine]
        assert times == pytest.approx(heartbeat_times(e, first_arrival[e], d.config, len(times)))
        assert times[-1] > 30.0 - interval  # one per interval, none skipped
        union = tuple(sorted({r for rs in rank_sets for r in rs}))
        for _, hb in mine:
            assert hb.ranks == union
            assert sorted(hb.request_ids) == sorted(ids[e])
    assert d.stats["heartbeats_sent"] == len(sent)

    # Requests finish: E0 entirely, half of E1; E2 keeps going.
    k = 0
    for i in range(10):
        for e in ENGINE_RANKS:
            if e == "E0" or (e == "E1" and i % 2 == 0):
                d.handle(E.Abort(request_id=f"r{k}"), 30.5)
                ids[e].discard(f"{e}-p{i}")
            k += 1
    later = [a for t, a in run_timers(d, 60.0) if isinstance(a, A.SendHeartbeat)]
    assert [a for a in later if a.engine_id == "E0"] == []
    assert all(sorted(a.request_ids) == sorted(ids[a.engine_id]) for a in later)
    assert {a.engine_id for a in later} == {"E1", "E2"}
    assert len(later) == 2 * 6  # two engines, one per 5 s over 30 s


@SCHEDULES
@pytest.mark.parametrize("duration,interval,extension", [
    (30.0, 5.0, 20.0), (12.0, 2.0, 8.0), (7.0, 1.0, 4.0), (60.0, 10.0, 40.0), (45.0, 7.0, 30.0),
])
def test_heartbeat_interval_and_lease_extension(duration, interval, extension, spread):
    d, p = plane(kv_lease_duration=duration, heartbeat_spread=spread), plane(kv_lease_duration=duration)
    assert (d.config.heartbeat_interval, d.config.lease_extension) == (interval, extension)
    p.handle(E.LeaseGranted(request_id="p1"), 0.0)
    assert p.next_deadline() == duration
    d.handle(new_request("r1", P_ENGINE, "p1"), 0.0)
    times = []
    for t, a in run_timers(d, 10 * duration):
        if isinstance(a, A.SendHeartbeat):
            times.append(t)
            heartbeats_to_leases([a], p, t)
            assert p.next_deadline() == max(duration, t + extension)
    assert times[:5] == pytest.approx(heartbeat_times(P_ENGINE, 0.0, d.config, 5))


def test_heartbeat_registration_counts_duplicates_of_one_peer_id():
    # Two local requests reading the same peer request: its id keeps flowing
    # until both stop.
    d = plane()
    d.handle(new_request("a", P_ENGINE, "p1"), 0.0)
    d.handle(new_request("b", P_ENGINE, "p1"), 0.0)
    d.handle(E.Abort(request_id="a"), 1.0)
    hbs = [a for _, a in run_timers(d, 5.0) if isinstance(a, A.SendHeartbeat)]
    assert [a.request_ids for a in hbs] == [("p1",)]
    d.handle(E.Abort(request_id="b"), 6.0)
    assert [a for _, a in run_timers(d, 20.0) if isinstance(a, A.SendHeartbeat)] == []


# ------------------------------------- a stalled decoder must not read a reclaimed lease
def _renewable_read(stall: bool):
    """D reads P's lease; heartbeats flow until t=40, then D either keeps
    running or stalls (no timers fired) until t=65, long past P's expiry."""
    d, p = Side(plane()), Side(plane())
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), 0.0)
    grant_expiry = p.plane.get("lease", "p1").expiry
    d.handle(new_request("r1", P_ENGINE, "p1", remote_block_ids=(7, 8), remote_expiry=grant_expiry,
                         remote_renewable=True), 0.0)
    connect(d.plane, P_ENGINE, 0.5)
    freed_at = None
    for t in range(1, 66):
        if not (stall and 40 < t < 65):
            heartbeats_to_leases(d.plane.fire_due(t), p.plane, t)
        if of_type(p.plane.fire_due(t), A.FreeBlocks):
            freed_at = t
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), 65.0)
    return d.handle(E.StartLoad(request_id="r1"), 65.0), freed_at


def test_a_decoder_with_flowing_heartbeats_reads_long_after_the_grant_expired():
    out, freed_at = _renewable_read(stall=False)
    assert freed_at is None
    assert len(of_type(out, A.PostRead)) == 1


def test_a_stalled_decoder_does_not_read_blocks_the_prefill_reclaimed():
    out, freed_at = _renewable_read(stall=True)
    # P reclaimed one extension after the last heartbeat it got (t=40).
    extension = PlaneConfig().lease_extension
    assert freed_at == 40 + extension
    assert of_type(out, A.PostRead) == []
    assert [(r.ok, r.request_id) for r in of_type(out, A.ReportRecv)] == [(False, "r1")]


def test_a_read_in_flight_across_a_stall_fails_at_the_lease_validity_not_later():
    """The READ's deadline is the earliest of transfer_timeout and the time the
    remote blocks are surely held; a completion polled after it is too late."""
    cfg = PlaneConfig()
    d = plane()
    d.handle(new_request("r1", P_ENGINE, "p1", remote_expiry=cfg.kv_lease_duration, remote_renewable=True), 0.0)
    connect(d, P_ENGINE, 0.0)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), 1.0)
    (read,) = of_type(d.handle(E.StartLoad(request_id="r1"), 1.0), A.PostRead)
    # No heartbeat went out yet: only the grant vouches for the blocks.
    assert d.get("decode_request", "r1").deadline == min(1.0 + cfg.transfer_timeout, cfg.kv_lease_duration)
    # The process stalls; on resume the driver fires due deadlines first.
    out = d.fire_due(cfg.kv_lease_duration + 30.0)
    assert [(type(a).__name__, getattr(a, "cancel", None)) for a in out if isinstance(a, (A.ReleaseXfer, A.ReportRecv))] \
        == [("ReleaseXfer", True), ("ReportRecv", None)]
    assert of_type(out, A.ReportRecv)[0].ok is False
    assert d.handle(E.ReadDone(request_id="r1"), cfg.kv_lease_duration + 30.0) == []  # late: ignored


def test_a_turn2_read_is_cut_at_the_hold_expiry():
    r = plane()
    # The decoder's hold expires at 40 (its clock, 10 s ahead of ours): 30 here.
    r.handle(new_request("t2", D_ENGINE, "r1", remote_expiry=40.0), 0.0)
    r.handle(E.BlocksAllocated(request_id="t2", block_ids=(4,), num_remote_tokens=16), 0.0)
    r.handle(E.StartLoad(request_id="t2"), 0.0)
    out = r.handle(E.HandshakeOk(engine_id=D_ENGINE, samples=((10.0, 0.001),)), 1.0)
    assert len(of_type(out, A.PostRead)) == 1
    assert r.get("decode_request", "t2").deadline == 30.0


# ------------------------------------------- (e') a push lives only while its lease holds the blocks
def _freed_then_written(log) -> list:
    """(free time, write time) for every PostWrite that follows its lease's FreeBlocks."""
    freed = {}
    bad = []
    for t, a in log:
        if isinstance(a, A.FreeBlocks):
            freed.setdefault(a.request_id, t)
        elif isinstance(a, A.PostWrite) and a.request_id in freed:
            bad.append((freed[a.request_id], t))
    return bad


def test_push_handshake_completing_after_the_lease_expired_posts_no_write():
    """The issue's scenario: lease 6 s, PUSH_REG at t=1, the handshake to D
    times out at 6 and its retry completes at 7.2.  The lease expired at 6
    (FreeBlocks): the push ends with it, and nothing writes from the freed
    blocks when the engine comes up."""
    p = Side(plane(kv_lease_duration=6.0), handshake="silent")
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), 0.0)
    p.handle(E.PushReady(request_id="p1", block_ids=(7, 8)), 0.0)
    p.handle(E.PushRegistered(request_id="p1", engine_id=D_ENGINE, remote_request_id="r1", remote_block_ids=(1, 2)),
             1.0)
    assert p.plane.get("push_write", "p1").state == "CONNECTING"
    p.until(7.2)
    p.handle(E.HandshakeOk(engine_id=D_ENGINE, samples=((0.0, 0.001),)), 7.2)
    assert [(t, a) for t, a in p.log if isinstance(a, A.FreeBlocks)] == [(6.0, A.FreeBlocks("p1", (7, 8), "expired"))]
    assert _freed_then_written(p.log) == []
    assert p.sent(A.PostWrite) == []
    assert p.plane.get("push_write", "p1") is None and p.plane.stats[Final("push_write", "FAILED")] == 1
    assert held_by(p.plane, "p1") == []
    engine = p.plane.get("remote_engine", D_ENGINE)
    assert engine is None or engine.refs == set()


def test_push_whose_lease_expired_fails_the_decoder_recv_and_holds_nothing():
    """End to end with D: D registers, then hangs (its heartbeats stop
    reaching P).  P's lease expires before P can WRITE, the push is dropped,
    and D, when its wait is over, reports the recv failed."""
    cfg = dict(kv_lease_duration=6.0)
    d, p = Side(plane(**cfg)), Side(plane(**cfg), handshake="silent")
    d.handle(new_request("r1", P_ENGINE, "p1", push=True), 0.0)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), 0.5)
    (reg,) = of_type(d.handle(E.StartLoad(request_id="r1"), 0.5), A.SendPushRegistration)
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), 0.0)
    p.handle(E.PushReady(request_id="p1", block_ids=(7, 8)), 0.0)
    p.handle(E.PushRegistered(request_id=reg.remote_request_id, engine_id=D_ENGINE, remote_request_id=reg.request_id,
                              remote_block_ids=reg.block_ids, remote_deadline=reg.deadline), 1.0)
    p.until(7.2)
    p.handle(E.HandshakeOk(engine_id=D_ENGINE, samples=((0.0, 0.001),)), 7.2)
    d.until(1000.0)
    p.until(1000.0)
    assert p.sent(A.PostWrite) == []
    ((t, report),) = [(t, a) for t, a in d.log if isinstance(a, A.ReportRecv)]
    assert report == A.ReportRecv("r1", False, (1, 2), RecvFailure.PUSH_TIMEOUT) and t == reg.deadline
    assert d.plane.held() == [] and p.plane.held() == []


@pytest.mark.parametrize("end", ["expired", "aborted"])
def test_lease_ending_cancels_the_write_in_flight(end):
    """A WRITE hangs; the lease ends under it (expiry, or P's scheduler
    aborts it).  The WRITE is cancelled in the same step that frees the
    blocks, and its late completion consumes nothing."""
    p = Side(plane(kv_lease_duration=6.0, transfer_timeout=100.0))
    out = _lease_and_push(p, "p1", 0.0, "reg_first")
    assert names(out) == ["StartHandshake", "PostWrite"]
    if end == "expired":
        p.until(6.0)
        at, step = 6.0, [a for t, a in p.log if t == 6.0]
    else:
        at, step = 3.0, p.handle(E.LeaseAbort(request_id="p1"), 3.0)
    reason = "expired" if end == "expired" else "aborted"
    assert A.FreeBlocks("p1", (7, 8), reason) in step and A.ReleaseXfer("p1", True) in step
    assert p.plane.get("push_write", "p1") is None
    # The fabric reports the cancelled WRITE done anyway: nothing is consumed twice.
    assert p.handle(E.WriteDone(request_id="p1"), at + 0.5) == []
    assert len(p.sent(A.FreeBlocks)) == 1
    assert [h[0] for h in p.plane.held()] == ["remote_engine"]
    assert p.plane.get("remote_engine", D_ENGINE).refs == set()
