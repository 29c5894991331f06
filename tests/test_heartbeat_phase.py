"""Heartbeat phases (PlaneConfig.heartbeat_spread): engines spread over the
interval, each on its own deterministic grid, with the lease guarantee kept."""
import json

import pytest

from kvplane.statemachines import actions as A
from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.heartbeat_phase import next_slot, phase
from kvplane.statemachines.plane import ControlPlane

from core_support import connect, heartbeats_to_leases, new_request, of_type, run_timers

ENGINES = [f"P{i}" for i in range(64)]


def sends(cfg: PlaneConfig, until: float, arrive_at: float = 0.0) -> dict[str, list[float]]:
    """Every engine gets its first request in the same step; when each engine's batches go out."""
    d = ControlPlane(cfg)
    for i, e in enumerate(ENGINES):
        d.handle(new_request(f"r{i}", e, f"p{i}"), arrive_at)
        connect(d, e, arrive_at)
    out: dict[str, list[float]] = {e: [] for e in ENGINES}
    for t, a in run_timers(d, until):
        if isinstance(a, A.SendHeartbeat):
            out[a.engine_id].append(t)
    return out


def test_the_phase_is_the_engine_ids_and_the_same_in_every_run():
    assert phase("P0", 5.0) == phase("P0", 5.0)
    phases = [phase(e, 5.0) for e in ENGINES]
    assert all(0 <= p < 5.0 for p in phases)
    assert len(set(phases)) == len(ENGINES)


@pytest.mark.parametrize("now", [0.0, 3.25, 1000.0, 12345.678])
def test_the_next_slot_is_at_most_one_interval_on_and_on_the_engines_grid(now):
    cfg = PlaneConfig(heartbeat_spread=True)
    interval = cfg.heartbeat_interval
    for e in ENGINES[:8]:
        at = next_slot(e, now, cfg)
        assert now < at <= now + interval
        k = (at - phase(e, interval)) / interval
        assert abs(k - round(k)) < 1e-9


def test_engines_started_in_one_step_send_spread_over_the_interval():
    cfg = PlaneConfig(heartbeat_spread=True)
    interval = cfg.heartbeat_interval
    got = sends(cfg, 100.0 + 10 * interval, arrive_at=100.0)
    firsts = sorted(times[0] for times in got.values())
    # No two engines in lockstep, and the first batches cover the interval.
    assert len(set(firsts)) == len(ENGINES)
    assert firsts[0] < 100.0 + interval / 4 and firsts[-1] > 100.0 + 3 * interval / 4
    for times in got.values():
        assert 100.0 < times[0] <= 100.0 + interval
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert gaps and all(g == pytest.approx(interval) for g in gaps)


def test_without_spread_every_engine_keeps_the_step_it_started_in():
    cfg = PlaneConfig(heartbeat_spread=False)
    interval = cfg.heartbeat_interval
    got = sends(cfg, 4 * interval)
    assert {tuple(times) for times in got.values()} == {tuple(k * interval for k in range(1, 5))}


def test_spread_heartbeats_keep_a_lease_alive_and_a_silent_decoder_lets_it_expire():
    cfg = PlaneConfig(heartbeat_spread=True)
    d, p = ControlPlane(cfg), ControlPlane(cfg)
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(7,)), 0.0)
    d.handle(new_request("r1", "P-far", "p1"), 0.0)
    connect(d, "P-far", 0.0)
    last = None
    while (at := d.next_deadline()) is not None and at <= 300.0:
        out = d.fire_due(at)
        if of_type(out, A.SendHeartbeat):
            last = at
            heartbeats_to_leases(out, p, at)
        assert of_type(p.fire_due(at), A.FreeBlocks) == []
    assert last is not None and last > 300.0 - cfg.heartbeat_interval
    assert p.fire_due(last + cfg.lease_extension) == [A.FreeBlocks("p1", (7,), "expired")]


def test_a_log_recorded_with_spread_heartbeats_replays_exactly():
    from kvplane.statemachines.eventlog import MemoryLog
    from kvplane.statemachines.replay import replay

    cfg = PlaneConfig(heartbeat_spread=True)
    d = ControlPlane(cfg)
    log = d.recorder = MemoryLog(config=cfg)
    for i, e in enumerate(ENGINES[:4]):
        d.handle(new_request(f"r{i}", e, f"p{i}"), 1.0)
        connect(d, e, 1.0)
    assert of_type([a for _, a in run_timers(d, 40.0)], A.SendHeartbeat)
    result = replay(log.lines())
    assert result.config == cfg and result.divergence is None


def test_spread_is_the_default_and_a_log_header_without_the_key_replays_lockstep():
    from kvplane.statemachines.eventlog import header, parse_config

    assert PlaneConfig().heartbeat_spread
    recorded = PlaneConfig(heartbeat_spread=True)
    assert parse_config(json.loads(header(recorded))["config"], 1) == recorded
    assert not parse_config(json.loads(header(PlaneConfig(heartbeat_spread=False)))["config"], 1).heartbeat_spread
    # A header written before the key existed: its batches went out in lockstep.
    old = json.loads(header(PlaneConfig()))["config"]
    del old["heartbeat_spread"]
    assert parse_config(old, 1) == PlaneConfig(heartbeat_spread=False)
