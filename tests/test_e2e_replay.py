"""The event logs the end-to-end runs wrote replay through fresh machines
with no divergence and no leak, and the liveness monitors find nothing hot.

A SIGKILLed decoder's log stops mid-run: it must still replay without
divergence (its last line may be cut by the kill), but it legitimately ends
with requests in flight, so only the survivor is held to "no leak".
"""
from __future__ import annotations

import json

import pytest

from e2e_support import SCENARIOS, run_scenario

TIMER_JITTER_S = 0.25

replay_mod = pytest.importorskip("kvplane.statemachines.replay")
monitors = pytest.importorskip("kvplane.statemachines.monitors")


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()  # cut by SIGKILL mid-write
    return lines


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_logs_replay_without_divergence_or_leak(name, e2e_dir):
    s = run_scenario(name, e2e_dir)
    killed = (s["fault"] or {}).get("kind") == "kill"
    for role in ("P", "D"):
        path = s["logs"][role]
        lines = _lines(path)
        assert len(lines) > 10, f"{role} log of {name} is nearly empty"
        result = replay_mod.replay(lines)
        assert result.divergence is None, f"{name} {role}: {result.divergence}"
        if role == "D" and killed:
            continue
        assert result.held == [], f"{name} {role} leaks: {result.held}"
        report = monitors.check_log(lines)
        # A polled embedder fires a timer on its first loop tick after the
        # deadline (~1 ms, more on a busy machine); the monitor reports any
        # lateness, so only lateness beyond the loop's jitter counts here:
        # 0.25 s plus the longest gap the side's loop measured in this run.
        jitter = TIMER_JITTER_S + s["loop"][role]["max_gap_s"]
        hot = [h for h in report.hot
               if h.reason != "past_deadline" or h.at - h.deadline > jitter]
        assert hot == [], f"{name} {role}: {hot[:3]}"
        if role == "P":
            # The replayed lease lifecycle agrees with what the run reported.
            assert result.leases["granted"] == s["leases"]["granted"]
            assert result.leases.get("expired", 0) == s["leases"]["expired"]
