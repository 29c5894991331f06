"""The command line as an operator sees it (issue 14, items 3-6): help and
version, progress, readable output, and the --json objects."""
from __future__ import annotations

import argparse

import io
import json

import attrs
import pytest

from kvplane.app.offline.checks import violation_note_path, write_counterexamples, write_violation_notes
from kvplane.app.cli import build_parser, main, version
from kvplane.app.offline.progress import ExploreProgress, explore_line
from kvplane.statemachines.explorer import SearchProgress, explore
from kvplane.statemachines.machine import compile_machine
from kvplane.statemachines.machines import MACHINES, lease
from kvplane.statemachines.stats import Anomaly, Ignored

from test_replay import recorded_session


def _json_out(capsys) -> dict:
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out  # one object, nothing else on stdout
    return json.loads(lines[0])


def _leaky_lease_machines():
    """A lease without its deadline: the explorer finds it never expires."""
    states = tuple(attrs.evolve(s, deadline=None) if s.name in lease.HELD else s for s in lease.STATES)
    return {**MACHINES, "lease": compile_machine(attrs.evolve(lease.SPEC, states=states), check=False)}


# ------------------------------------------------------------------ help and version (item 3)
def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvplane {version()}"
    assert version()[0].isdigit()


def test_help_reads_as_help_and_names_the_bench_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "import" not in out  # not the module docstring
    for verb in ("run", "replay", "check-log", "explore", "diagrams"):
        assert verb in out
    assert "python -m bench" in out and "exit status" in out


@pytest.mark.parametrize("verb", ["run", "explore", "check-log", "replay", "diagrams"])
def test_every_option_has_help_and_shows_its_default(verb):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd").choices[verb]
    text = sub.format_help()
    for action in sub._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{verb} {action.option_strings or action.dest} has no help"
        if action.default == argparse.SUPPRESS:
            # Defaults that differ by engine are stated in words.
            assert "default" in action.help, (verb, action.dest)
        elif action.option_strings and action.default not in (None, False):
            assert f"(default: {action.default})" in " ".join(text.split()), (verb, action.dest)


def test_bench_help_names_itself():
    from bench.__main__ import build_parser as bench_parser

    text = bench_parser().format_help()
    assert text.startswith("usage: python -m bench") and "``" not in text


# ------------------------------------------------------------------ explorer progress (item 4)
def test_the_search_reports_progress_as_counts():
    seen: list[SearchProgress] = []
    r = explore(requests=("read",), max_depth=6, progress=seen.append, progress_every=10)
    assert seen and all(isinstance(p, SearchProgress) for p in seen)
    assert [p.expanded for p in seen] == [10 * (i + 1) for i in range(len(seen))]
    assert all(p.states <= r.states and p.depth <= 6 and p.max_depth == 6 for p in seen)
    assert [p.states for p in seen] == sorted(p.states for p in seen)


def test_a_progress_line_has_states_depth_rate_and_eta():
    p = SearchProgress(states=2000, expanded=1500, transitions=4000, depth=7, frontier=500, violations=0,
                       max_depth=10, max_states=10000)
    line = explore_line(p, elapsed=2.0)
    assert "2,000 states" in line and "depth 7/10" in line and "1,000 states/s" in line
    assert "at most 8 s more" in line


def test_progress_off_a_terminal_is_a_line_every_few_seconds():
    clock = iter([0.0, 1.0, 6.0, 7.0, 12.5]).__next__
    stream = io.StringIO()
    p = SearchProgress(states=10, expanded=5, transitions=20, depth=1, frontier=5, violations=0, max_depth=4,
                       max_states=100)
    with ExploreProgress(stream=stream, clock=clock, live=False) as shown:
        for _ in range(4):
            shown.update(p)
    assert len(stream.getvalue().splitlines()) == 2


def test_explore_json_is_quiet_on_stderr(capsys):
    assert main(["explore", "--requests", "read", "--depth", "5", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    obj = json.loads(captured.out)
    assert obj["command"] == "explore" and obj["ok"] is True and obj["violations"] == []
    assert obj["states"] > 0 and obj["config"]["max_depth"] == 5 and obj["config"]["requests"] == ["read"]
    assert obj["schema"] == 1 and obj["truncated"] is False


def test_explore_json_refuses_bad_arguments_with_exit_2(capsys):
    assert main(["explore", "--requests", "nope", "--json"]) == 2
    obj = _json_out(capsys)
    assert obj["ok"] is False and "nope" in obj["error"]


# ------------------------------------------------------------------ readable output (item 5)
def test_stat_keys_have_labels_in_words_and_stable_names():
    key = Ignored("lease", "LEASED", "LeaseHeartbeat")
    assert str(key) == "ignored:lease:LEASED:LeaseHeartbeat"
    assert key.label == "ignored LeaseHeartbeat in lease LEASED"
    assert Anomaly("unknown_id", "lease", "LeaseHeartbeat").label == "LeaseHeartbeat for an unknown lease id"


def test_counterexample_steps_are_words_not_reprs():
    r = explore(machines=_leaky_lease_machines(), requests=("read",), max_faults=0, max_depth=6)
    steps = r.violations[0].moves
    assert steps and not any("Handshake(" in s or "Read(" in s or "('" in s for s in steps)
    assert steps[0].startswith("request 0 (read) arrives: P grants lease p0")


def test_a_replayed_counterexample_names_the_violated_property(tmp_path, capsys):
    r = explore(machines=_leaky_lease_machines(), requests=("read",), max_faults=0, max_depth=6)
    v = r.violations[0]
    logs = write_counterexamples(r, str(tmp_path))
    notes = write_violation_notes(r, str(tmp_path))
    assert notes == [violation_note_path(p) for p in logs][:1]
    p_log = next(p for p in logs if p.endswith(".P.jsonl"))
    main(["replay", p_log])
    out = " ".join(capsys.readouterr().out.split())
    assert f"counterexample of the explorer's property {v.kind}: {v.message}" in out
    main(["replay", "--json", p_log])
    obj = _json_out(capsys)
    assert obj["counterexample_of"]["kind"] == v.kind and obj["counterexample_of"]["steps"] == v.moves


def test_check_log_times_are_relative_to_the_log_start(tmp_path, capsys):
    lines = ['{"v":1,"t":1000,"event":"LeaseGranted","data":{"request_id":"a","block_ids":[1]}}',
             '{"v":1,"t":1050,"event":"LeaseHeartbeat","data":{"request_id":"zz"}}']
    path = tmp_path / "leak.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["check-log", str(path)]) == 1
    out = capsys.readouterr().out
    assert "over 50 s" in out and str(path.resolve()) in out
    row = next(line for line in out.splitlines() if "blocks" in line)
    assert " 0 " in row and " 30 " in row and "1030" not in row
    assert main(["check-log", "--json", str(path)]) == 1
    obj = _json_out(capsys)
    hot = obj["hot"][0]
    assert (hot["since_s"], hot["deadline_s"], hot["since_t"], hot["deadline_t"]) == (0, 30, 1000, 1030)
    assert obj["start_t"] == 1000 and obj["log"] == str(path.resolve())


# ------------------------------------------------------------------ --json (item 6)
def test_replay_json(tmp_path, capsys):
    _, lines = recorded_session()
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(lines) + "\n")
    assert main(["replay", "--json", str(good)]) == 0
    obj = _json_out(capsys)
    assert obj["command"] == "replay" and obj["ok"] is True and obj["divergence"] is None and obj["held"] == []
    assert obj["leases"] == {"granted": 1, "extended": 1, "expired": 1, "released": 0}
    assert obj["requests"] == {"RELEASED": 1} and obj["lines"] == len(lines) - 1  # the config header is no event

    leak = tmp_path / "leak.jsonl"
    leak.write_text('{"v":1,"t":0,"event":"LeaseGranted","data":{"request_id":"a","block_ids":[1]}}\n'
                    '{"v":1,"t":1,"event":"ReadDone","data":{"request_id":"nope"}}\n')
    assert main(["replay", "--json", str(leak)]) == 1
    obj = _json_out(capsys)
    assert obj["ok"] is False
    assert obj["held"] == [{"machine": "lease", "id": "a", "state": "LEASED", "holds": ["blocks"]}]
    assert obj["anomalies"] == [{"key": "unknown_id:decode_request:ReadDone",
                                 "label": "ReadDone for an unknown decode_request id", "count": 1}]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"v":7,"t":0,"event":"Abort","data":{"request_id":"a"}}\n')
    assert main(["replay", "--json", str(bad)]) == 2
    assert "log version 7" in _json_out(capsys)["error"]


def test_check_log_json(tmp_path, capsys):
    _, lines = recorded_session()
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(lines) + "\n")
    assert main(["check-log", "--json", str(good)]) == 0
    obj = _json_out(capsys)
    assert obj["command"] == "check-log" and obj["ok"] is True and obj["hot"] == [] and obj["discharged"] > 0
    assert obj["grace_s"] == 0.5 and obj["divergence"] is None
    assert main(["check-log", "--json", "--grace", "nan", str(good)]) == 2
    assert "bad --grace" in _json_out(capsys)["error"]


# ------------------------------------------------------------------ kvplane run's report (items 4, 5)
def _run_summary(**over) -> dict:
    """A summary as build_summary writes it, trimmed to what the table reads."""
    side = {"heartbeats_sent": 5, "heartbeats_received": 4, "engines_evicted": 1}
    s = {
        "requests": {"turn1": {"ok": 6, "recomputed": 1, "corrupt": 0, "failed": 1, "skipped": 0, "abandoned": 0,
                               "pending": 0},
                     "turn2": {"ok": 2, "recomputed": 0, "corrupt": 0, "failed": 0, "skipped": 0, "abandoned": 0,
                               "pending": 0},
                     "total": 8, "multiturn": 2, "late_turn2": 0},
        "recompute_reasons": {"turn1": {}, "turn2": {}}, "bytes_moved": 2**20, "bytes_verified": 2**20,
        "gbps_in_flight": 1.0, "gbps_wall": 0.1, "leases": {"granted": 8, "extended": 3, "expired": 0, "consumed": 8},
        "holds": {"granted": 2, "consumed": 2}, "heartbeats_sent": 10, "heartbeats_received": 8,
        "engines_evicted": 2, "blocks_held": {"P": 0, "D": 0}, "fault": None, "loop": {}, "abandoned": None,
        "wall_s": 3.0, "startup_s": 20.0, "wall_with_startup_s": 23.0, "errors": [], "expired_before_fault": [],
        "checks": {"no_errors": True, "p_blocks_held_zero": True, "all_turn1_ok": False},
        "sides": {"P": dict(side), "D": dict(side)}, "requests_detail": [],
    }
    s.update(over)
    return s


def _table_text(summary: dict) -> str:
    from rich.console import Console

    from kvplane.app.job.report import summary_table

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(summary_table(summary))
    return console.export_text()


def test_a_failed_check_says_why_in_the_table():
    from kvplane.app.job.report import check_reasons

    s = _run_summary()
    s["check_reasons"] = check_reasons(s)
    assert s["check_reasons"] == {"all_turn1_ok": "6 of 8 ok: 1 recomputed, 1 failed"}
    text = _table_text(s)
    assert "FAIL: 6 of 8 ok: 1 recomputed, 1 failed" in text and "pass" in text


def test_counts_of_a_killed_side_read_na_not_zero():
    s = _run_summary(holds=None, blocks_held={"P": 0, "D": None}, fault={"kind": "kill", "at_s": 1.0,
                                                                         "leases_reclaimed_after_fault": 3,
                                                                         "leases_expired_after_fault": 3})
    s["sides"]["D"] = None
    text = _table_text(s)
    row = next(line for line in text.splitlines() if "D holds granted" in line)
    assert "n/a (killed)" in row and " 0 / 0" not in row
    row = next(line for line in text.splitlines() if "heartbeats sent" in line)
    assert "n/a (P 5; D lost)" in row
    assert "0 / n/a (killed)" in next(line for line in text.splitlines() if "blocks still held" in line)


def test_the_wall_time_is_given_with_and_without_start_up():
    text = _table_text(_run_summary())
    assert "3.0 s / 23.0 s (start-up 20.0 s)" in text


def test_the_progress_count_names_its_unit():
    from kvplane.app.job.options import RunOptions
    from kvplane.app.job.orchestrator import progress_unit
    from kvplane.app.job.workload import make_stream

    opts = RunOptions(requests=48)
    reqs = make_stream(opts)
    turn2 = sum(r.hold for r in reqs)
    assert turn2 and progress_unit(opts, reqs) == f"48 turn-1 + {turn2} turn-2 requests"


def test_a_failed_handshake_warning_says_how_long_the_engine_backs_off():
    from types import SimpleNamespace

    from kvplane.connector.driver import PlaneDriver
    from kvplane.statemachines import events as E
    from kvplane.statemachines.config import PlaneConfig
    from kvplane.statemachines.plane import ControlPlane

    plane = ControlPlane(PlaneConfig(handshake_max_attempts=2))
    plane.handle(E.NewRequest(request_id="r1", engine_id="e", remote_request_id="x", remote_block_ids=[1]), 0.0)
    driver = SimpleNamespace(plane=plane, config=plane.config)
    assert PlaneDriver._retry_words(driver, "e") == "its requests recompute; no new attempt for 1 s (consecutive failure 1)"
    plane.handle(E.HandshakeFailed(engine_id="e", reason="timed out"), 0.1)
    for attempt in (2, 3):  # the heartbeat tick acquires the engine again once the backoff is over
        plane.fire_due(10.0 * attempt)
        assert plane.get("remote_engine", "e").attempts == attempt
        # Doubled once, then capped (handshake_max_attempts 2: one doubling).
        assert PlaneDriver._retry_words(driver, "e") == \
            f"its requests recompute; no new attempt for 2 s (consecutive failure {attempt})"
        plane.handle(E.HandshakeFailed(engine_id="e", reason="timed out"), 10.0 * attempt + 0.1)
    assert PlaneDriver._retry_words(driver, "nobody") == "no handshake in progress"
