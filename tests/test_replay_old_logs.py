"""Logs recorded before the heartbeat batcher became a machine still replay.

Such a log has heartbeat timer lines without states and the batcher's engine
reference on EngineAcquire/EngineRelease lines of their own (recorded by
main at eb8d475 from test_replay.recorded_session); the machine now does
both inside the heartbeat line.
"""
from __future__ import annotations

from pathlib import Path

from kvplane.statemachines.replay import replay

OLD = Path(__file__).parent / "logs" / "heartbeat_batcher_before_machine.jsonl"


def test_a_log_from_the_old_batcher_replays_exactly():
    lines = OLD.read_text().splitlines()
    assert any('"machine":"heartbeat:e"' in x and '"state_before":null' in x for x in lines)
    assert any('"requester_kind":"heartbeat"' in x and '"event":"EngineRelease"' in x for x in lines)
    r = replay(str(OLD))
    assert r.divergence is None and r.ok and r.held == []


def test_an_old_heartbeat_line_still_checks_what_was_sent():
    lines = [x.replace('"request_ids":["x"]', '"request_ids":["y"]', 1) for x in OLD.read_text().splitlines()]
    r = replay(lines)
    assert r.divergence is not None and r.divergence.what == "actions"


# Recorded by main at 5a6f572^ (before engines became STALE at half the TTL,
# and before heartbeat_spread) from test_replay.recorded_session, with a
# MemoryLog that writes no config header: the engine's timer is armed at
# engine_ttl (60.5), today's default arms it at 30.5.
NO_HEADER = Path(__file__).parent / "logs" / "engine_stale_at_ttl_no_header.jsonl"


def test_a_header_less_log_of_an_older_version_replays_as_recorded():
    lines = NO_HEADER.read_text().splitlines()
    assert '"config"' not in lines[0] and '"at":60.5' in lines[2]
    r = replay(str(NO_HEADER))
    assert r.divergence is None and r.ok and r.held == []
    assert r.assumed is not None and "engine_ttl" in r.assumed
    assert r.config.engine_stale_after == r.config.engine_ttl and r.config.heartbeat_spread is False
    assert r.engines_evicted == 1
    # The same lines (a list, as tests pass them) and the liveness monitors too.
    assert replay(lines).assumed == r.assumed
    from kvplane.statemachines.monitors import check_log

    report = check_log(str(NO_HEADER))
    assert report.replay.divergence is None and report.hot == []


def test_a_header_less_log_of_today_replays_under_todays_defaults():
    import test_replay
    from kvplane.statemachines.config import PlaneConfig

    lines = [x for x in test_replay.recorded_session()[1] if '"config"' not in x]
    r = replay(lines)
    assert r.divergence is None and r.assumed is None and r.config == PlaneConfig()


def test_a_header_less_log_that_no_version_reproduces_still_diverges():
    lines = NO_HEADER.read_text().splitlines()
    lines[2] = lines[2].replace('"at":60.5', '"at":61.5')
    r = replay(lines)
    assert r.divergence is not None and r.divergence.line == 3 and r.assumed is None
