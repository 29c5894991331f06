"""The main job's summary counts leases and evicted engines the way replay
of its own logs does (``LifecycleCounts``, one observer used by both): a
run's table once read "P leases extended 48" and "engines evicted 0" where
replay of the same logs read 0 and 1."""
from __future__ import annotations

import pytest

from e2e_support import run_scenario
from kvplane.statemachines.replay import replay


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.mark.parametrize("name", ["normal", "tp1_2"])
def test_the_summary_counts_what_replay_of_the_logs_counts(e2e_dir, name):
    s = run_scenario(name, e2e_dir)
    for role in ("P", "D"):
        side = s["sides"][role]
        replays = [replay(rank["log"]) for rank in side["ranks"]]
        assert all(r.divergence is None for r in replays)
        leases = {what: sum(r.leases[what] for r in replays) for what in ("granted", "extended", "expired", "released")}
        evicted = sum(r.engines_evicted for r in replays)
        evictions = sorted((e for r in replays for e in r.evictions), key=lambda e: e["at"])
        assert s["lifecycle"][role] == {"leases": leases, "engines_evicted": evicted, "evictions": evictions}, role
        assert side["engines_evicted"] == evicted
    # The lease rows of summary.json follow the machines too.
    assert s["leases"]["extended"] == s["lifecycle"]["P"]["leases"]["extended"]
    assert s["engines_evicted"] == s["lifecycle"]["P"]["engines_evicted"] + s["lifecycle"]["D"]["engines_evicted"]
    # Each side ends by disconnecting its peer: an eviction in the machine, counted by both.
    assert s["engines_evicted"] >= 2
