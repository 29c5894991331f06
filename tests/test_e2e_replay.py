"""The event logs the end-to-end runs wrote replay through fresh machines
with no divergence and no leak, and the liveness monitors find nothing hot.

A SIGKILLed decoder's log stops mid-run: it must still replay without
divergence (its last line may be cut by the kill), but it legitimately ends
with requests in flight, so only the survivor is held to "no leak".
"""
from __future__ import annotations

import json
import os

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


def _rank_logs(s: dict) -> list[tuple[str, int, str]]:
    """(role, rank, path) of every worker rank's event log of the run."""
    out = []
    for role in ("P", "D"):
        ranks = (s["ranks"] or {}).get(role)
        if ranks and len(ranks) > 1 or s["tp"][role] > 1:
            out += [(role, r, os.path.join(os.path.dirname(s["logs"][role]),
                                           os.path.basename(s["logs"][role]).replace(".events", f".tp{r}.events")
                                           if r else os.path.basename(s["logs"][role])))
                    for r in range(s["tp"][role])]
        else:
            out.append((role, 0, s["logs"][role]))
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_logs_replay_without_divergence_or_leak(name, e2e_dir):
    s = run_scenario(name, e2e_dir)
    fault = s["fault"] or {}
    killed = fault.get("kind") == "kill" and "rank" not in fault
    for role, rank, path in _rank_logs(s):
        lines = _lines(path)
        assert len(lines) > 10, f"{role} log of {name} is nearly empty"
        result = replay_mod.replay(lines)
        assert result.divergence is None, f"{name} {role}: {result.divergence}"
        if role == "D" and (killed or rank in (s["lost_ranks"]["D"] or [])):
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
            ranks = s["ranks"]["P"]
            expired = s["leases"]["expired"] if len(ranks) == 1 else ranks[rank]["leases_ended"].get("expired", 0)
            assert result.leases.get("expired", 0) == expired
