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
