"""The rank world (ExploreConfig.ranks): one plane per worker rank, P's TP
ranks each holding their own lease of a request, D's ranks each reading the
P ranks TpMapping names, both schedulers aggregating per-rank results.  The
real machines pass it with the rank faults; each mutation in MUTATIONS is
caught, with a counterexample whose per-rank logs replay exactly."""
from __future__ import annotations

import attrs
import pytest

from kvplane.app.offline.checks import cmd_explore, write_violation
from kvplane.statemachines.actions import SendHeartbeat
from kvplane.statemachines.events import LeaseHeartbeat
from kvplane.statemachines.emit import emits
from kvplane.statemachines.explorer import RANK_FAULTS, ExploreConfig, Model, RankModel, explore, model_for
from kvplane.statemachines.explorer.checks import Found
from kvplane.statemachines.explorer.messages import Notif
from kvplane.statemachines.explorer.moves import CrashRank, Deliver, Inject, Tick, TickLosing, schedule
from kvplane.statemachines.machine import compile_machine
from kvplane.statemachines.machines import MACHINES, heartbeat
from kvplane.statemachines.rank_results import Outcome, RankResults
from kvplane.statemachines.replay import replay
from kvplane.statemachines.spec import Transition

TP22 = dict(ranks=(2, 2), requests=("read",), faults=RANK_FAULTS)
TP12 = dict(ranks=(1, 2), requests=("read",), faults=RANK_FAULTS)  # one P rank, read by both D ranks


def ok(r):
    assert r.ok and not r.truncated, "\n".join(map(str, r.violations))
    return r


# ------------------------------------------------------------ the real machines pass
def test_real_machines_pass_tp2_to_tp2_with_rank_faults():
    r = ok(explore(**TP22, max_depth=14))
    assert r.states > 10_000


def test_real_machines_pass_one_holder_rank_two_readers():
    r = ok(explore(**TP12, max_depth=14))
    assert r.states > 5_000
    # The one P rank's lease expects both D ranks as consumers.
    model = RankModel(ExploreConfig(**TP12))
    w = model.initial()
    model.apply(w, schedule("arrive", 0))
    assert w.planes["P0"].get("lease", "p0").expected_consumers == 2
    assert [w.planes[d].get("decode_request", "d0").expected_consumers for d in ("D0", "D1")] == [2, 2]


def test_real_machines_pass_with_aborts_and_a_full_prefix_hit():
    ok(explore(ranks=(2, 2), requests=("hit",), faults=RANK_FAULTS, max_aborts=1, max_depth=12))


def test_ranks_select_the_rank_model_and_leave_the_default_alone():
    assert type(model_for(ExploreConfig())) is Model
    assert type(model_for(ExploreConfig(**TP22))) is RankModel
    with pytest.raises(ValueError, match="one holder rank per reader rank"):
        RankModel(ExploreConfig(ranks=(2, 1), requests=("read",)))
    with pytest.raises(ValueError, match="no turn 2"):
        RankModel(ExploreConfig(ranks=(2, 2), requests=("read2",)))


# ------------------------------------------------------------ each rank fault, step by step
def _run(model, moves):
    w = model.initial()
    for m in moves:
        model.apply(w, m)
    return w


def _drain(model, w):
    """The fault-free continuation to quiescence; nothing may be left."""
    for _ in range(400):
        m = model.drain_move(w)
        if m is None:
            assert model.quiescent_problems(w) == []
            return w
        model.apply(w, m)
    raise AssertionError("no quiescence")


def _lease_states(w, ranks=("P0", "P1")):
    return [getattr(w.planes[p].get("lease", "p0"), "state", None) for p in ranks]


START = [schedule("arrive", 0), Deliver(0), Deliver(0), schedule("alloc", 0), schedule("start", 0)]


def test_every_rank_has_its_own_lease_and_each_d_rank_heartbeats_the_p_rank_it_reads():
    model = RankModel(ExploreConfig(**TP22))
    w = _run(model, START[:3] + [Tick(), Tick(), Tick()])
    assert w.t == 3.0
    # As the connector's worker: D rank r's batch goes to TpMapping.sources(r) only, from D rank r.
    assert [w.planes[d].heartbeats.ranks("P") for d in ("D0", "D1")] == [(0,), (1,)]
    for p, d in (("P0", "D0"), ("P1", "D1")):
        lease = w.planes[p].get("lease", "p0")
        assert lease.expiry == 3.0 + model.cfg.plane.lease_extension
        assert lease.bound == {d}  # the heartbeat's sender bound the lease to its one reader rank
    w = _drain(model, w)
    assert _lease_states(w) == [None, None] and w.sent == [1] and w.recv == [True]


def test_one_p_rank_is_heartbeated_and_bound_by_both_d_ranks():
    model = RankModel(ExploreConfig(**TP12))
    w = _run(model, START[:3] + [Tick()])
    assert [w.planes[d].heartbeats.ranks("P") for d in ("D0", "D1")] == [(0,), (0,)]
    assert w.planes["P0"].get("lease", "p0").bound == {"D0", "D1"}
    w = _drain(model, w)
    assert w.sent == [1] and [x[3] for x in w.reports["P"] if x[0] == "report"] == [True]


class _HeartbeatsSeen(RankModel):
    """Records every (P rank, sender) a heartbeat reached; a heartbeat from a
    D rank that does not read that P rank is a violation."""

    def _feed(self, w, pname, event):
        if isinstance(event, LeaseHeartbeat):
            readers = self.mapping.readers_of(self.p_ranks.index(pname))
            if event.sender not in {self.d_ranks[r] for r in readers}:
                raise Found("heartbeat_to_a_rank_not_read", f"{event.sender}'s heartbeat reached {pname}")
        super()._feed(w, pname, event)


def test_d0s_heartbeat_never_reaches_p1():
    # Exhaustively, with every rank fault: D rank r heartbeats only its sources.
    ok(explore(**TP22, max_depth=12, model_factory=_HeartbeatsSeen))


def test_heartbeat_lost_to_one_rank_only():
    model = RankModel(ExploreConfig(**TP22))
    assert {(m.src, m.rank) for m in model.moves(_run(model, START[:3])) if isinstance(m, TickLosing)} == {
        ("D0", 0), ("D1", 1)}  # the only batches there are
    w = _run(model, START[:3] + [Tick(), Tick(), TickLosing("D0", 0)])
    assert w.t == 3.0 and w.faults == 1
    # P0 missed its renewal; P1 got D1's.
    assert [w.planes[p].get("lease", "p0").extensions for p in ("P0", "P1")] == [0, 1]
    w = _drain(model, w)
    assert w.sent == [1] and [x[3] for x in w.reports["P"] if x[0] == "report"] == [True, True]


def test_one_ranks_completion_notification_lost():
    model = RankModel(ExploreConfig(**TP22))
    w = _run(model, START + [Deliver(0), Deliver(0)])  # both READs execute
    lost = next(j for j, m in enumerate(w.net) if isinstance(m, Notif) and m.plane == "P1")
    model.apply(w, Inject("lose", lost))
    w = _drain(model, w)
    # P0's lease was consumed; P1's expired, and only then was finished_sending reported.
    assert ("P0", "p0") in w.freed and ("P1", "p0") in w.freed
    assert w.sent == [1] and w.recv == [True]
    assert [x[3] for x in w.reports["P"] if x[0] == "report"] == [True, False]


@pytest.mark.parametrize("dead", ["P0", "P1", "D0", "D1"])
def test_a_rank_crash_leaves_the_other_ranks_to_end_their_leases(dead):
    model = RankModel(ExploreConfig(**TP22))
    w = _run(model, START + [CrashRank(dead)])
    w = _drain(model, w)
    # Every live P rank's lease ended, P's scheduler reported finished_sending
    # once (failed: a rank was lost), D's scheduler got the aggregated recv.
    assert _lease_states(w) == [None, None]
    assert w.sent == [1] and w.recv == [True]
    assert ("lost", int(dead[1])) in w.reports[dead[0]]


# ------------------------------------------------------------ the mutation list
@emits(SendHeartbeat)
def _send_batch_to_rank0(b, ev, cfg, now):
    """the bug: the batch goes to rank 0 of the engine only"""
    return SendHeartbeat(b.engine_id, (0,), tuple(b.ids))


def _heartbeat_to_rank0_only():
    rows = tuple(attrs.evolve(e, actions=tuple(_send_batch_to_rank0 if a is heartbeat.send_batch else a
                                               for a in e.actions)) if isinstance(e, Transition) else e
                 for e in heartbeat.TABLE)
    assert rows != heartbeat.TABLE
    return {**MACHINES, "heartbeat": compile_machine(attrs.evolve(heartbeat.SPEC, table=rows))}


class _FinishedOnFirstRank(RankResults):
    """The bug: the first rank's report finishes the request (the others' are
    then ignored as reports for an unknown request)."""

    def _done(self, request_id, pending):
        del self._pending[request_id]
        return Outcome(request_id, ok=not pending.failed, failed_ranks=tuple(sorted(pending.failed)))


def _finished_before_every_rank(cfg, machines):
    return RankModel(cfg, machines, results=_FinishedOnFirstRank)


# name -> (explore keywords that make the mutant, the configuration, the violations it must produce)
MUTATIONS = {
    "heartbeat sent to rank 0 only": (
        dict(machines=_heartbeat_to_rank0_only()), dict(TP22, max_faults=0, max_aborts=0, max_depth=12),
        {"reader_rank_refused"}),
    "finished reported before every rank": (
        dict(model_factory=_finished_before_every_rank), dict(TP22, max_faults=0, max_aborts=0, max_depth=12),
        {"finished_sending_before_all_ranks", "finished_recving_before_all_ranks"}),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(name, tmp_path):
    mutant, cfg, kinds = MUTATIONS[name]
    ok(explore(**cfg))  # the real machines and aggregation pass the same configuration
    r = explore(**mutant, **cfg, stop_at_first=False)
    found = {v.kind for v in r.violations}
    assert kinds <= found, f"{name}: expected {kinds}, found {found}"
    for v in r.violations:
        assert v.moves and set(v.logs) == {"P0", "P1", "D0", "D1"}
        for p in write_violation(v, str(tmp_path / v.kind)):
            res = replay(p, machines=mutant.get("machines"))
            assert res.divergence is None, res.divergence


class _RefusalsIgnored(RankModel):
    refusals_found = False  # left to their consequences, as in the base model


def test_heartbeat_to_rank0_only_is_refused_and_reads_the_lease_rank1_let_expire():
    _, cfg, _ = MUTATIONS["heartbeat sent to rank 0 only"]
    r = explore(machines=_heartbeat_to_rank0_only(), **cfg)
    # D1's batch goes to P0, whose lease D0's batch bound first.
    assert r.violations[0].message.startswith("P0's lease p0 refused D1 (foreign_sender; bound to ['D0'])")
    # With refusals ignored: P1's lease is never renewed and expires while D1's gate trusts its chain.
    r = explore(machines=_heartbeat_to_rank0_only(), model_factory=_RefusalsIgnored, **cfg)
    assert "by D1 against P1's lease p0" in r.violations[0].message
    # With one P rank, rank 0 is every rank: the same mutant is harmless.
    ok(explore(machines=_heartbeat_to_rank0_only(), **dict(cfg, ranks=(1, 2))))


class _HeartbeatsToEveryRank(RankModel):
    """The old rank world: each D rank's batch to every P rank, with its sender."""

    def remote_ranks(self, dname):
        return tuple(range(len(self.p_ranks)))


def test_per_rank_senders_to_every_p_rank_would_break_the_binding():
    # The earlier finding, kept as a check that the model sees it: D0's batch
    # binds P1's lease (1 consumer), so D1, its real reader, is refused.
    _, cfg, _ = MUTATIONS["heartbeat sent to rank 0 only"]
    r = explore(model_factory=_HeartbeatsToEveryRank, **cfg)
    assert [v.kind for v in r.violations] == ["reader_rank_refused"]
    assert "refused D1" in r.violations[0].message or "refused D0" in r.violations[0].message
    r = explore(model_factory=type("_Both", (_HeartbeatsSeen, _HeartbeatsToEveryRank), {}), **cfg)
    assert r.violations[0].kind == "heartbeat_to_a_rank_not_read"


def test_cli_ranks_option():
    assert cmd_explore(["--ranks", "2x2", "--requests", "read", "--depth", "6", "--quiet"]) == 0
    assert cmd_explore(["--ranks", "2x1", "--quiet"]) == 2
    assert cmd_explore(["--ranks", "2x2", "--stall", "--quiet"]) == 2
