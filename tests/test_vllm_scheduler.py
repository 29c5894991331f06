"""kvplane's connector inside vLLM's real scheduler.

Each engine is vLLM's ``Scheduler`` with the ``KVPlaneConnector`` loaded as
a serving engine loads it, and kvplane worker ranks over the loopback
transport in place of the worker processes (``vllm_scheduler_support``):
the request lifecycles vLLM drives (remote prefill on D, remote decode on
P, aborts at each stage, load failures under both policies, preemption,
tensor parallelism) are checked where vLLM keeps them (its queues, request
statuses, block pool, outputs) and, where the plane's answer is what proves
a behaviour, on the records the scheduler half sends the ranks.  D's
params always come from P's own ``request_finished``.  Every test ends
with vLLM told of each recv and each send at most once (a second report
trips an assertion of vLLM's engine core), with the scheduler half's
``engine_request`` machines having refused no call or report, and with its
event log replaying to the same actions.

Needs vLLM (skipped with the reason without it); 30-60 s here, vLLM's
import included.
"""
from __future__ import annotations

import importlib.util
import time

import pytest

from loopback_support import Clock

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: run scripts/install-vllm to include these tests")

if importlib.util.find_spec("vllm") is not None:
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus
    from vllm_scheduler_support import TOKEN, Engine, engine_pair, new_request

    from kvplane.connector.records import RecvFailure, WorkerReport
    from kvplane.connector.vllm import KVPlaneWorkerMeta
    from kvplane.app.sequence_diagrams import model as sequence_model
    from kvplane.app.offline.checks import cmd_check_log, cmd_replay
    from kvplane.app.vllm.run import log_name
    from kvplane.app.sequence_diagrams.mermaid import check as check_mermaid
    from kvplane.app.sequence_diagrams.mermaid import render as render_sequence
    from kvplane.app.sequence_diagrams.model import SideLog
    from kvplane.statemachines.eventlog import read_log
    from kvplane.statemachines.replay import replay

PROMPT = 40  # tokens: 3 blocks of 16 (the last one partial)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def engines(clock):
    """``engines(**kw)`` -> (fabric, P, D); at the end, vLLM was never told twice."""
    made: list[Engine] = []

    def make(**kw):
        fabric, p, d = engine_pair(clock, **kw)
        made.extend((p, d))
        return fabric, p, d

    yield make
    for engine in made:
        engine.close()
    for engine in made:
        assert engine.told_once(), (engine.name, engine.seen_recving, engine.seen_failed, engine.seen_sending)
        # The scheduler half's machines took every call and report the engine made.
        assert list(engine.side.sched.plane.anomalies) == [], (engine.name, list(engine.side.sched.plane.anomalies))
        # Its event log replays: the machines make the same actions again.
        lines = engine.log.lines() if engine.log is not None else []
        if len(lines) > 1:  # beyond its config header
            replayed = replay(lines)
            assert replayed.divergence is None, (engine.name, str(replayed.divergence))


def settle(clock, engines, seconds, until, dt=0.05) -> bool:
    """Step every engine while the clock advances, until ``until()``."""
    end = clock.t + seconds
    while clock.t < end:
        for e in engines:
            e.step()
        if until():
            return True
        time.sleep(0.002)  # the side channel's handshakes run on their own threads
        clock.t += dt
    return False


def prefill(p: Engine, rid: str, tag: int = 7) -> dict:
    """P computes ``rid``'s prompt for a remote decode; its KV (tagged) sits in
    its blocks under a lease.  Returns the params P answered with."""
    p.add(new_request(rid, num_tokens=PROMPT, max_tokens=1, params={"do_remote_decode": True}))
    p.step()
    (done,) = p.finished(rid)
    assert done.finish_reason == FinishReason.LENGTH and done.kv_transfer_params is not None
    for b in p.blocks_of(rid):
        for r, kv in enumerate(p.kv):
            kv[b] = 1000.0 * tag + 10.0 * b + r
    return done.kv_transfer_params


def decode(d: Engine, rid: str, params: dict, max_tokens: int = 3):
    return d.add(new_request(f"d-{rid}", num_tokens=PROMPT, max_tokens=max_tokens, params=params))


def loaded(p: Engine, params: dict, d: Engine, drid: str) -> bool:
    """D's blocks hold exactly what P's (named in the params) held, on every rank."""
    pairs = list(zip(params["remote_block_ids"][0], d.blocks_of(drid)))
    return bool(pairs) and all(bool((p.kv[r][pb] == d.kv[r][db]).all()) for r in range(d.tp) for pb, db in pairs)


# ------------------------------------------------------------------ remote prefill (D)

def test_d_waits_for_the_remote_kv_until_the_ranks_report_it_then_runs(engines, clock):
    _, p, d = engines()
    params = prefill(p, "r1")
    req = decode(d, "r1", params)
    d.silent = {0}  # the rank does not progress: nothing is read yet
    for _ in range(3):
        d.step()
    assert d.status("d-r1") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req in d.sched.kv_holding_waiting and not d.sched.running
    (new,) = d.records("new_requests")
    assert new.request_id == "d-r1" and new.remote.remote_request_id == params["remote_request_id"]
    (load,) = d.records("loads")
    assert load.awaiting and load.num_remote_tokens == PROMPT and load.block_ids == d.blocks_of("d-r1")
    p_blocks = p.blocks_of("r1")
    d.silent = set()
    assert settle(clock, (p, d), 2, lambda: d.status("d-r1") == RequestStatus.RUNNING)
    assert loaded(p, params, d, "d-r1")
    assert d.seen_recving == ["d-r1"] and d.seen_failed == []
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")) and p.empty())
    (done,) = d.finished("d-r1")
    assert done.finish_reason == FinishReason.LENGTH and len(req.output_token_ids) == 3
    d.step()  # the finish reaches the ranks with the next step's records
    # The plane heard of the run once and of the finish once; P freed on the read's completion.
    assert d.records("running") == ["d-r1"]
    assert [f.request_id for f in d.records("finished")] == ["d-r1"]
    assert p.seen_sending == ["r1"] and p.workers[0].driver.counters["blocks_freed_consumed"] == len(p_blocks)
    assert d.empty() and p.held() == [] and d.held() == []


def test_a_repeated_update_state_after_alloc_loads_nothing_twice(engines, clock):
    # vLLM calls update_state_after_alloc again (0 external tokens) when the
    # request is scheduled after its recv.
    _, p, d = engines()
    calls = []
    side = d.side
    original = side.update_state_after_alloc

    def spy(request, block_ids, n):
        calls.append(n)
        return original(request, block_ids, n)

    side.update_state_after_alloc = spy  # type: ignore[method-assign]
    decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    assert calls[0] == PROMPT and len(calls) >= 2 and calls[1:] == [0] * (len(calls) - 1)
    assert len(d.records("loads")) == 1 and d.records("running") == ["d-r1"]
    assert d.empty()


def test_the_scheduler_half_logs_the_engine_calls_and_its_log_replays(engines, clock, tmp_path):
    # The vLLM job's template at TP > 1: the scheduler half's log is named for it, not as a rank.
    template = log_name("decode", "events.jsonl", tp=2)
    assert template == "decode.rank{rank}.events.jsonl"
    _, p, d = engines(d_extra={"kvplane_event_log": str(tmp_path / template)})
    decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    d.step()
    assert settle(clock, (p, d), 2, lambda: d.empty() and p.empty())
    d.connector.shutdown()  # vLLM's Scheduler.shutdown: the log is written out
    path = tmp_path / "decode.scheduler.events.jsonl"
    assert sorted(f.name for f in tmp_path.glob("*scheduler*")) == [path.name]
    log = read_log(str(path))
    assert [type(r.event).__name__ for r in log.records] == [
        "EngineNewRequest", "EngineMatched", "EngineAllocated", "RecvFinished", "EngineAllocated", "EngineScheduled",
        "EngineFinished"]
    assert all(r.machine == "engine_request:d-r1" for r in log.records)
    assert log.records[-1].state_after == "ENDED"
    assert cmd_replay(str(path)) == 0 and cmd_check_log(str(path)) == 0
    # Drawn beside the wire messages: the engine calls D's scheduler half, which answers and tells the ranks.
    diagram = sequence_model.build({"D": SideLog("D", log.records)})
    assert diagram.participants[-1].id == "D_engine"
    calls = [a.text for a in diagram.arrows if a.kind == "engine"]
    assert calls[0].startswith("NewRequest d-r1; ranks: SendNewRemote") and "Matched d-r1 → Matched" in calls[1]
    assert any(c.startswith("finished_recving d-r1") for c in calls)
    check_mermaid(render_sequence(diagram))
    # The machine decides again on replay: a tampered call gets other answers.
    lines = path.read_text().splitlines()
    (i,) = [n for n, line in enumerate(lines) if '"EngineMatched"' in line]
    lines[i] = lines[i].replace('"num_computed_tokens":0', '"num_computed_tokens":16')
    tampered = replay(lines).divergence
    assert tampered is not None and tampered.what == "actions"
    (tmp_path / "tampered.jsonl").write_text("\n".join(lines) + "\n")
    assert cmd_replay(str(tmp_path / "tampered.jsonl")) == 1


# ------------------------------------------------------------------ remote decode (P)

def test_p_holds_the_blocks_under_a_lease_until_finished_sending(engines, clock):
    _, p, d = engines()
    params = prefill(p, "r1")
    assert params["do_remote_prefill"] and params["remote_block_ids"] == [list(p.blocks_of("r1"))]
    p.step()
    (grant,) = p.records("grants")
    assert grant.request_id == "r1" and grant.name == params["remote_request_id"]
    # Finished, but its blocks are held (vLLM keeps the request) while the lease lives.
    assert p.status("r1") == RequestStatus.FINISHED_LENGTH_CAPPED and not p.empty()
    assert not settle(clock, (p,), 5.0, lambda: p.empty())
    # Nobody came: the lease expires on the rank, and only then are the blocks free.
    assert settle(clock, (p,), 3.0, lambda: p.empty())
    assert p.seen_sending == ["r1"] and p.workers[0].driver.counters["blocks_freed_expired"] == 3
    assert p.held() == []


def test_p_aborted_before_it_finished_frees_at_once_and_grants_nothing(engines, clock):
    _, p, _ = engines()
    p.add(new_request("r1", num_tokens=PROMPT, max_tokens=1, params={"do_remote_decode": True}))
    p.abort("r1")
    p.step()
    assert p.empty() and p.records("grants") == [] and p.seen_sending == []


def test_finished_sending_is_aggregated_over_both_ranks(engines, clock):
    fabric, p, d = engines(p_tp=2, d_tp=2)
    fabric.drop_notifs(receiver="P/tp1")  # rank 1 never hears that D read it
    decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    assert p.workers[0].driver.counters["blocks_freed_consumed"] == 3
    # Rank 0 reported; vLLM (its own aggregator) still holds the blocks, and so do the plane's books.
    assert p.status("r1") == RequestStatus.FINISHED_LENGTH_CAPPED and p.seen_sending == []
    assert p.side.sched.waiting_on("r1") == (1,)
    assert settle(clock, (p, d), 10, lambda: p.empty())
    assert p.seen_sending == ["r1"] and p.workers[1].driver.counters["blocks_freed_expired"] == 3
    assert p.held() == [] and d.held() == [] and d.empty()


def test_recv_is_finished_only_when_both_d_ranks_read(engines, clock):
    _, p, d = engines(p_tp=2, d_tp=2)
    params = prefill(p, "r1")
    decode(d, "r1", params)
    d.silent = {1}
    assert not settle(clock, (p, d), 1, lambda: d.status("d-r1") != RequestStatus.WAITING_FOR_REMOTE_KVS)
    d.silent = set()
    assert settle(clock, (p, d), 2, lambda: d.status("d-r1") == RequestStatus.RUNNING)
    assert loaded(p, params, d, "d-r1")
    assert settle(clock, (p, d), 2, lambda: d.empty() and p.empty())


# ------------------------------------------------------------------ aborts on D

def test_d_aborted_before_allocation_tells_p_to_free_and_awaits_nothing(engines, clock):
    _, p, d = engines()
    decode(d, "r1", prefill(p, "r1"))
    d.abort("d-r1")  # before any schedule(): no blocks were ever allocated
    d.step()
    # The plane is told: an empty, unawaited load (the rank tells P to free now).
    (load,) = d.records("loads")
    assert load.request_id == "d-r1" and not load.awaiting and load.num_remote_tokens == 0
    assert d.records("aborts") == [] and d.empty()
    # P frees on D's notify, long before its lease (6 s) would have run out.
    assert settle(clock, (p, d), 1.0, lambda: p.empty())
    assert p.workers[0].driver.counters["blocks_freed_consumed"] == 3
    assert d.seen_recving == [] and p.held() == [] and d.held() == []


def test_d_aborted_while_awaited_is_reported_once_then_freed(engines, clock):
    fabric, p, d = engines()
    fabric.hang_transfers(initiator="D/tp0")  # the READ never completes
    decode(d, "r1", prefill(p, "r1"))
    assert not settle(clock, (p, d), 0.5, lambda: d.status("d-r1") != RequestStatus.WAITING_FOR_REMOTE_KVS)
    d.abort("d-r1")
    # vLLM keeps the blocks (the transfer may still write them) until the rank reports.
    assert d.status("d-r1") == RequestStatus.FINISHED_ABORTED and not d.empty()
    assert settle(clock, (p, d), 1.0, lambda: d.empty())
    assert d.records("aborts") == ["d-r1"] and d.seen_recving == ["d-r1"]
    assert d.reasons.get("d-r1") is RecvFailure.ABORTED
    assert settle(clock, (p, d), 10, lambda: p.empty())  # P's lease runs out (no heartbeats)
    assert p.held() == [] and d.held() == []


def test_d_aborted_while_running_finishes_the_plane_request_and_frees(engines, clock):
    _, p, d = engines()
    decode(d, "r1", prefill(p, "r1"), max_tokens=50)
    assert settle(clock, (p, d), 2, lambda: d.status("d-r1") == RequestStatus.RUNNING)
    d.abort("d-r1")
    assert d.empty()
    d.step()
    assert [f.request_id for f in d.records("finished")] == ["d-r1"] and d.records("aborts") == []
    assert settle(clock, (p, d), 1, lambda: p.empty())
    assert d.held() == [] and p.held() == []


# ------------------------------------------------------------------ load failures

@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_read_fails_or_recomputes_as_configured(engines, clock, policy):
    fabric, p, d = engines(policy=policy)
    fabric.fail_transfers(initiator="D/tp0")
    req = decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    (done,) = d.finished("d-r1")
    assert d.seen_recving == ["d-r1"] and d.seen_failed == ["d-r1"]
    assert d.reasons["d-r1"] is RecvFailure.TRANSFER_FAILED
    d.step()
    if policy == "fail":
        assert done.finish_reason == FinishReason.ERROR and len(req.output_token_ids) == 0
        # vLLM fails the request (request_finished) before it hands the connector
        # the same step's output: the connector still sees the recv awaited and
        # aborts it on the rank, which has already reported and reports nothing more.
        assert d.records("aborts") == ["d-r1"]
    else:  # computed locally from the first token, then run to its end
        assert d.records("aborts") == []
        assert done.finish_reason == FinishReason.LENGTH and len(req.output_token_ids) == 3
    assert settle(clock, (p, d), 10, lambda: d.empty() and p.empty())
    assert d.held() == [] and p.held() == []


def _tracked(e: Engine) -> dict[str, int]:
    """Every per-request table of the engine's scheduler half and of its ranks, with entries."""
    tables = {f"scheduler {k}": v for k, v in e.side.sched.tracked().items()}
    tables.update({f"rank {r} {k}": v for r, w in enumerate(e.workers) for k, v in w.tracked().items()})
    return {k: v for k, v in tables.items() if v}


def test_every_request_leaves_no_entry_behind_on_any_path(engines, clock):
    """A long-running engine: read recvs, many failed ones, aborted ones;
    once they ended, nothing of them is kept (each failure's reason went to
    the engine in one step's report, not into a table)."""
    fabric, p, d = engines(policy="recompute")
    for rid in ("ok0", "ok1"):
        decode(d, rid, prefill(p, rid))
    assert settle(clock, (p, d), 5, lambda: d.finished("d-ok0") and d.finished("d-ok1"))
    failing = [f"f{i}" for i in range(12)]
    fabric.fail_transfers(initiator="D/tp0", count=len(failing))
    for rid in failing:
        decode(d, rid, prefill(p, rid))
    assert settle(clock, (p, d), 5, lambda: all(d.finished(f"d-{rid}") for rid in failing))
    assert {d.reasons[f"d-{rid}"] for rid in failing} == {RecvFailure.TRANSFER_FAILED}
    fabric.hang_transfers(initiator="D/tp0", count=2)
    for rid in ("a0", "a1"):
        decode(d, rid, prefill(p, rid))
    assert not settle(clock, (p, d), 0.3, lambda: d.status("d-a1") != RequestStatus.WAITING_FOR_REMOTE_KVS)
    for rid in ("a0", "a1"):
        d.abort(f"d-{rid}")  # aborted while awaited
    assert settle(clock, (p, d), 15, lambda: d.empty() and p.empty() and not p.held() and not d.held())
    for _ in range(2):  # the last reports reach the scheduler half
        d.step()
        p.step()
    assert sorted(d.seen_recving) == sorted(f"d-{rid}" for rid in ["ok0", "ok1", *failing, "a0", "a1"])
    assert sorted(d.seen_failed) == sorted(f"d-{rid}" for rid in [*failing, "a0", "a1"])
    assert _tracked(d) == {} and _tracked(p) == {}


def test_a_read_declined_for_an_expired_lease_is_recomputed_never_read(engines, clock):
    _, p, d = engines(policy="recompute")
    params = prefill(p, "r1")
    assert settle(clock, (p,), 8, lambda: p.empty())  # P's lease ran out before the forward
    req = decode(d, "r1", params)
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    assert d.seen_failed == ["d-r1"] and d.reasons["d-r1"] is RecvFailure.DECLINED
    assert len(req.output_token_ids) == 3 and d.empty() and d.held() == []


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_invalid_block_ids_rewind_or_fail_the_request(engines, clock, policy):
    # A rank says the recv finished but one block's KV is bad (vLLM's
    # invalid_block_ids): vLLM recomputes from that block or fails the request.
    _, p, d = engines(policy=policy)
    req = decode(d, "r1", prefill(p, "r1"))
    d.step()
    bad = d.blocks_of("d-r1")[1]

    def spoil(rank, out):
        if out is not None and "d-r1" in (out.finished_recving or ()):
            out.invalid_block_ids = {bad}
        return out

    d.edit = spoil
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    (done,) = d.finished("d-r1")
    if policy == "fail":
        assert done.finish_reason == FinishReason.ERROR
    else:
        assert done.finish_reason == FinishReason.LENGTH and len(req.output_token_ids) == 3
        # Recomputed from the bad block on: one step computed tokens 16..39 locally.
    assert settle(clock, (p, d), 2, lambda: d.empty() and p.empty())
    assert d.held() == []


# ------------------------------------------------------------------ preemption, repeats

def test_preempted_after_its_recv_it_is_recomputed_locally_never_loaded_again(engines, clock):
    _, p, d = engines()
    req = decode(d, "r1", prefill(p, "r1"), max_tokens=6)
    assert settle(clock, (p, d), 2, lambda: d.status("d-r1") == RequestStatus.RUNNING)
    d.step()
    d.sched.reset_prefix_cache(reset_running_requests=True)  # vLLM preempts every running request
    assert d.status("d-r1") == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    assert req.num_preemptions == 1 and len(req.output_token_ids) == 6
    d.step()
    assert len(d.records("new_requests")) == 1 and len(d.records("loads")) == 1
    assert d.records("running") == ["d-r1"] and [f.request_id for f in d.records("finished")] == ["d-r1"]
    assert settle(clock, (p, d), 2, lambda: d.empty() and p.empty())
    assert d.held() == [] and p.held() == []


def test_a_repeated_worker_report_changes_nothing(engines, clock):
    # The aggregated worker meta carries a rank's report twice (a bug
    # elsewhere, or a retried step): the scheduler half keeps its books.
    _, p, d = engines()
    decode(d, "r1", prefill(p, "r1"))

    def twice(rank, out):
        meta = None if out is None else out.kv_connector_worker_meta
        if isinstance(meta, KVPlaneWorkerMeta):
            out.kv_connector_worker_meta = meta.aggregate(KVPlaneWorkerMeta(reports=list(meta.reports)))
        return out

    d.edit = twice
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    d.step()
    assert d.records("running") == ["d-r1"] and len(d.records("finished")) == 1
    assert settle(clock, (p, d), 2, lambda: d.empty() and p.empty())


def test_a_report_for_a_request_vllm_never_sent_is_ignored(engines, clock):
    _, p, d = engines()

    def stray(rank, out):
        report = WorkerReport(rank=rank, finished_recving={"nobody"}, failed_recving={"nobody"},
                              fail_reasons=(("nobody", "aborted"),))
        if out is None or out.kv_connector_worker_meta is None:
            return out
        out.kv_connector_worker_meta = out.kv_connector_worker_meta.aggregate(KVPlaneWorkerMeta(reports=[report]))
        return out

    d.edit = stray
    decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    assert d.records("aborts") == []


def test_d_aborted_after_its_recv_was_reported_but_before_it_ran(engines, clock):
    _, p, d = engines()
    decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 2, lambda: d.seen_recving == ["d-r1"])
    assert d.status("d-r1") == RequestStatus.WAITING_FOR_REMOTE_KVS  # promoted at the next schedule()
    d.abort("d-r1")
    assert d.empty()  # vLLM frees at once: the recv is over
    d.step()
    assert [f.request_id for f in d.records("finished")] == ["d-r1"]
    assert d.records("aborts") == [] and d.records("running") == []
    assert settle(clock, (p, d), 2, lambda: p.empty())
    assert d.held() == [] and p.held() == []


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_one_d_rank_failing_fails_the_request_once(engines, clock, policy):
    fabric, p, d = engines(p_tp=2, d_tp=2, policy=policy)
    fabric.fail_transfers(initiator="D/tp1")
    req = decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    (done,) = d.finished("d-r1")
    if policy == "fail":
        assert done.finish_reason == FinishReason.ERROR and len(req.output_token_ids) == 0
    else:
        assert done.finish_reason == FinishReason.LENGTH and len(req.output_token_ids) == 3
    # Rank 1's bad blocks may fail the request before rank 0 is done; vLLM
    # frees the blocks once both ranks reported, and is told once, with the
    # failing rank's reason (so read only then: under load rank 0 may report
    # steps after vLLM failed the request).
    assert settle(clock, (p, d), 10, lambda: d.empty() and p.empty())
    assert d.reasons["d-r1"] == f"{RecvFailure.TRANSFER_FAILED} (rank 1)"
    assert d.seen_recving == ["d-r1"]
    assert d.held() == [] and p.held() == []


def test_with_a_local_prefix_hit_d_reads_only_the_blocks_it_lacks(engines, clock):
    _, p, d = engines()
    d.add(new_request("local", num_tokens=PROMPT, max_tokens=1))  # same prompt, computed on D first
    d.step()
    assert d.finished("local") and d.empty()  # freed, its full blocks still cached
    params = prefill(p, "r1")
    remote = params["remote_block_ids"][0]
    req = decode(d, "r1", params)
    d.step()
    (load,) = d.records("loads")
    full_blocks_cached = PROMPT // 16
    assert load.num_remote_tokens == PROMPT - 16 * full_blocks_cached and len(load.block_ids) == 1
    assert d.side.counters["prefix_hits"] == 1
    assert settle(clock, (p, d), 2, lambda: d.status("d-r1") == RequestStatus.RUNNING)
    # The one block D lacked holds P's last block (the lists are paired from the prompt's end).
    assert bool((d.kv[0][load.block_ids[0]] == p.kv[0][remote[-1]]).all())
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")) and p.empty())
    assert len(req.output_token_ids) == 3
    assert settle(clock, (p, d), 1, lambda: d.empty())


def test_bad_params_are_counted_and_the_prompt_computed_locally(engines, clock):
    # A hostile or broken proxy: params that name an impossible block list.
    _, p, d = engines()
    params = prefill(p, "r1")
    params["remote_block_ids"] = [["not", "a", "block"]]
    req = decode(d, "r1", params)
    assert settle(clock, (p, d), 1, lambda: bool(d.finished("d-r1")))
    assert len(req.output_token_ids) == 3 and d.side.counters["bad_transfer_params"] == 1
    assert d.records("new_requests") == [] and d.records("loads") == [] and d.seen_recving == []
    assert d.empty() and d.held() == []


def test_a_hold_for_the_next_turn_keeps_d_blocks_until_its_ttl(engines, clock):
    _, p, d = engines(extra={"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 8.0})
    decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    (done,) = d.finished("d-r1")
    turn2 = done.kv_transfer_params
    assert turn2 is not None and turn2["remote_engine_id"] == "D" and turn2["remote_blocks_expiry_time"] is not None
    d.step()
    (finish,) = d.records("finished")
    assert finish.hold is not None and finish.hold.name == turn2["remote_request_id"]
    # vLLM keeps the blocks while every rank holds them; nobody reads: the TTL frees them.
    assert d.status("d-r1") == RequestStatus.FINISHED_LENGTH_CAPPED and not d.empty()
    assert settle(clock, (p, d), 12, lambda: d.empty())
    assert d.seen_sending == ["d-r1"] and d.held() == [] and p.empty()


def test_d_aborted_while_it_waits_for_free_blocks_tells_p_to_free(engines, clock):
    # D's cache fits one request: the second is matched every step but never
    # allocated, then aborted.
    _, p, d = engines(d_blocks=6)
    decode(d, "r1", prefill(p, "r1"), max_tokens=40)
    params2 = prefill(p, "r2", tag=8)
    calls = []
    original = d.side.get_num_new_matched_tokens

    def spy(request, num_computed_tokens):
        calls.append(request.request_id)
        return original(request, num_computed_tokens)

    d.side.get_num_new_matched_tokens = spy  # type: ignore[method-assign]
    decode(d, "r2", params2)
    assert settle(clock, (p, d), 1, lambda: calls.count("d-r2") >= 2)
    assert d.status("d-r2") == RequestStatus.WAITING and d.sched.kv_cache_manager.get_block_ids("d-r2") == ([],)
    d.abort("d-r2")
    d.step()
    (load,) = [x for x in d.records("loads") if x.request_id == "d-r2"]
    assert not load.awaiting and load.num_remote_tokens == 0
    assert settle(clock, (p, d), 1, lambda: p.status("r2") is None)  # freed on D's notify, not by the lease
    assert "d-r2" not in d.seen_recving
    assert settle(clock, (p, d), 3, lambda: d.empty() and p.empty())
    assert d.held() == [] and p.held() == []


def test_a_wider_d_than_p_is_refused_and_computed_locally(engines, clock):
    # P plans one reader per rank (it cannot know D's TP at request_finished);
    # two D ranks would read each P rank, so D refuses the params rather than
    # race P's free, computes the prompt itself, and P's lease runs out.
    _, p, d = engines(p_tp=1, d_tp=2)
    req = decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 1, lambda: bool(d.finished("d-r1")))
    assert len(req.output_token_ids) == 3 and d.side.counters["bad_transfer_params"] == 1
    assert d.records("new_requests") == [] and d.empty()
    assert settle(clock, (p, d), 10, lambda: p.empty())
    assert p.workers[0].driver.counters["blocks_freed_expired"] == 3


def test_p_preempted_while_prefilling_grants_once_when_it_finishes(engines, clock):
    """After a preemption in chunked prefill vLLM computes the prompt again
    from 0 and finishes the request only after its last chunk: P signs the
    whole prompt (40 tokens, 3 blocks) and D reads it.  (A harness that
    sampled a token on a middle chunk once made vLLM finish at 32 of 40.)"""
    # Prefill in chunks of 16 tokens; vLLM preempts P's request after the first.
    _, p, d = engines(max_num_batched_tokens=16)
    req = p.add(new_request("r1", num_tokens=PROMPT, max_tokens=1, params={"do_remote_decode": True}))
    p.step()
    assert p.status("r1") == RequestStatus.RUNNING and req.num_computed_tokens == 16
    p.sched.reset_prefix_cache(reset_running_requests=True)
    assert p.status("r1") == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    assert settle(clock, (p,), 1, lambda: bool(p.finished("r1")))
    (done,) = p.finished("r1")
    assert req.num_preemptions == 1 and req.num_computed_tokens == PROMPT
    params = done.kv_transfer_params
    assert params is not None and params["remote_num_tokens"] == PROMPT and len(params["remote_block_ids"][0]) == 3
    p.step()
    assert [g.request_id for g in p.records("grants")] == ["r1"]
    decode(d, "r1", params)
    assert settle(clock, (p, d), 3, lambda: bool(d.finished("d-r1")) and p.empty())
    assert settle(clock, (p, d), 1, lambda: d.empty())
    assert d.side.counters["bad_transfer_params"] == 0 and d.seen_recving == ["d-r1"] and d.seen_failed == []
    assert p.held() == [] and d.held() == []


def test_p_finished_short_of_its_prompt_offers_nothing_and_frees_now(engines, clock, monkeypatch):
    """Fail closed: a P request that finishes holding less than its prompt
    (an engine that samples on a middle chunk: vLLM then finishes it at 32
    of 40) gets no params and no lease; its blocks are freed at once."""
    _, p, _ = engines(max_num_batched_tokens=16)
    monkeypatch.setattr(p, "_sampled", lambda rid: [TOKEN] if p.sched.requests[rid].num_computed_tokens >= 32 else [])
    req = p.add(new_request("r1", num_tokens=PROMPT, max_tokens=1, params={"do_remote_decode": True}))
    assert settle(clock, (p,), 1, lambda: bool(p.finished("r1")))
    (done,) = p.finished("r1")
    assert req.num_computed_tokens == 32 and done.kv_transfer_params is None
    assert p.side.counters["partial_prefill_not_offered"] == 1
    p.step()
    assert p.records("grants") == [] and p.side.sched.request("r1") is None
    assert p.held() == [] and p.empty()


# ------------------------------------------------------------------ kv_recompute_threshold (turn 2)

@pytest.mark.parametrize("threshold", [None, 32, 33])
def test_a_turn_2_read_below_kv_recompute_threshold_is_computed_and_d_frees_its_hold_at_once(
        engines, clock, threshold):
    """NixlConnector 0.32.0 skips P's read of D's hold when it is fewer
    tokens than ``kv_recompute_threshold`` (default 64): P computes them and
    tells D to free its hold now (a full prefix hit's notify).  D's hold here
    is 42 tokens (40 + 2 decoded), 32 of them in whole blocks: read at a
    threshold of 32, computed at 33 and at the default."""
    extra = {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 60.0}
    if threshold is not None:
        extra["kv_recompute_threshold"] = threshold
    _, p, d = engines(extra=extra)
    decode(d, "r1", prefill(p, "r1"))
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")))
    (done,) = d.finished("d-r1")
    held = done.kv_transfer_params
    assert held is not None and held["remote_num_tokens"] == 42 and d.seen_sending == []
    d.step()
    # P's turn-1 blocks are free (D read them) but still in its prefix cache:
    # dropped, or turn 2 is a full prefix hit on P.
    assert settle(clock, (p, d), 2, lambda: p.empty()) and p.sched.reset_prefix_cache()
    held_blocks = held["remote_block_ids"][0]
    for b in held_blocks:
        d.kv[0][b] = 500.0 + b  # what D's hold holds
    tokens = d.sched.requests["d-r1"].all_token_ids[:42] if "d-r1" in d.sched.requests else None
    assert tokens is not None  # vLLM keeps the finished request while its blocks are held
    turn2 = p.add(new_request("t2", prompt=[*tokens, *range(300, 310)], max_tokens=1,
                              params=dict(held, do_remote_decode=True)))
    reads = threshold == 32
    assert settle(clock, (p, d), 3, lambda: bool(p.finished("t2")) and bool(d.seen_sending))
    assert d.seen_sending == ["d-r1"]  # D's hold freed now, not at its 60 s TTL
    (new,) = p.records("new_requests")
    (load,) = p.records("loads")
    assert p.side.sched.counters["below_recompute_threshold"] == (0 if reads else 1), (load, p.side.counters, p.side.sched.counters)
    if reads:
        assert load.awaiting and load.num_remote_tokens == 32 and len(load.block_ids) == 2
        assert p.seen_recving == ["t2"] and p.seen_failed == []
        assert all(bool((p.kv[0][pb] == d.kv[0][db]).all()) for pb, db in zip(load.block_ids, held_blocks))
    else:
        assert not load.awaiting and load.block_ids == () and p.seen_recving == []
    assert len(turn2.output_token_ids) == 1
    # P's turn 2 serves D's read-back under a lease; nobody reads it: it runs out.
    assert settle(clock, (p, d), 12, lambda: p.empty() and d.empty())
    for _ in range(2):
        p.step()
        d.step()
    assert p.held() == [] and d.held() == [] and _tracked(p) == {} and _tracked(d) == {}


# ------------------------------------------------------------------ P-side truncation (multi-module MTP)

def test_mtp_p_computes_the_prompt_less_its_lookahead_and_d_computes_the_rest(engines, clock):
    """NixlConnector 0.32.0's ``_prefill_backoff``: with multi-module MTP
    (``--model mtp``: 2 speculative tokens, ``num_prefill_lookahead_tokens``
    2) P leaves the last prompt token to D.  P computes and offers 39 of the
    40 tokens; D reads those 39 (3 blocks, the last part-full) and computes
    the 40th itself before it decodes."""
    _, p, d = engines(model="mtp")
    assert (p.side.prefill_backoff, d.side.prefill_backoff) == (1, 1)
    preq = p.add(new_request("r1", num_tokens=PROMPT, max_tokens=5, params={"do_remote_decode": True}))
    assert preq.num_prompt_tokens == PROMPT - 1 and len(preq.prompt_token_ids) == PROMPT - 1
    assert preq.max_tokens == 1 and len(preq.block_hashes) == (PROMPT - 1) // 16
    p.step()
    assert p.scheduled[-1] == {"r1": PROMPT - 1}
    (done,) = p.finished("r1")
    params = done.kv_transfer_params
    assert params["remote_num_tokens"] == PROMPT - 1 and len(params["remote_block_ids"][0]) == 3
    assert p.side.counters["prompts_backed_off"] == 1
    for b in p.blocks_of("r1"):
        p.kv[0][b] = 7000.0 + b
    req = decode(d, "r1", params)
    d.step()
    (load,) = d.records("loads")
    assert load.awaiting and load.num_remote_tokens == PROMPT - 1 and len(load.block_ids) == 3
    assert settle(clock, (p, d), 2, lambda: d.status("d-r1") == RequestStatus.RUNNING)
    assert loaded(p, params, d, "d-r1") and d.seen_recving == ["d-r1"] and d.seen_failed == []
    # D's first step after the read computes the one token P left (vLLM pads a one-token step to a
    # speculative decode's width, 1 + 2 speculative tokens); then it decodes.
    first_run = next(s for s in d.scheduled if "d-r1" in s)
    assert first_run == {"d-r1": 1 + 2}
    assert settle(clock, (p, d), 2, lambda: bool(d.finished("d-r1")) and p.empty())
    assert len(req.output_token_ids) == 3 and req.num_prompt_tokens == PROMPT
    assert settle(clock, (p, d), 1, lambda: d.empty())


@pytest.mark.parametrize("p_model, d_model", [("tiny", "mtp"), ("mtp", "tiny")])
def test_p_and_d_that_disagree_on_the_backoff_never_read_d_computes_the_prompt(engines, clock, p_model, d_model):
    """Fail closed: params whose token count is not the prompt less D's own
    backoff (a P that computed the whole prompt, or one that left a token
    D expects to read) are refused; D reads nothing and computes it all."""
    _, p, d = engines(model=p_model, d_model=d_model)
    params = prefill(p, "r1")
    assert params["remote_num_tokens"] == PROMPT - p.side.prefill_backoff
    req = decode(d, "r1", params)
    assert settle(clock, (p, d), 1, lambda: bool(d.finished("d-r1")))
    assert len(req.output_token_ids) == 3 and d.side.counters["bad_transfer_params"] == 1
    assert d.side.counters["refused_params: token count is not the prompt's"] == 1, d.side.counters
    assert d.records("new_requests") == [] and d.records("loads") == [] and d.seen_recving == []
    assert d.scheduled[0] == {"d-r1": PROMPT}
    assert d.empty() and d.held() == []


def test_truncation_leaves_short_and_uncached_prompts_whole():
    """A prompt no longer than the backoff is computed whole by P (D reads
    it all); a request that skips the prefix cache (prompt logprobs) is not
    cut (D reads nothing for it); the cut keeps vLLM's request consistent:
    its token lists, count and the hashes of only its full blocks."""
    from vllm import SamplingParams

    from kvplane.connector.prefill_backoff import tokens_to_read, truncate_for_prefill

    one = new_request("one", num_tokens=1)
    assert not truncate_for_prefill(one, 1, 16) and one.num_prompt_tokens == 1 and tokens_to_read(1, 1) == 1
    cut = new_request("cut", num_tokens=32)
    assert len(cut.block_hashes) == 2 and truncate_for_prefill(cut, 1, 16)
    assert (cut.num_prompt_tokens, len(cut.prompt_token_ids), len(cut.all_token_ids), len(cut.block_hashes)) == \
        (31, 31, 31, 1)
    assert cut.prompt_token_ids == list(range(100, 131)) and tokens_to_read(32, 1) == 31
    assert not truncate_for_prefill(new_request("none", num_tokens=32), 0, 16)
    logprobs = new_request("logprobs", num_tokens=32)
    logprobs.sampling_params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    logprobs.skip_reading_prefix_cache = logprobs.get_skip_reading_prefix_cache()
    assert logprobs.skip_reading_prefix_cache and not truncate_for_prefill(logprobs, 1, 16)
    assert logprobs.num_prompt_tokens == 32
