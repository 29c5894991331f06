"""The scheduler/worker split and tensor parallelism, over the loopback
transport: a scheduler-side connector and one worker-side connector per
rank, talking only through pickled records."""
from __future__ import annotations

import gc
import logging
import types

import pytest
import torch

from loopback_support import Clock, run
from split_support import SplitEngine, block_value, engine_pairs

from kvplane.connector.params import BadTransferParams
from kvplane.statemachines.machines import LOGGED_MACHINES
from kvplane.statemachines.plane import ControlPlane
from kvplane.connector.records import (RECORD_VERSION, BadRecord, RecordVersionMismatch, StepMeta, WorkerReport,
                                       check)

CFG = dict(kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def engines(clock):
    """``engines(p_tp, d_tp)`` -> (fabric, P, D) on the test's clock, closed after the test."""
    with engine_pairs(clock, **CFG) as make:
        yield make


def pull(p: SplitEngine, d: SplitEngine, blocks=(1, 2, 3), local=(5, 6, 7), hold=False):
    p.fill(7, blocks)
    p.sched.on_new_request("r1", {"do_remote_decode": True})
    delay, params = p.sched.request_finished("r1", blocks, reader_tp=d.tp)
    assert delay and params["tp_size"] == p.tp and len(params["remote_rank_ports"]) == p.tp
    d.sched.on_new_request("d1", params)
    n, _ = d.sched.get_num_new_matched_tokens("d1", 16 * len(blocks), 0)
    d.sched.update_state_after_alloc("d1", local, n)
    return params


def settle(clock, p, d, seconds, until):
    return run(clock, (d, p), seconds, until=until)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 2), (4, 2), (1, 2), (2, 1)])
def test_every_rank_reads_its_heads_and_every_lease_ends(engines, clock, p_tp, d_tp):
    _, p, d = engines(p_tp, d_tp)
    pull(p, d)
    assert settle(clock, p, d, 5, lambda: "d1" in d.recving and "r1" in p.sending)
    for src, dst in zip((1, 2, 3), (5, 6, 7)):
        assert torch.equal(d.whole_block(dst), block_value(7, src)), f"block {dst}"
    # Every P rank's lease was consumed by its planned readers (none expired).
    for w in p.workers:
        assert w.driver.counters["blocks_freed_consumed"] == 3, w.driver.engine_id
    assert p.held() == [] and d.held() == []
    assert d.failed == set()


def test_finished_sending_waits_for_every_rank(engines, clock):
    fabric, p, d = engines(2, 2)
    # Rank 1's completion is lost (the lease name starts with the request id;
    # a heartbeat, "HB:...", may reach P first when a step runs late, and must not be the one dropped).
    fabric.drop_notifs(receiver="P/tp1", prefix=b"r1-")
    pull(p, d)
    assert settle(clock, p, d, 2, lambda: "d1" in d.recving)
    assert p.workers[0].driver.counters["blocks_freed_consumed"] == 3
    assert "r1" not in p.sending and p.sched.waiting_on("r1") == (1,)
    # Rank 1's lease expires on its own; only then is the request finished sending.
    assert settle(clock, p, d, 30, lambda: "r1" in p.sending)
    assert p.workers[1].driver.counters["blocks_freed_expired"] == 3
    assert p.held() == [] and d.held() == []


def test_a_completion_before_the_grant_reaches_the_rank_still_consumes_the_lease(engines, clock):
    # The scheduler hands out the params at request_finished; the grant
    # reaches the ranks with the next metadata.  A reader that is faster
    # than that must not leave the lease to expire.
    _, p, d = engines(2, 2)
    p.late_meta = []
    pull(p, d)
    assert settle(clock, p, d, 3, lambda: "d1" in d.recving)
    assert all(w.driver.plane.get("lease", "r1") is None for w in p.workers)
    p.deliver_late_meta()
    assert settle(clock, p, d, 1, lambda: "r1" in p.sending)
    for w in p.workers:
        assert w.driver.counters["completions_early_replayed"] == 1
        assert w.driver.counters["blocks_freed_consumed"] == 3
    assert p.held() == [] and d.held() == []


def test_a_dead_decode_rank_fails_the_request_and_every_p_rank_frees(engines, clock):
    fabric, p, d = engines(2, 2)
    fabric.hang_transfers(initiator="D/tp1")
    pull(p, d)
    assert settle(clock, p, d, 1, lambda: "r1" in p.sending or p.workers[0].driver.counters["blocks_freed_consumed"])
    d.kill(1)
    assert settle(clock, p, d, 30, lambda: "d1" in d.failed and "r1" in p.sending)
    assert "rank 1 lost" in d.reasons["d1"]
    assert p.workers[0].driver.counters["blocks_freed_consumed"] == 3
    assert p.workers[1].driver.counters["blocks_freed_expired"] == 3  # its reader died: the lease expired
    assert p.held() == [] and d.held() == []


def test_a_request_after_a_rank_died_fails_instead_of_waiting_for_it(engines, clock):
    _, p, d = engines(2, 2)
    d.kill(1)
    pull(p, d)
    assert settle(clock, p, d, 30, lambda: "d1" in d.failed and "r1" in p.sending)
    assert d.reasons["d1"] == "rank 1 lost"
    assert p.held() == [] and d.held() == []


def test_a_dead_prefill_rank_does_not_leave_the_others_holding(engines, clock):
    fabric, p, d = engines(2, 2)
    p.fill(7, (1, 2))
    p.sched.on_new_request("r1", {"do_remote_decode": True})
    p.sched.request_finished("r1", (1, 2))
    p.step()
    p.kill(1)  # nobody comes to read: rank 0 expires its lease, rank 1 is gone
    assert settle(clock, p, d, 30, lambda: "r1" in p.sending)
    assert p.workers[0].driver.counters["blocks_freed_expired"] == 2
    assert p.held() == []


def test_turn_two_reads_every_decode_rank_hold(engines, clock):
    _, p, d = engines(2, 1)
    pull(p, d)
    assert settle(clock, p, d, 5, lambda: "d1" in d.recving)
    d.sched.request_running("d1")
    delay, hold = d.sched.request_finished("d1", (5, 6, 7), hold_for_next_turn=True, reader_tp=p.tp)
    assert delay and hold["remote_renewable"] is False and hold["expected_consumers"] == 2
    p.sched.on_new_request("p2", hold)
    n, _ = p.sched.get_num_new_matched_tokens("p2", 48, 0)
    p.sched.update_state_after_alloc("p2", (9, 10, 11), n)
    assert settle(clock, p, d, 5, lambda: "p2" in p.recving and "d1" in d.sending)
    for src, dst in zip((1, 2, 3), (9, 10, 11)):
        assert torch.equal(p.whole_block(dst), block_value(7, src))
    p.sched.request_running("p2")
    p.sched.request_finished("p2", (9, 10, 11))
    p.step()
    assert p.held() == [] and d.held() == []


def test_turn_two_on_p_reads_the_held_prefix_then_serves_the_read_back(engines, clock):
    # vLLM's turn 2: one request on P reads D's held blocks, computes the
    # rest, and leases all of its blocks for D's read-back.
    _, p, d = engines(1, 1)
    pull(p, d)
    assert settle(clock, p, d, 5, lambda: "d1" in d.recving)
    d.sched.request_running("d1")
    _, hold = d.sched.request_finished("d1", (5, 6, 7), hold_for_next_turn=True)
    p.sched.on_new_request("p2", hold, serve=True)
    n, _ = p.sched.get_num_new_matched_tokens("p2", 48, 0)
    p.sched.update_state_after_alloc("p2", (9, 10, 11), n)
    assert settle(clock, p, d, 5, lambda: "p2" in p.recving and "d1" in d.sending)
    for src, dst in zip((1, 2, 3), (9, 10, 11)):
        assert torch.equal(p.whole_block(dst), block_value(7, src))
    p.sched.request_running("p2")
    p.fill(8, (12,))  # the turn's new tokens, computed on P
    delay, back = p.sched.request_finished("p2", (9, 10, 11, 12))
    assert delay and back["remote_renewable"] is True and back["remote_block_ids"] == [9, 10, 11, 12]
    d.sched.on_new_request("d2", back)
    n, _ = d.sched.get_num_new_matched_tokens("d2", 64, 48)  # D has the first three blocks cached
    d.sched.update_state_after_alloc("d2", (8,), n)
    assert settle(clock, p, d, 5, lambda: "d2" in d.recving and "p2" in p.sending)
    assert torch.equal(d.whole_block(8), block_value(8, 12))
    d.sched.request_running("d2")
    d.sched.request_finished("d2", (5, 6, 7, 8))
    p.step()
    d.step()
    assert p.held() == [] and d.held() == []


def test_a_turn_two_aborted_on_p_serves_nobody(engines, clock):
    _, p, d = engines(1, 1)
    pull(p, d)
    assert settle(clock, p, d, 5, lambda: "d1" in d.recving)
    d.sched.request_running("d1")
    _, hold = d.sched.request_finished("d1", (5, 6, 7), hold_for_next_turn=True)
    p.sched.on_new_request("p2", hold, serve=True)
    p.sched.abort("p2")  # before its blocks were allocated
    assert p.sched.request_finished("p2", (9,)) == (False, None)


def test_reports_are_counted_once_per_rank(engines):
    _, p, d = engines(2, 2)
    p.sched.on_new_request("r1", {"do_remote_decode": True})
    p.sched.request_finished("r1", (1,))
    p.sched.update_from_worker(WorkerReport(rank=0, finished_sending={"r1"}))
    p.sched.update_from_worker(WorkerReport(rank=0, finished_sending={"r1"}))  # a duplicate
    p.sched.update_from_worker(WorkerReport(rank=1, finished_sending={"nope"}))  # unknown
    assert p.sched.get_finished().finished_sending == ()
    p.sched.update_from_worker(WorkerReport(rank=1, finished_sending={"r1"}))
    assert p.sched.get_finished().finished_sending == ("r1",)


def test_a_hold_planned_for_fewer_reader_ranks_is_refused_not_raced(engines, clock):
    # D (TP 1) holds for one reader rank, P reads it with TP 2: D would free
    # after P rank 0's completion while P rank 1 still reads.
    _, p, d = engines(2, 1)
    pull(p, d)
    assert settle(clock, p, d, 5, lambda: "d1" in d.recving)
    d.sched.request_running("d1")
    _, hold = d.sched.request_finished("d1", (5, 6, 7), hold_for_next_turn=True)  # reader_tp left out
    assert hold["expected_consumers"] == 1
    with pytest.raises(BadTransferParams, match="expected_consumers.*2 of our ranks read each"):
        p.sched.on_new_request("p2", hold)


def test_records_check_kind_and_version():
    assert check(StepMeta(), StepMeta) == StepMeta()
    with pytest.raises(RecordVersionMismatch, match=f"speaks version {RECORD_VERSION}"):
        check(StepMeta(version=RECORD_VERSION + 1), StepMeta)
    with pytest.raises(BadRecord, match="expected a StepMeta, got dict"):
        check({"loads": []}, StepMeta)


def test_params_with_a_tp_that_cannot_map_are_refused(engines, clock):
    _, p, d = engines(1, 2)
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
              "remote_port": 5000, "remote_request_id": "x", "remote_block_ids": [1], "tp_size": 3}
    with pytest.raises(BadTransferParams, match="tp_size"):
        d.sched.on_new_request("d1", params)
    with pytest.raises(BadTransferParams, match="remote_rank_ports"):
        d.sched.on_new_request("d1", {**params, "tp_size": 2, "remote_rank_ports": [5000]})


# ---------------------------------------------------------------- no sharing
_ATOMS = (str, bytes, int, float, bool, type(None), complex, range, slice)
_CODE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.CodeType, types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType,
         types.GetSetDescriptorType, types.MemberDescriptorType,
         # Process-wide loggers: every object of a module logs through them.
         logging.Logger, logging.Manager, logging.PlaceHolder)


def reachable(root, clock) -> dict[int, object]:
    """Every object ``root`` reaches, except immutable atoms, code (classes,
    modules, functions: shared by every Python object) and the test's
    hand-driven clock (it stands for the machine's clock, which separate
    processes share too)."""
    seen: dict[int, object] = {id(clock): clock}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS) or isinstance(obj, _CODE):
            continue
        seen[id(obj)] = obj
        todo.extend(gc.get_referents(obj))
    del seen[id(clock)]
    return seen


def test_scheduler_and_workers_share_no_object(engines, clock):
    _, p, d = engines(2, 2)
    pull(p, d)
    assert settle(clock, p, d, 5, lambda: "d1" in d.recving and "r1" in p.sending)
    # What any plane of this process reaches that no plane owns: the compiled
    # machines, their wiring, the stat-key interner (built once per process,
    # read-only; the scheduler's plane runs engine_request, each rank's the
    # plane's machines).
    constants = {**reachable(ControlPlane(machines=LOGGED_MACHINES), clock), **reachable(ControlPlane(), clock)}
    for engine in (p, d):
        mine = {k: o for k, o in reachable(engine.sched, clock).items() if k not in constants}
        assert len(mine) > 20  # the walk does reach the scheduler's state
        for w in engine.workers:
            theirs = reachable(w, clock)
            shared = [type(o).__name__ for k, o in mine.items() if k in theirs and not _frozen_empty(o)]
            assert shared == [], f"{engine.name}: scheduler and rank {w.rank} share {shared[:10]}"


def _frozen_empty(o) -> bool:
    # The interpreter shares the empty tuple and frozenset singletons.
    return isinstance(o, (tuple, frozenset)) and len(o) == 0
