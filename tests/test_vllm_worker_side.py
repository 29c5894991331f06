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
from kvplane.app.vllm.run import _port_free
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


def _tokens(t: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """``t``'s blocks ``ids`` token by token ([heads, tokens, K then V]; vLLM's CPU block layout)."""
    from kvplane.app.vllm.kv_check import token_major

    return token_major(t[ids].transpose(0, 1).reshape(t.shape[1], len(ids) * t.shape[2], -1).unsqueeze(0),
                       t.shape[2])[0]


def test_d_reads_p_s_16_token_blocks_into_its_32_token_blocks(tmp_path):
    """Unlike --block-size (transport.block_sizes): D's handshake learns P's
    blocks hold 16 tokens, its params check counts them in P's blocks, and
    its worker reads them slice by slice into its blocks of 32."""
    p = Engine("prefill-0", tmp_path, seed=1)
    d = Engine("decode-0", tmp_path, seed=2, block_tokens=32, kvplane_remote_block_size=16)
    try:
        x = Req("x", {"do_remote_decode": True})
        p.sched.on_new_request(x)
        delay, params = p.sched.request_finished(x, (3, 4, 5))
        p.step()
        a = Req("a", params)
        d.sched.on_new_request(a)
        assert d.sched.get_num_new_matched_tokens(a, 0) == (40, True)
        before = {name: t.clone() for name, t in d.kv.items()}
        d.sched.update_state_after_alloc(a, (10, 11), 40)
        run_until(lambda: "a" in d.finished["recving"], p, d)
        assert not d.finished["failed"] and d.sched.counters["bad_transfer_params"] == 0
        for name in p.kv:
            # Tokens 0..47 (P's 3 blocks, the last whole) in D's blocks 10, 11; D's 48..63 untouched.
            assert torch.equal(_tokens(d.kv[name], [10, 11])[:, :48], _tokens(p.kv[name], [3, 4, 5]))
            assert torch.equal(_tokens(d.kv[name], [11])[:, 16:], _tokens(before[name], [11])[:, 16:])
            others = [b for b in range(32) if b not in (10, 11)]
            assert torch.equal(d.kv[name][others], before[name][others])
        run_until(lambda: "x" in p.finished["sending"], p, d)  # D's completion consumed P's lease
    finally:
        for e in (p, d):
            e.worker.shutdown()


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


def test_d_reads_from_the_dp_engine_core_that_served_p_at_its_port_and_engine_id(tmp_path):
    """vLLM's P with --data-parallel-size 2: two engine cores, one
    kv_connector_extra_config (one side-channel port, file names with
    ``{dp}``), engine ids suffixed ``_dp0`` / ``_dp1``.  Each core listens on
    port + dp_index (TP 1), writes its own files, and a D reads each request
    from the core its params name, byte for byte."""
    base = free_port()
    while not all(_port_free(base + k) for k in range(2)):
        base = free_port()
    names = {"kvplane_event_log": str(tmp_path / "prefill.dp{dp}.events.jsonl"),
             "kvplane_status_file": str(tmp_path / "prefill.dp{dp}.status.json")}
    cores = [Engine(f"prefill-0_dp{k}", tmp_path, seed=1 + k, dp_index=k, side_channel_port=base, **names)
             for k in range(2)]
    d = Engine("decode-0", tmp_path, seed=9)
    try:
        assert [c.worker.rank_info().side_channel_port for c in cores] == [base, base + 1]
        for k, core in enumerate(cores):
            x = Req(f"x{k}", {"do_remote_decode": True})
            core.sched.on_new_request(x)
            _, params = core.sched.request_finished(x, (3, 4, 5))
            assert (params["remote_engine_id"], params["remote_port"]) == (f"prefill-0_dp{k}", base + k)
            core.step()
            a = Req(f"a{k}", params)
            d.sched.on_new_request(a)
            assert d.sched.get_num_new_matched_tokens(a, 0) == (40, True)
            d.sched.update_state_after_alloc(a, (10 + 3 * k, 11 + 3 * k, 12 + 3 * k), 40)
            run_until(lambda k=k, core=core: f"a{k}" in d.finished["recving"] and f"x{k}" in core.finished["sending"],
                      *cores, d)
            for layer in core.kv:
                assert torch.equal(d.kv[layer][[10 + 3 * k, 11 + 3 * k, 12 + 3 * k]], core.kv[layer][[3, 4, 5]])
        assert not d.finished["failed"]
        assert cores[0].kv["layer0"][3].ne(cores[1].kv["layer0"][3]).any()  # two cores' KV: D read each one's
    finally:
        for e in (*cores, d):
            e.worker.shutdown()
    for k in range(2):
        status = json.loads((tmp_path / f"prefill.dp{k}.status.json").read_text())
        assert status["engine_id"] == f"prefill-0_dp{k}" and status["closed"] and status["plane_held"] == []
        result = replay(tmp_path / f"prefill.dp{k}.events.jsonl")
        assert result.ok and result.lines > 1, (result.divergence, result.held)


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
