"""Property: whatever the decoder's stalls and queueing, a READ is posted
only against a prefill lease that is still held, with time to spare.

Two planes (D reads, P leases) on one simulated timeline, clocks skewed by
a fixed offset.  D's loop may stall for any stretch (no timers fired, so
no heartbeats), P's never does; heartbeats sent are delivered at once.
Whenever D posts a READ, P's lease for it must exist and its expiry, in
D's clock, must lie beyond the post time.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.statemachines import actions as A
from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.plane import ControlPlane

CFG = PlaneConfig(kv_lease_duration=12.0)  # interval 2 s, extension 8 s
STEP = 0.5

schedules = st.fixed_dictionaries({
    "offset": st.sampled_from([0.0, 40.0, -25.0]),  # P clock - D clock
    "requests": st.lists(
        st.tuples(st.floats(0, 20), st.floats(0, 40)),  # (arrival, queueing before allocation)
        min_size=1, max_size=4),
    "stalls": st.lists(st.tuples(st.floats(0, 60), st.floats(0.5, 25)), max_size=3),  # (start, length)
})


def simulate(s, machines=None) -> list[str]:
    """Run one schedule; asserts the property at every READ; returns the reads."""
    d, p = ControlPlane(CFG, machines), ControlPlane(CFG, machines)
    off = s["offset"]
    stalled = lambda t: any(a <= t < a + n for a, n in s["stalls"])  # noqa: E731
    reqs = {f"r{i}": (arr, arr + q) for i, (arr, q) in enumerate(s["requests"])}
    expiry, arrived, allocated = {}, set(), set()
    posted = []
    t = 0.0
    while t <= 100.0:
        # P prefills and leases on its own clock and never stalls.
        p.fire_due(t + off)
        for rid, (arr, _) in reqs.items():
            if rid not in expiry and t >= arr:
                p.handle(E.LeaseGranted(request_id="p" + rid, block_ids=(1,)), t + off)
                expiry[rid] = p.get("lease", "p" + rid).expiry
        if not stalled(t):
            out = d.fire_due(t)
            for rid, (_arr, alloc) in reqs.items():
                if rid in expiry and rid not in arrived:
                    # The params reach D when its loop runs.
                    arrived.add(rid)
                    out += d.handle(E.NewRequest(request_id=rid, engine_id="P", remote_request_id="p" + rid,
                                                 remote_block_ids=(1,), remote_expiry=expiry[rid],
                                                 remote_renewable=True), t)
                    if d.get("remote_engine", "P").state == "HANDSHAKING":
                        out += d.handle(E.HandshakeOk(engine_id="P", samples=((off, 0.001),)), t)
                if rid in arrived and rid not in allocated and t >= alloc:
                    allocated.add(rid)
                    d.handle(E.BlocksAllocated(request_id=rid, block_ids=(9,), num_remote_tokens=16), t)
                    out += d.handle(E.StartLoad(request_id=rid), t)
            for a in out:
                if isinstance(a, A.SendHeartbeat):
                    for pid in a.request_ids:
                        p.handle(E.LeaseHeartbeat(request_id=pid), t + off)
                elif isinstance(a, A.PostRead):
                    lease = p.get("lease", a.remote_request_id)
                    assert lease is not None and lease.state in ("LEASED", "PARTIALLY_READ"), \
                        f"READ of a lease that is gone at t={t}: {a} {s}"
                    assert lease.expiry - off > t, f"READ of a lease expiring at {lease.expiry - off} at t={t}: {s}"
                    posted.append(a.request_id)
                    # Complete the READ at once so the lease is consumed.
                    out += d.handle(E.ReadDone(request_id=a.request_id), t)
                    p.handle(E.ConsumerDone(request_id=a.remote_request_id, consumer="D",
                                            expected_consumers=1), t + off)
        t += STEP
    # Every allocated request ended: read, or declined and reported failed.
    assert all(d.get("decode_request", rid) is None or d.get("decode_request", rid).state in
               ("RECV_DONE", "RECV_FAILED") for rid in allocated)
    return posted


@settings(max_examples=120, deadline=None)
@given(schedules)
def test_no_read_of_a_lease_that_may_be_gone(s):
    simulate(s)


def test_reads_happen_when_heartbeats_flow():
    # Queued for three lease durations, no stall: the read still goes ahead.
    assert simulate({"offset": 40.0, "requests": [(0.0, 36.0)], "stalls": []}) == ["r0"]


def test_the_property_has_teeth_without_the_heartbeat_chain():
    """With the chain check removed, a stall right before allocation makes D
    read a lease P already reclaimed, and the property's assertion fires."""
    import pytest

    from core_support import trusting_gate_machine
    from kvplane.statemachines.machines import MACHINES

    buggy = {**MACHINES, "decode_request": trusting_gate_machine()}
    stall_before_alloc = {"offset": 0.0, "requests": [(0.0, 30.0)], "stalls": [(15.0, 14.0)]}
    assert simulate(stall_before_alloc) == []  # the real gate declines
    with pytest.raises(AssertionError, match="READ of a lease"):
        simulate(stall_before_alloc, buggy)


# ------------------------------------------------------ inputs that are not numbers
_finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
_non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])


@settings(max_examples=300, deadline=None)
@given(expiry=_finite, offset=_finite, arrived=_finite, hb=st.one_of(st.none(), _finite), gap=st.floats(0, 100),
       now=_finite, renewable=st.booleans(), spoil=st.sampled_from(["remote_expiry", "clock_offset", "heartbeat_at",
                                                                    "heartbeats_since", "now"]),
       bad=_non_finite)
def test_the_gate_declines_whenever_an_input_is_not_finite(expiry, offset, arrived, hb, gap, now, renewable, spoil,
                                                           bad):
    """Whatever the finite inputs, replacing one that the gate reads by NaN
    or an infinity makes it decline (never a READ on a number it cannot
    compare)."""
    import attrs

    from kvplane.statemachines.machines.decode_request import DecodeRequest, remote_blocks_expired

    since = None if hb is None else hb - gap
    r = DecodeRequest(key="r", state="HANDSHAKING", remote_expiry=expiry, remote_renewable=renewable,
                      arrived=arrived)
    ev = E.EngineReady(kind="decode_request", request_id="r", engine_id="P", clock_offset=offset, heartbeat_at=hb,
                       heartbeats_since=since)
    if spoil == "remote_expiry":
        r.remote_expiry = bad
    elif spoil == "now":
        now = bad
    elif spoil in ("heartbeat_at", "heartbeats_since"):
        if not renewable:
            return  # a fixed-TTL hold does not read heartbeats
        ev = attrs.evolve(ev, heartbeat_at=bad if spoil == "heartbeat_at" else (hb if hb is not None else 0.0),
                          heartbeats_since=bad if spoil == "heartbeats_since" else (since if since is not None else 0.0))
    else:
        ev = attrs.evolve(ev, clock_offset=bad)
    assert remote_blocks_expired(r, ev, CFG, now)
