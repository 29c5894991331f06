"""Push mode of the vLLM connector (KVPlanePushConnector's halves), P and D
over real NIXL and ZMQ in one process, without vLLM: D registers its
blocks, P WRITEs its leased blocks into them, D's recv is reported when P's
completion arrives; a push that never comes fails D's recv at its deadline;
params of the other mode are refused."""
from __future__ import annotations

import json

import pytest
import torch

from kvplane.app.vllm.kv_check import check_all
from kvplane.connector.kv_dump import DUMP_KEY
from kvplane.statemachines.replay import replay
from vllm_engine_support import Engine, Req
from vllm_support import run_until


@pytest.fixture
def engines(tmp_path):
    made: list[Engine] = []

    def make(name: str, seed: int, **kw) -> Engine:
        e = Engine(name, tmp_path, seed, **{"mode": "push", **kw})
        made.append(e)
        return e

    yield make
    for e in made:
        e.worker.shutdown()


def test_p_writes_its_blocks_into_ds_registered_blocks_and_both_end_holding_nothing(engines, tmp_path):
    p, d = engines("prefill-0", 1), engines("decode-0", 2)
    x = Req("x", {"do_remote_decode": True, DUMP_KEY: "t.p"})
    p.sched.on_new_request(x)
    delay, params = p.sched.request_finished(x, (3, 4, 5))
    assert delay and params["transfer_mode"] == "push" and params["do_remote_prefill"]
    assert p.sched.has_pending_push_work()  # an idle P keeps stepping until the WRITE is over
    p.step()
    a = Req("a", dict(params, **{DUMP_KEY: "t"}))
    d.sched.on_new_request(a)
    assert d.sched.get_num_new_matched_tokens(a, 0) == (40, True)
    d.sched.update_state_after_alloc(a, (10, 11, 12), 40)
    run_until(lambda: "a" in d.finished["recving"], p, d)
    assert not d.finished["failed"]
    for name in p.kv:
        assert torch.equal(d.kv[name][[10, 11, 12]], p.kv[name][[3, 4, 5]])
    run_until(lambda: "x" in p.finished["sending"], p, d)  # the WRITE consumed P's lease
    assert not p.sched.has_pending_push_work()
    d.step(["a"])
    assert d.sched.request_finished(a, (10, 11, 12)) == (True, None)  # held for its dump
    run_until(lambda: "a" in d.finished["sending"], p, d)

    counts_p, gauges_p = p.worker.stats()
    counts_d, gauges_d = d.worker.stats()
    assert p.worker.driver.counters["writes_posted"] == 1 and d.worker.driver.counters["push_regs_sent"] == 1
    assert d.worker.driver.counters.get("reads_posted", 0) == 0  # D read nothing: P wrote
    assert counts_p["kvplane_leases_consumed"] == 1
    assert gauges_p["kvplane_blocks_held"] == 0 and gauges_d["kvplane_recvs_in_flight"] == 0
    # The job's KV check: what arrived in D's blocks is P's, byte for byte.
    (tmp_path / "t.local.rank0.pt").write_bytes((tmp_path / "t.p.rank0.pt").read_bytes())
    (verdict,) = check_all(tmp_path, ["t"])
    assert verdict.ok and verdict.read_tokens == 48 and not verdict.declined, verdict
    for e in (p, d):
        e.worker.shutdown()
        status = json.loads((tmp_path / f"{e.name}.status.json").read_text())
        assert status["closed"] and status["plane_held"] == []
        result = replay(tmp_path / f"{e.name}.events.jsonl")
        assert result.ok, (result.divergence, result.held)
    # P's completed WRITE refreshed D's liveness (engine_ttl) and consumed the lease.
    lines = [json.loads(x) for x in (tmp_path / "prefill-0.events.jsonl").read_text().splitlines()]
    (done,) = [x for x in lines if x.get("machine") == "push_write:x" and x["event"] == "WriteDone"]
    assert done["state_after"] == "DONE"
    assert ["NoteActivity", {"engine_id": "decode-0/tp0"}] in done["actions"]
    assert ["ConsumeLease", {"request_id": "x", "consumer": "decode-0/tp0"}] in done["actions"]


def test_a_partial_prefix_hit_on_d_gets_only_the_tail_written(engines):
    p, d = engines("prefill-0", 1), engines("decode-0", 2)
    x = Req("x", {"do_remote_decode": True})
    p.sched.on_new_request(x)
    _, params = p.sched.request_finished(x, (3, 4, 5))
    p.step()
    a = Req("a", dict(params))
    d.sched.on_new_request(a)
    assert d.sched.get_num_new_matched_tokens(a, 16) == (24, True)  # D had the first block cached
    before = d.kv["layer0"][7].clone()
    d.sched.update_state_after_alloc(a, (11, 12), 24)
    run_until(lambda: "a" in d.finished["recving"], p, d)
    assert not d.finished["failed"]
    for name in p.kv:
        assert torch.equal(d.kv[name][[11, 12]], p.kv[name][[4, 5]])
    assert torch.equal(d.kv["layer0"][7], before)


def test_no_push_by_ds_deadline_fails_the_recv_and_nothing_stays_held(engines, tmp_path):
    """P never gets the request (its engine answered the params, then lost
    them: here, a lease P aborts): D's registration is refused, D's wait ends
    at push_registration_timeout, the recv is reported failed (vLLM
    recomputes) and D holds nothing."""
    p = engines("prefill-0", 1, push_registration_timeout=3)
    d = engines("decode-0", 2, push_registration_timeout=3)
    x = Req("x", {"do_remote_decode": True})
    p.sched.on_new_request(x)
    _, params = p.sched.request_finished(x, (3, 4, 5))
    p.step()
    p.sched.sched.abort("x")  # the lease P held ends before D registers
    p.step()
    a = Req("a", dict(params))
    d.sched.on_new_request(a)
    d.sched.get_num_new_matched_tokens(a, 0)
    d.sched.update_state_after_alloc(a, (10, 11, 12), 40)
    run_until(lambda: "a" in d.finished["recving"], p, d, timeout=30)
    assert "a" in d.finished["failed"]
    assert p.worker.driver.counters["push_regs_refused"] >= 1
    assert p.worker.driver.counters.get("writes_posted", 0) == 0
    d.step(["a"])  # vLLM recomputes it, then finishes it
    assert d.sched.request_finished(a, (10, 11, 12)) == (False, None)
    d.step()
    assert d.worker.driver.plane.get("decode_request", "a") is None
    for e in (p, d):  # what the job checks at the end: nothing held, the log replays
        e.worker.shutdown()
        assert e.worker.driver.plane.held() == []
        result = replay(tmp_path / f"{e.name}.events.jsonl")
        assert result.ok, (result.divergence, result.held)


def test_pending_push_work_is_read_from_the_machines(engines):
    """has_pending_push_work is P's engine_request machines in a lease state
    granted for push (no set of the connector's): not while prefilling, not
    for D's awaited push, still while an aborted lease is being freed, not
    once every rank ended it."""
    p, d = engines("prefill-0", 1), engines("decode-0", 2)
    x = Req("x", {"do_remote_decode": True})
    p.sched.on_new_request(x)
    assert p.sched.sched.request("x").state == "PREFILLING" and not p.sched.has_pending_push_work()
    _, params = p.sched.request_finished(x, (3, 4, 5))
    assert p.sched.sched.request("x").state == "LEASED" and p.sched.has_pending_push_work()
    a = Req("a", dict(params))
    d.sched.on_new_request(a)
    d.sched.get_num_new_matched_tokens(a, 0)
    d.sched.update_state_after_alloc(a, (10, 11, 12), 40)
    assert d.sched.sched.request("a").state == "AWAITING_RECV" and not d.sched.has_pending_push_work()
    p.step()
    p.sched.sched.abort("x")  # P gives the lease up: its ranks free the blocks, then report
    assert p.sched.sched.request("x").state == "FREEING" and p.sched.has_pending_push_work()
    run_until(lambda: "x" in p.finished["sending"], p, d)
    assert p.sched.sched.request("x") is None and not p.sched.has_pending_push_work()


@pytest.mark.parametrize("p_mode,d_mode", [("push", "pull"), ("pull", "push")])
def test_params_of_the_other_mode_are_refused_and_computed_locally(engines, p_mode, d_mode):
    p, d = engines("prefill-0", 1, mode=p_mode), engines("decode-0", 2, mode=d_mode)
    x = Req("x", {"do_remote_decode": True})
    p.sched.on_new_request(x)
    _, params = p.sched.request_finished(x, (3, 4, 5))
    assert params["transfer_mode"] == p_mode
    a = Req("a", dict(params))
    d.sched.on_new_request(a)
    assert d.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    assert d.sched.counters["bad_transfer_params"] == 1


def test_a_clients_push_key_does_not_make_a_pull_p_push(engines):
    p = engines("prefill-0", 1, mode="pull")
    x = Req("x", {"do_remote_decode": True, "push": True})
    p.sched.on_new_request(x)
    _, params = p.sched.request_finished(x, (3, 4, 5))
    assert params["transfer_mode"] == "pull" and not p.sched.has_pending_push_work()
    p.step()
    assert p.worker.driver.plane.get("push_write", "x") is None


def test_a_push_reg_without_the_deployments_mac_is_refused(engines):
    """The lease's name is in the params every client of P sees, and NIXL
    does not authenticate senders: a PUSH_REG naming D's engine and a lease P
    holds, but not signed with the deployment's key (unsigned, or signed
    with another), makes P WRITE nothing; D's signed one does."""
    from kvplane.connector.push_auth import sign_push_reg
    from kvplane.transport.wire import PushRegistration, encode_push_reg

    p, d = engines("prefill-0", 1), engines("decode-0", 2)
    first = Req("x1", {"do_remote_decode": True})
    p.sched.on_new_request(first)
    _, params1 = p.sched.request_finished(first, (3, 4, 5))
    p.step()
    a = Req("a", dict(params1))
    d.sched.on_new_request(a)
    d.sched.get_num_new_matched_tokens(a, 0)
    d.sched.update_state_after_alloc(a, (10, 11, 12), 40)
    run_until(lambda: "a" in d.finished["recving"], p, d)  # D is connected to P now
    second = Req("x2", {"do_remote_decode": True})
    p.sched.on_new_request(second)
    _, params2 = p.sched.request_finished(second, (6, 7, 8))
    p.step()
    reg = PushRegistration.at_side_channel(d.worker.driver.side_channel_url, request_id=params2["remote_request_id"],
                                           engine_id="decode-0/tp0", decode_request_id="b", block_ids=(20, 21, 22))
    p_agent = d.worker.driver.agents["prefill-0/tp0"]
    for forged in (reg, sign_push_reg(reg, b"not the deployment's key".ljust(32))):
        d.worker.endpoint.send_notif(p_agent, encode_push_reg(forged))
    run_until(lambda: p.worker.driver.counters["push_regs_refused_unauthenticated"] == 2, p, d, timeout=10)
    assert p.worker.driver.plane.get("push_write", "x2").state == "AWAITING_REG"
    assert p.worker.driver.counters["writes_posted"] == 1  # the first request's only


@pytest.mark.parametrize("extra", [["--prefill-tp", "2"], ["--decode-tp", "2"], ["--bidirectional"]])
def test_the_vllm_job_refuses_push_where_it_does_not_run(extra, capsys):
    from kvplane.app.cli import main

    # Refused before anything starts, whether or not vLLM is installed: one line on stderr.
    assert main(["run", "--engine", "vllm", "--push", *extra]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1
    assert "--push runs with --prefill-tp 1 and --decode-tp 1, without --bidirectional" in err
