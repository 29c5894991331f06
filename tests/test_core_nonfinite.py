"""Numbers that are not numbers: NaN and infinities fail closed in the core.

A comparison with NaN is false, so a gate written ``expiry <= now`` lets a
NaN expiry through.  Every gate that protects blocks (D's READ gate on P's
lease, the turn-2 gate on D's hold, P's push gate on D's deadline) must
decline when one of its inputs is not a finite number; the config refuses
such values with a clear error; a deadline that is not finite times out at
once instead of never; a clock that is not finite is refused.
"""
from __future__ import annotations

import math

import attrs
import msgspec
import pytest

from core_support import connect, names, new_request, of_type, plane, run_timers
from kvplane.statemachines import actions as A
from kvplane.statemachines.recv_failure import RecvFailure
from kvplane.statemachines import events as E
from kvplane.statemachines.config import ConfigError, PlaneConfig
from kvplane.statemachines.machines import decode_request, push_write
from kvplane.statemachines.plane import ControlPlane, NonFiniteTime
from kvplane.statemachines.stats import Anomaly, Final

NAN, INF = math.nan, math.inf
NON_FINITE = [NAN, INF, -INF]
CFG = PlaneConfig()


# ------------------------------------------------------------------ config
NUMERIC = [a.name for a in attrs.fields(PlaneConfig) if a.name not in ("kv_load_failure_policy", "heartbeat_spread")]


@pytest.mark.parametrize("field", NUMERIC)
@pytest.mark.parametrize("value", [NAN, INF, -INF, "30", None, True, -1.0])
def test_config_refuses_values_that_are_not_finite_numbers_in_range(field, value):
    if value is None and attrs.fields_dict(PlaneConfig)[field].default is None:
        assert getattr(PlaneConfig(**{field: None}), field) is None  # optional: None means "derived"
        return
    with pytest.raises(ConfigError) as info:
        PlaneConfig(**{field: value})
    assert isinstance(info.value, ValueError)
    assert info.value.field == field and str(info.value).startswith(f"{field}: must be")


@pytest.mark.parametrize("field, value", [
    ("kv_lease_duration", 5.99), ("decoder_kv_blocks_ttl", 0.0), ("engine_ttl", 0), ("handshake_timeout", 0.0),
    ("handshake_backoff", 0.0), ("transfer_timeout", 0.0), ("recv_timeout", 0.0), ("push_registration_timeout", 0.0),
    ("expiry_safety_margin", -0.001), ("handshake_max_attempts", 0), ("handshake_max_attempts", 65),
    ("handshake_max_attempts", 2.5), ("kv_load_failure_policy", "retry"),
])
def test_config_refuses_out_of_range_values(field, value):
    with pytest.raises(ConfigError, match=f"^{field}: must "):
        PlaneConfig(**{field: value})


def test_config_accepts_the_bounds():
    cfg = PlaneConfig(kv_lease_duration=6, expiry_safety_margin=0, handshake_max_attempts=64, engine_ttl=1e-3)
    assert cfg.heartbeat_interval == 1
    with pytest.raises(ConfigError, match="kv_lease_duration"):
        attrs.evolve(cfg, kv_lease_duration=NAN)  # evolve validates too


# --------------------------------------------------------- the gates, as guards
def _reader(*, remote_expiry=100.0, renewable=True, arrived=0.0):
    r = decode_request.DecodeRequest(key="r1", state="HANDSHAKING", engine_id="P0", remote_expiry=remote_expiry,
                                     remote_renewable=renewable, arrived=arrived)
    return r


def _ready(**kw):
    base = dict(kind="decode_request", request_id="r1", engine_id="P0", clock_offset=0.0)
    return E.EngineReady(**{**base, **kw})


GATE_INPUTS = ["remote_expiry", "clock_offset", "heartbeat_at", "heartbeats_since"]


@pytest.mark.parametrize("renewable", [True, False])
@pytest.mark.parametrize("field", GATE_INPUTS)
@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_read_gate_declines_when_an_input_is_not_finite(renewable, field, bad):
    """With every input finite the READ would go ahead; one of them NaN or
    infinite and it is declined, whichever way the infinity points."""
    good = dict(remote_expiry=100.0, clock_offset=3.0, heartbeat_at=9.0, heartbeats_since=2.0)
    now = 10.0
    r, ev = _reader(remote_expiry=good["remote_expiry"], renewable=renewable), _ready(
        clock_offset=good["clock_offset"], heartbeat_at=good["heartbeat_at"], heartbeats_since=good["heartbeats_since"])
    assert not decode_request.remote_blocks_expired(r, ev, CFG, now)
    if field == "remote_expiry":
        r = _reader(remote_expiry=bad, renewable=renewable)
    else:
        ev = msgspec.structs.replace(ev, **{field: bad})
    if not renewable and field in ("heartbeat_at", "heartbeats_since"):
        # A decoder's hold is a fixed TTL: heartbeats are not read at all.
        assert not decode_request.remote_blocks_expired(r, ev, CFG, now)
        return
    assert decode_request.remote_blocks_expired(r, ev, CFG, now)
    assert decode_request.remote_valid_until(r, ev, CFG) == -INF


@pytest.mark.parametrize("renewable", [True, False])
@pytest.mark.parametrize("now", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_read_gate_declines_at_a_time_that_is_not_a_number(renewable, now):
    r, ev = _reader(renewable=renewable), _ready()
    assert decode_request.remote_blocks_expired(r, ev, CFG, now)


def test_read_gate_declines_when_huge_finite_inputs_overflow():
    r, ev = _reader(remote_expiry=1.7e308, renewable=False), _ready(clock_offset=-1.7e308)
    assert decode_request.remote_blocks_expired(r, ev, CFG, 10.0)


@pytest.mark.parametrize("field", ["remote_deadline", "clock_offset"])
@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_push_gate_declines_when_an_input_is_not_finite(field, bad):
    p = push_write.PushWrite(key="p1", state="CONNECTING", engine_id="D0", remote_deadline=100.0)
    ev = E.EngineReady(kind="push_write", request_id="p1", engine_id="D0", clock_offset=3.0)
    assert not push_write.decoder_gives_up_first(p, ev, CFG, 10.0)
    if field == "remote_deadline":
        p.remote_deadline = bad
    else:
        ev = msgspec.structs.replace(ev, clock_offset=bad)
    assert push_write.decoder_gives_up_first(p, ev, CFG, 10.0)
    for now in NON_FINITE:
        assert push_write.decoder_gives_up_first(attrs.evolve(p, remote_deadline=100.0), _ready(), CFG, now)


# ------------------------------------------------------------ through the plane
def _read_through_plane(*, remote_expiry, offset, renewable=True, remote="p1"):
    """D gets params with ``remote_expiry`` and connects with clock ``offset``;
    returns what StartLoad produced."""
    d = plane()
    d.handle(new_request("r1", "P0", remote, remote_expiry=remote_expiry, remote_renewable=renewable), 0.0)
    connect(d, "P0", 0.5, offset=offset)
    d.handle(E.BlocksAllocated(request_id="r1", block_ids=(1, 2), num_remote_tokens=32), 1.0)
    return d, d.handle(E.StartLoad(request_id="r1"), 1.0)


@pytest.mark.parametrize("renewable", [True, False], ids=["p_lease", "turn2_hold"])
@pytest.mark.parametrize("what", ["expiry", "offset"])
@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_no_read_against_a_non_finite_expiry_or_offset(renewable, what, bad):
    """The issue's case: a NaN remote_expiry, or a NaN / -inf clock offset
    from the handshake, made D READ against an expired lease."""
    expiry, offset = (bad, 0.0) if what == "expiry" else (100.0, bad)
    d, out = _read_through_plane(remote_expiry=expiry, offset=offset, renewable=renewable)
    assert of_type(out, A.PostRead) == []
    assert A.ReportRecv("r1", False, (1, 2), RecvFailure.DECLINED) in out
    assert d.held() == [] or all(h[0] in ("remote_engine", "heartbeat") for h in d.held())


def test_handshake_samples_that_are_not_numbers_are_not_taken():
    d = plane()
    d.handle(new_request("r1", "P0", "p1"), 0.0)
    d.handle(E.HandshakeOk(engine_id="P0", samples=((NAN, 0.0001), (0.5, NAN), (-INF, 0.001), (7.0, -1.0),
                                                    (0.25, 0.01))), 0.5)
    assert d.get("remote_engine", "P0").clock_offset == 0.25
    # Only bad samples: the offset is unknown, and the gate declines on it.
    d, out = _read_through_plane(remote_expiry=100.0, offset=NAN)
    assert math.isnan(d.get("remote_engine", "P0").clock_offset)
    assert of_type(out, A.PostRead) == [] and A.ReportRecv("r1", False, (1, 2), RecvFailure.DECLINED) in out
    # A later good sample replaces it.
    connect(d, "P0", 2.0, offset=1.5)
    assert d.get("remote_engine", "P0").clock_offset == 1.5


@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_no_write_against_a_non_finite_push_deadline(bad):
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7, 8)), 0.0)
    p.handle(E.PushRegistered(request_id="p1", engine_id="D0", remote_request_id="r1", remote_block_ids=(1, 2),
                              remote_deadline=bad), 0.0)
    out = p.handle(E.PushReady(request_id="p1", block_ids=(7, 8)), 0.0)
    out += connect(p, "D0", 0.5)
    assert of_type(out, A.PostWrite) == []
    assert p.get("push_write", "p1") is None and p.stats[Final("push_write", "FAILED")] == 1


@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_a_lease_whose_duration_is_not_finite_expires_at_once(bad):
    """NaN would never compare due and infinity never come: either way the
    blocks would be held forever.  The deadline is cut to now instead."""
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7,), duration=bad), 3.0)
    assert p.get("lease", "p1").deadline == 3.0
    assert p.stats[Anomaly("nonfinite_deadline", "lease", "LeaseGranted")] == 1
    assert run_timers(p, 3.0) == [(3.0, A.FreeBlocks("p1", (7,), "expired"))]
    assert p.held() == []


@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_a_clock_that_is_not_finite_is_refused(bad):
    p = plane()
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7,)), 0.0)
    with pytest.raises(NonFiniteTime, match="now must be a finite number"):
        p.handle(E.LeaseHeartbeat(request_id="p1"), bad)
    with pytest.raises(NonFiniteTime):
        p.fire_due(bad)
    assert isinstance(NonFiniteTime("x"), ValueError)
    assert p.get("lease", "p1").deadline == PlaneConfig().kv_lease_duration
    assert run_timers(p, 100.0) == [(30.0, A.FreeBlocks("p1", (7,), "expired"))]


def test_a_plane_with_the_default_config_still_reads():
    """The finite path is untouched: the same READ with sane numbers goes ahead."""
    d, out = _read_through_plane(remote_expiry=100.0, offset=3.0)
    assert names(out) == ["PostRead"]
    assert isinstance(ControlPlane().config, PlaneConfig)
