"""Both halves of the vLLM connector, P and D, over real NIXL and ZMQ, in one
process and without vLLM: the scheduler halves' steps drive the worker
halves the way vLLM's engine loop would, with vLLM-shaped per-layer KV
tensors.  The data, the stats, the status files, the KV dumps and the
event logs are what the vLLM job relies on."""
from __future__ import annotations

import json

import pytest
import torch

from kvplane.app.vllm.kv_check import check_all
from kvplane.connector.kv_dump import DUMP_KEY, DumpKV
from kvplane.connector.vllm_scheduler import scheduler_log_path
from kvplane.connector.vllm_settings import settings_from
from kvplane.connector.vllm_worker import VllmWorkerSide
from kvplane.statemachines.replay import replay
from vllm_engine_support import Engine, Req, free_port
from vllm_support import run_until


@pytest.fixture
def pair(tmp_path):
    p = Engine("prefill-0", tmp_path, seed=1)
    d = Engine("decode-0", tmp_path, seed=2)
    yield p, d
    for e in (p, d):
        e.worker.shutdown()


def test_d_reads_ps_blocks_and_both_end_holding_nothing(pair, tmp_path):
    p, d = pair
    x = Req("x", {"do_remote_decode": True, DUMP_KEY: "t.p"})
    p.sched.on_new_request(x)
    delay, params = p.sched.request_finished(x, (3, 4, 5))
    assert delay
    p.step()
    a = Req("a", dict(params, **{DUMP_KEY: "t"}))
    d.sched.on_new_request(a)
    assert d.sched.get_num_new_matched_tokens(a, 0) == (40, True)
    d.sched.update_state_after_alloc(a, (10, 11, 12), 40)
    run_until(lambda: "a" in d.finished["recving"], p, d)
    assert not d.finished["failed"]
    for name in p.kv:
        assert torch.equal(d.kv[name][[10, 11, 12]], p.kv[name][[3, 4, 5]])
    run_until(lambda: "x" in p.finished["sending"], p, d)  # D's completion consumed P's lease
    d.step(["a"])
    assert d.sched.request_finished(a, (10, 11, 12)) == (True, None)  # held for its dump
    run_until(lambda: "a" in d.finished["sending"], p, d)

    counts_d, gauges_d = d.worker.stats()
    counts_p, gauges_p = p.worker.stats()
    assert counts_d["bytes_transferred"] == 3 * 2 * p.kv["layer0"][0].numel() * 2
    assert counts_d["num_successful_transfers"] == 1
    assert counts_p["kvplane_leases_consumed"] == 1
    assert gauges_p["kvplane_blocks_held"] == 0 and gauges_d["kvplane_recvs_in_flight"] == 0
    assert d.worker.stats()[0] == {}  # counts are per interval
    # The dumps: D's read blocks are P's, byte for byte (the job's KV check,
    # with P's dump as D's "recompute" too: there is no model here).
    (tmp_path / "t.local.rank0.pt").write_bytes((tmp_path / "t.p.rank0.pt").read_bytes())
    (verdict,) = check_all(tmp_path, ["t"])
    assert verdict.ok and verdict.read_tokens == 48 and not verdict.declined, verdict  # 3 blocks of 16
    d.kv["layer1"][10, 0, 0, 0] += 1  # a wrong byte in a read block, dumped again: caught
    d.worker._dump(DumpKV(request_id="again", tag="t", block_ids=(10, 11, 12), num_tokens=40, holds_blocks=False))
    (bad,) = check_all(tmp_path, ["t"])
    assert not bad.ok and "1 of 2 blocks" in bad.why, bad
    # A read of a block P had reused: what arrived in the tail block is not P's
    # (block 10 is off by the byte flipped above, block 12 by this one).
    d.kv["layer0"][12, 1, 3, 5] += 1
    d.worker._dump(DumpKV(request_id="again", tag="t.recv", block_ids=(10, 11, 12), num_tokens=0,
                          holds_blocks=False, when="recv"))
    (stale,) = check_all(tmp_path, ["t"])
    assert "2 of the 3 blocks read differ from P's" in stale.why, stale

    for e in (p, d):
        e.worker.shutdown()
        status = json.loads((tmp_path / f"{e.sched.sched.engine_id}.status.json").read_text())
        assert status["closed"] and status["plane_held"] == []
        result = replay(tmp_path / f"{e.sched.sched.engine_id}.events.jsonl")
        assert result.ok, (result.divergence, result.held)


def test_an_expired_lease_is_declined_not_read(tmp_path):
    p = Engine("prefill-0", tmp_path, seed=1, kv_lease_duration=6)
    d = Engine("decode-0", tmp_path, seed=2, kv_lease_duration=6)
    try:
        x = Req("x", {"do_remote_decode": True})
        p.sched.on_new_request(x)
        _, params = p.sched.request_finished(x, (3, 4, 5))
        p.step()
        # A late forward: D gets the params only after the lease is over.
        run_until(lambda: "x" in p.finished["sending"], p, timeout=20)
        before = d.kv["layer0"][[10, 11, 12]].clone()
        a = Req("a", params)
        d.sched.on_new_request(a)
        d.sched.get_num_new_matched_tokens(a, 0)
        d.sched.update_state_after_alloc(a, (10, 11, 12), 40)
        run_until(lambda: "a" in d.finished["recving"], p, d)
        assert "a" in d.finished["failed"]
        assert torch.equal(d.kv["layer0"][[10, 11, 12]], before)  # nothing was read
        counts, _ = d.worker.stats()
        assert counts["kvplane_declined_reads"] == 1 and counts.get("bytes_transferred", 0) == 0
        assert p.worker.stats()[0]["num_kv_expired_reqs"] == 1
    finally:
        for e in (p, d):
            e.worker.shutdown()


def test_curve_keys_from_certificate_files(tmp_path):
    import zmq.auth

    for n in ("prefill-0", "decode-0"):
        zmq.auth.create_certificates(str(tmp_path), n)

    def keys(me, other):
        return {"kvplane_keypair": str(tmp_path / f"{me}.key_secret"),
                "kvplane_trusted_peers": {other: str(tmp_path / f"{other}.key")}}

    p = Engine("prefill-0", tmp_path, seed=1, **keys("prefill-0", "decode-0"))
    d = Engine("decode-0", tmp_path, seed=2, **keys("decode-0", "prefill-0"))
    try:
        assert not p.settings.insecure and p.worker.rank_info().public_key is not None
        x = Req("x", {"do_remote_decode": True}, num_prompt_tokens=10, num_computed_tokens=10)
        p.sched.on_new_request(x)
        _, params = p.sched.request_finished(x, (3,))
        p.step()
        a = Req("a", params, num_prompt_tokens=10, num_computed_tokens=10)
        d.sched.on_new_request(a)
        d.sched.get_num_new_matched_tokens(a, 0)
        d.sched.update_state_after_alloc(a, (9,), 10)
        run_until(lambda: "a" in d.finished["recving"], p, d)
        assert not d.finished["failed"]
        assert torch.equal(d.kv["layer1"][9], p.kv["layer1"][3])
    finally:
        for e in (p, d):
            e.worker.shutdown()


def test_layers_must_agree(tmp_path):
    settings = settings_from({"kvplane_insecure": True}, side_channel_port=free_port())
    w = VllmWorkerSide("e", settings)
    try:
        with pytest.raises(ValueError, match="shaped alike"):
            w.register_kv_caches({"a": torch.zeros(4, 2, 4, 4), "b": torch.zeros(4, 2, 4, 2)})
    finally:
        w.shutdown()


@pytest.mark.parametrize("template,path", [
    ("prefill.rank{rank}.events.jsonl", "prefill.scheduler.events.jsonl"),  # the vLLM job's at TP > 1
    ("d.{rank}.jsonl", "d.scheduler.jsonl"),
    ("logs/rank_{rank}.jsonl", "logs/scheduler.jsonl"),
    ("d.tp{rank}.jsonl", "d.scheduler.jsonl"),
    ("decode.events.jsonl", "decode.events.scheduler.jsonl"),  # no {rank}: before the extension
])
def test_the_scheduler_log_is_named_for_the_scheduler_not_as_a_rank(template, path):
    assert scheduler_log_path(template) == path


def test_engine_steps_alone_move_the_kv_when_the_tickers_never_run(pair):
    """A worker process whose ticker thread gets no turn (a busy-polling vLLM
    TP worker on a shared core; seen as a rank unstepped 74 s): the engine's
    own per-step calls must still serve the side channel, progress NIXL and
    take the completions, or every read through that rank is lost."""
    p, d = pair
    for e in (p, d):
        assert e.worker.ticker.stop(timeout=2.0)
    x = Req("x", {"do_remote_decode": True})
    p.sched.on_new_request(x)
    _, params = p.sched.request_finished(x, (3, 4, 5))
    p.step()
    a = Req("a", params)
    d.sched.on_new_request(a)
    d.sched.get_num_new_matched_tokens(a, 0)
    d.sched.update_state_after_alloc(a, (10, 11, 12), 40)
    run_until(lambda: "a" in d.finished["recving"] and "x" in p.finished["sending"], p, d, timeout=10.0)
    assert not d.finished["failed"]
    for name in p.kv:
        assert torch.equal(d.kv[name][[10, 11, 12]], p.kv[name][[3, 4, 5]])
