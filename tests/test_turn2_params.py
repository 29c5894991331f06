"""Bidirectional turn 2 in the vLLM scheduler halves (no vLLM, no NIXL):
D holds a read request's blocks and returns NixlConnector's keys for them
(``do_remote_decode``, its ``remote_block_ids``,
``remote_blocks_expiry_time``), signed over the held tokens; the next turn
goes to P with them; P accepts them for a prompt that starts with exactly
the held tokens, reads only their whole blocks, once, and serves D's
read-back whatever became of its read."""
from __future__ import annotations

import pytest

from kvplane.connector.param_auth import AUTH_KEY
from kvplane.connector.records import RankInfo, WorkerReport
from kvplane.connector.vllm_scheduler import VllmSchedulerSide
from kvplane.connector.vllm_settings import settings_from
from kvplane.statemachines.config import ConfigError
from vllm_support import Req

BLOCK = 16
PROMPT = list(range(10, 50))  # turn 1: 40 tokens (3 blocks)
ANSWER = list(range(900, 917))  # 17 tokens decoded by D; the hold covers prompt + answer[:-1] = 56 tokens


def side(name: str, tmp_path, secret: bool = True, threshold: int = 0) -> VllmSchedulerSide:
    """``threshold``: kv_recompute_threshold (0 here: these reads of 48
    tokens are below NixlConnector's default 64)."""
    cfg: dict = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": threshold}
    if secret:
        path = tmp_path / "kvplane.secret"
        if not path.exists():
            path.write_text("c" * 64)
        cfg["kvplane_secret_file"] = str(path)
    else:
        cfg["kvplane_insecure"] = True
    s = VllmSchedulerSide(name, settings_from(cfg, environ={}), block_size=BLOCK)
    s.add_ranks({0: RankInfo(rank=0, engine_id=f"{name}/tp0", side_channel_port=5700 if name[0] == "p" else 5800,
                             public_key=None)})
    return s


class Turn1Req(Req):
    @property
    def all_token_ids(self):
        return self.prompt_token_ids + ANSWER


def hold(p: VllmSchedulerSide, d: VllmSchedulerSide) -> dict:
    """Turn 1 through both halves; D's response params (its hold)."""
    x = Req("t1p", {"do_remote_decode": True}, num_prompt_tokens=len(PROMPT), num_computed_tokens=len(PROMPT),
            prompt_token_ids=list(PROMPT))
    p.on_new_request(x)
    _, lease = p.request_finished(x, (1, 2, 3))
    a = Turn1Req("t1d", lease, num_prompt_tokens=len(PROMPT), num_computed_tokens=0, prompt_token_ids=list(PROMPT))
    d.on_new_request(a)
    assert d.get_num_new_matched_tokens(a, 0) == (len(PROMPT), True)
    d.update_state_after_alloc(a, (5, 6, 7), len(PROMPT))
    d.update_from_workers([WorkerReport(rank=0, finished_recving={"t1d"})])
    d.build_step(["t1d"])
    a.num_computed_tokens = len(PROMPT) + len(ANSWER) - 1
    delay, held = d.request_finished(a, (5, 6, 7, 8, 9))  # one block more than the tokens need
    assert delay and held is not None
    return held


def turn2(p: VllmSchedulerSide, params: dict, prompt: list[int], rid: str = "t2p") -> tuple[Req, tuple]:
    r = Req(rid, dict(params, do_remote_decode=True), num_prompt_tokens=len(prompt), num_computed_tokens=0,
            prompt_token_ids=list(prompt))
    p.on_new_request(r)
    return r, p.get_num_new_matched_tokens(r, 0)


@pytest.mark.parametrize("secret", [True, False])
def test_d_holds_in_nixl_keys_and_p_reads_the_whole_blocks_of_the_prefix(tmp_path, secret):
    p, d = side("prefill-0", tmp_path, secret), side("decode-0", tmp_path, secret)
    held = hold(p, d)
    assert held["do_remote_decode"] is True and held["do_remote_prefill"] is False
    assert held["remote_block_ids"] == [[5, 6, 7, 8]]  # ceil(56 / 16): exactly the held tokens' blocks
    assert held["remote_num_tokens"] == 56 and held["remote_blocks_expiry_time"] == held["remote_expiry"]
    assert (AUTH_KEY in held) is secret
    prompt2 = PROMPT + ANSWER + list(range(300, 330))
    r, (n, is_async) = turn2(p, held, prompt2)
    assert (n, is_async) == (48, True)  # 3 whole blocks of the 56 held tokens; P computes the rest
    (new,) = p.build_step([]).meta.new_requests
    assert new.remote.remote_block_ids == (5, 6, 7) and new.remote.remote_renewable is False
    p.update_state_after_alloc(r, (11, 12, 13), n)
    p.update_from_workers([WorkerReport(rank=0, finished_recving={"t2p"})])
    p.build_step(["t2p"])
    r.num_computed_tokens = len(prompt2)
    delay, back = p.request_finished(r, (11, 12, 13, 14, 15, 16))
    assert delay and back["do_remote_prefill"] is True and back["remote_renewable"] is True
    assert p.counters["kvplane_refused_params"] == 0


@pytest.mark.parametrize("threshold", [49, 64])
def test_a_turn_2_read_below_the_recompute_threshold_is_computed_and_d_told_to_free(tmp_path, threshold):
    p, d = side("prefill-0", tmp_path, threshold=threshold), side("decode-0", tmp_path)
    held = hold(p, d)
    prompt2 = PROMPT + ANSWER + list(range(300, 330))
    r, got = turn2(p, held, prompt2)
    assert got == (0, False)  # 48 whole-block tokens to read: below the threshold, computed on P
    assert p.sched.counters["below_recompute_threshold"] == 1
    p.update_state_after_alloc(r, (), 0)
    meta = p.build_step(["t2p"]).meta
    (new,) = meta.new_requests
    (load,) = meta.loads  # notify only: the ranks tell D to free its hold now, nothing is read
    assert new.remote.remote_block_ids == (5, 6, 7) and load.block_ids == () and not load.awaiting
    assert p.sched.request("t2p").state == "LOCAL"
    r.num_computed_tokens = len(prompt2)
    delay, back = p.request_finished(r, (11, 12, 13, 14, 15, 16))
    assert delay and back["do_remote_prefill"] is True  # D still reads turn 2 back


def test_a_turn_2_read_at_the_recompute_threshold_is_made(tmp_path):
    p, d = side("prefill-0", tmp_path, threshold=48), side("decode-0", tmp_path)
    _, got = turn2(p, hold(p, d), PROMPT + ANSWER + list(range(300, 330)))
    assert got == (48, True) and p.sched.counters["below_recompute_threshold"] == 0


def test_kv_recompute_threshold_defaults_to_nixl_s_and_refuses_a_non_count():
    base = {"kvplane_insecure": True}
    assert settings_from(base, environ={}).kv_recompute_threshold == 64
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ConfigError, match="kv_recompute_threshold"):
            settings_from({**base, "kv_recompute_threshold": bad}, environ={})

@pytest.mark.parametrize("change", ["another prefix", "shorter than the hold", "replayed"])
def test_p_refuses_params_not_for_its_prompt_and_still_serves(tmp_path, change):
    p, d = side("prefill-0", tmp_path), side("decode-0", tmp_path)
    held = hold(p, d)
    prompt2 = PROMPT + ANSWER + list(range(300, 330))
    if change == "another prefix":
        prompt2[3] += 1
    elif change == "shorter than the hold":
        prompt2 = prompt2[:50]
    else:
        turn2(p, held, prompt2, rid="first")
    r, got = turn2(p, held, prompt2)
    assert got == (0, False)  # computed on P
    assert p.counters["kvplane_refused_params"] == 1
    r.num_computed_tokens = len(prompt2)
    delay, back = p.request_finished(r, (11, 12, 13, 14))
    assert delay and back["do_remote_prefill"] is True  # D still reads turn 2 back


def test_a_hold_shorter_than_a_block_is_computed_on_p(tmp_path):
    p = side("prefill-0", tmp_path)
    d = side("decode-0", tmp_path)
    held = hold(p, d)
    short = dict(held, remote_num_tokens=10)  # tampered: the MAC refuses it first
    _, got = turn2(p, short, PROMPT + ANSWER)
    assert got == (0, False) and p.counters["kvplane_refused_params"] == 1


def test_without_bidirectional_p_treats_the_params_as_a_plain_prefill(tmp_path):
    path = tmp_path / "kvplane.secret"
    path.write_text("c" * 64)
    p = VllmSchedulerSide("prefill-0", settings_from({"kvplane_secret_file": str(path)}, environ={}),
                          block_size=BLOCK)
    p.add_ranks({0: RankInfo(rank=0, engine_id="prefill-0/tp0", side_channel_port=5700, public_key=None)})
    d = side("decode-0", tmp_path)
    held = hold(side("prefill-1", tmp_path), d)
    r, got = turn2(p, held, PROMPT + ANSWER + [1, 2])
    assert got == (0, False) and p.counters["kvplane_refused_params"] == 0
    r.num_computed_tokens = r.num_prompt_tokens
    delay, back = p.request_finished(r, (1, 2, 3, 4))
    assert delay and back["do_remote_prefill"] is True


def test_the_readers_tp_sets_every_lease_s_consumers(tmp_path):
    # vLLM's P learns nothing of D's TP before D's completions: kvplane_reader_tp tells it.
    path = tmp_path / "kvplane.secret"
    path.write_text("c" * 64)
    p = VllmSchedulerSide("prefill-0", settings_from({"kvplane_secret_file": str(path), "kvplane_reader_tp": 2},
                                                     environ={}), block_size=BLOCK)
    p.add_ranks({0: RankInfo(rank=0, engine_id="prefill-0/tp0", side_channel_port=5700, public_key=None)})
    x = Req("x", {"do_remote_decode": True}, num_prompt_tokens=len(PROMPT), num_computed_tokens=len(PROMPT),
            prompt_token_ids=list(PROMPT))
    p.on_new_request(x)
    _, lease = p.request_finished(x, (1, 2, 3))
    assert lease["expected_consumers"] == 2
    for bad in (0, True, "2", 2000):
        with pytest.raises(ConfigError, match="kvplane_reader_tp"):
            settings_from({"kvplane_insecure": True, "kvplane_reader_tp": bad}, environ={})
