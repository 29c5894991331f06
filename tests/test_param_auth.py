"""P vouches for its kv_transfer_params, D checks them (issue 30): the MAC,
the prompt they were made for, the exact block list, single use, the
deployment secret and its rotation, dump tags.  The scheduler halves are
driven with vLLM-shaped stand-in requests (no vLLM, no NIXL)."""
from __future__ import annotations

import copy

import pytest

from kvplane.connector import param_auth
from kvplane.connector.kv_dump import DUMP_KEY, dump_path, tag_problem
from kvplane.connector.param_auth import AUTH_KEY, ConsumedLeases, RefusedParams, prompt_digest, sign, verify
from kvplane.connector.records import RankInfo
from kvplane.connector.secret import keys_from_text, load_keys, write_secret_file
from kvplane.connector.vllm_params import from_vllm
from kvplane.connector.vllm_scheduler import VllmSchedulerSide
from kvplane.connector.vllm_settings import settings_from
from kvplane.statemachines.config import ConfigError
from vllm_support import Req

OLD, NEW = "a" * 64, "b" * 64
TOKENS = 40  # 3 blocks of 16


def side(name: str, secret_text: str | None, tmp_path, **extra) -> VllmSchedulerSide:
    cfg = dict(extra)
    if secret_text is None:
        cfg["kvplane_insecure"] = True
    else:
        path = tmp_path / f"{name}.secret"
        path.write_text(secret_text)
        cfg["kvplane_secret_file"] = str(path)
    warned: list = []
    s = VllmSchedulerSide(name, settings_from(cfg, environ={}), warn=lambda *a: warned.append(a))
    s.warned = warned  # type: ignore[attr-defined]
    s.add_ranks({0: RankInfo(rank=0, engine_id=f"{name}/tp0", side_channel_port=5700, public_key=None)})
    return s


def grant(p: VllmSchedulerSide, rid: str = "x", tokens: int = TOKENS, blocks=(4, 5, 6), **req) -> dict:
    """What P hands out for a request of ``tokens`` prompt tokens."""
    x = Req(rid, {"do_remote_decode": True}, num_prompt_tokens=tokens, num_computed_tokens=tokens, **req)
    p.on_new_request(x)
    delay, params = p.request_finished(x, blocks)
    assert delay and params is not None
    return params


def accepted(d: VllmSchedulerSide, params: dict, rid: str = "a", tokens: int = TOKENS, **req) -> bool:
    """Whether D registers a request with these params (and would load its tokens)."""
    a = Req(rid, params, num_prompt_tokens=tokens, num_computed_tokens=0, **req)
    d.on_new_request(a)
    n, is_async = d.get_num_new_matched_tokens(a, 0)
    return (n, is_async) == (tokens, True)


@pytest.fixture
def pd(tmp_path):
    return side("prefill-0", OLD, tmp_path), side("decode-0", OLD, tmp_path)


# ---------------------------------------------------------------- the MAC
def test_signed_params_are_accepted_and_register_only_the_signed_fields(pd):
    p, d = pd
    params = grant(p)
    assert params[AUTH_KEY]["kid"] and params["remote_block_ids"] == [[4, 5, 6]]
    assert accepted(d, dict(params, remote_blocks_expiry_time=1e12, surprise="x"))
    (new,) = d.build_step([]).meta.new_requests
    assert new.remote.remote_expiry == params["remote_expiry"]  # the client's expiry is not read
    assert new.remote.remote_public_key == d.settings.keys.signing.curve_public
    assert d.counters["kvplane_refused_params"] == 0


TAMPER = {
    "remote_engine_id": "prefill-evil", "remote_host": "127.0.0.2", "remote_port": 5701,
    "remote_rank_ports": [5701], "remote_ranks": [1], "tp_size": 2, "remote_request_id": "x-other",
    "remote_block_ids": [[4, 5, 7]], "remote_num_tokens": 39, "remote_expiry": 1e12,
    "remote_renewable": False, "expected_consumers": 2, "transfer_mode": "push",
}


@pytest.mark.parametrize("field", sorted(TAMPER))
def test_every_signed_field_tampered_is_refused(pd, field):
    p, d = pd
    params = grant(p)
    assert params[field] != TAMPER[field]
    assert not accepted(d, dict(params, **{field: TAMPER[field]}))
    assert d.counters["kvplane_refused_params"] == 1 and d.build_step([]).meta.empty


@pytest.mark.parametrize("part, value", [("kid", "0" * 16), ("prompt_sha256", "0" * 64), ("issued", 0.0),
                                         ("mac", "0" * 64), ("v", 2)])
def test_the_auth_itself_tampered_is_refused(pd, part, value):
    p, d = pd
    params = grant(p)
    bad = copy.deepcopy(params)
    bad[AUTH_KEY][part] = value
    assert not accepted(d, bad)


@pytest.mark.parametrize("auth", [None, "x", [], {"mac": "0" * 64}, {"v": True, "kid": 1, "prompt_sha256": 2,
                                                                     "issued": "x", "mac": None}])
def test_missing_or_malformed_auth_is_refused(pd, auth):
    p, d = pd
    params = grant(p)
    bad = dict(params, **{AUTH_KEY: auth}) if auth is not None else {k: v for k, v in params.items() if k != AUTH_KEY}
    assert not accepted(d, bad)
    assert d.counters["kvplane_refused_params"] == 1


def test_another_deployments_key_is_refused(tmp_path):
    p, d = side("prefill-0", OLD, tmp_path), side("decode-0", NEW, tmp_path)
    assert not accepted(d, grant(p))
    assert d.counters["refused_params: unknown key"] == 1


def test_rotation_the_accepted_second_secret_verifies(tmp_path):
    # Step 2 of a rotation: P already signs with NEW (accepting OLD), D still
    # signs with OLD and accepts NEW; and the other way round.
    p = side("prefill-0", f"{NEW}\n{OLD}\n", tmp_path)
    d = side("decode-0", f"{OLD}\n{NEW}\n", tmp_path)
    assert accepted(d, grant(p))
    assert accepted(p, grant(d, "y"), rid="b")
    # A D that never heard of NEW refuses what P signs now.
    assert not accepted(side("decode-1", OLD, tmp_path), grant(p, "z"))


def test_a_replay_is_refused_until_its_term_is_over(pd):
    p, d = pd
    params = grant(p)
    assert accepted(d, params)
    assert not accepted(d, params, rid="b")  # the same params again: another request
    assert d.counters["refused_params: replayed"] == 1
    # Once the term (P's expiry - issue time) and the slack are over, the name
    # is forgotten (the READ gate declines such params anyway).
    term = params["remote_expiry"] - params[AUTH_KEY]["issued"]
    assert term == p.settings.plane.kv_lease_duration
    clock = d.sched.clock
    d.sched.clock = lambda: clock() + term + param_auth.CONSUMED_SLACK_S + 1
    assert accepted(d, params, rid="c")


def test_consumed_memory_is_bounded_and_fails_closed():
    mem = ConsumedLeases(cap=2)
    mem.consume("a", 10, now=0)
    mem.consume("b", 100, now=0)
    with pytest.raises(RefusedParams, match="memory full"):
        mem.consume("c", 10, now=1)
    mem.consume("c", 10, now=10 + param_auth.CONSUMED_SLACK_S + 1)  # "a" expired: room again
    assert len(mem) == 2
    with pytest.raises(RefusedParams, match="replayed"):
        mem.consume("b", 100, now=50)


def test_params_made_for_another_prompt_are_refused(pd):
    p, d = pd
    params = grant(p)
    other = list(range(1000, 1000 + TOKENS))
    assert not accepted(d, params, prompt_token_ids=other)
    assert d.counters["refused_params: made for another prompt"] == 1
    # The same prompt length with one token changed, and a longer prompt.
    one_off = list(range(7, 7 + TOKENS))
    one_off[-1] += 1
    assert not accepted(d, params, rid="b", prompt_token_ids=one_off)
    assert not accepted(d, params, rid="c", tokens=TOKENS + 16)
    assert not accepted(d, params, rid="e", prompt_token_ids=None)  # prompt embeddings: nothing to compare


@pytest.mark.parametrize("blocks", [(4,), (4, 5), (4, 5, 6, 7), (6, 5, 4), (4, 4, 5)])
def test_block_lists_not_covering_the_tokens_are_refused(tmp_path, blocks):
    """P signs what it is given, so a short, long or duplicated list is
    refused by the count check even when the MAC verifies; a reversed one
    is refused by the MAC when a client reorders P's."""
    p, d = side("prefill-0", OLD, tmp_path), side("decode-0", OLD, tmp_path)
    if len(blocks) == 3 and len(set(blocks)) == 3:
        params = grant(p)
        params = dict(params, remote_block_ids=[list(blocks)])
    else:
        params = grant(p, blocks=blocks)
    assert not accepted(d, params)
    assert d.counters["kvplane_refused_params"] == 1


def test_insecure_params_must_still_cover_exactly_the_prompt(tmp_path):
    p, d = side("prefill-0", None, tmp_path), side("decode-0", None, tmp_path)
    params = grant(p)
    assert AUTH_KEY not in params
    assert accepted(d, params)
    for bad in ([[4]], [[4, 4, 5]], [[4, 5, 6, 7]]):
        assert not accepted(d, dict(params, remote_block_ids=bad), rid=f"b{len(bad[0])}")
    assert not accepted(d, dict(params, remote_num_tokens=TOKENS + 1), rid="c")


def test_both_prefill_and_decode_flags_are_refused_and_leave_nothing(pd):
    p, d = pd
    params = dict(grant(p), do_remote_decode=True)
    assert not accepted(d, params)
    assert d.sched.plane.live()["engine_request"] == 0 and d.build_step([]).meta.empty


def test_sign_and_verify_directly():
    keys = keys_from_text(OLD)
    params = {"remote_engine_id": "p", "remote_host": "h", "remote_port": 1, "remote_rank_ports": [1],
              "remote_ranks": [0], "tp_size": 1, "remote_request_id": "r", "remote_block_ids": [[1, 2]],
              "remote_num_tokens": 20, "remote_expiry": 100, "remote_renewable": True,
              "expected_consumers": 1, "transfer_mode": "pull"}
    signed = sign(params, prompt_sha256=prompt_digest(range(20)), issued=70, key=keys.signing)
    v = verify(from_vllm(signed), keys)
    assert v.term == 30 and v.lease_name == "r" and v.fields["remote_block_ids"] == [1, 2]
    # A JSON hop that writes 100 as 100.0 changes nothing.
    assert verify(from_vllm(dict(signed, remote_expiry=100.0)), keys).term == 30
    with pytest.raises(RefusedParams, match="bad signature"):
        verify(from_vllm(dict(signed, remote_block_ids=[[1, 2 ** 70]])), keys)  # msgpack cannot even encode it
    assert prompt_digest([1, 2]) == prompt_digest(iter([1, 2])) != prompt_digest([2, 1])
    with pytest.raises(ValueError):
        prompt_digest([-1])


# ---------------------------------------------------------------- the secret
def test_secret_file_and_env(tmp_path):
    path = tmp_path / "s"
    secret = write_secret_file(path)
    assert path.stat().st_mode & 0o077 == 0 and len(secret) == 64
    by_key = settings_from({"kvplane_secret_file": str(path)}, environ={})
    by_env = settings_from({}, environ={"KVPLANE_SECRET_FILE": str(path)})
    assert by_key.keys == by_env.keys == load_keys(path) and not by_key.insecure
    k = by_key.keys.signing
    assert len(k.curve_public) == len(k.curve_secret) == 40 and OLD not in repr(by_key.keys)
    # The same secret gives every engine the same keys; another secret others.
    assert keys_from_text(secret).signing == k != keys_from_text(OLD).signing
    two = keys_from_text(f"{NEW}\n\n{OLD}\n")
    assert two.signing.key_id == keys_from_text(NEW).signing.key_id and len(two.public_keys) == 2


@pytest.mark.parametrize("text, words", [("", "found 0"), ("short\n", "at least 32"),
                                         (f"{OLD}\n{NEW}\n{'c' * 64}", "found 3"), (f"{OLD}\n{OLD}", "twice")])
def test_bad_secret_files_name_the_setting(tmp_path, text, words):
    path = tmp_path / "s"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as info:
        settings_from({"kvplane_secret_file": str(path)}, environ={})
    assert info.value.field == "kvplane_secret_file"


def test_no_secret_needs_an_explicit_insecure(tmp_path):
    with pytest.raises(ConfigError, match="kvplane_insecure: true") as info:
        settings_from({}, environ={})
    assert info.value.field == "kvplane_secret_file"
    with pytest.raises(ConfigError) as info:
        settings_from({"kvplane_secret_file": str(tmp_path / "missing")}, environ={})
    assert info.value.field == "kvplane_secret_file"
    path = tmp_path / "s"
    write_secret_file(path)
    with pytest.raises(ConfigError) as info:
        settings_from({"kvplane_secret_file": str(path), "kvplane_insecure": True}, environ={})
    assert info.value.field == "kvplane_insecure"
    with pytest.raises(ConfigError) as info:
        settings_from({"kvplane_secret_file": str(path), "kvplane_keypair": str(path)}, environ={})
    assert info.value.field == "kvplane_keypair"


# ---------------------------------------------------------------- dump tags
@pytest.mark.parametrize("tag", ["../x", "/tmp/x", "a/b", ".hidden", "", "x" * 129, "a\nb", 5, None])
def test_dump_tags_are_names_never_paths(tmp_path, tag):
    assert tag_problem(tag) is not None
    if tag != "x" * 129:  # too long for a tag, not for a file name: the rest is no name at all
        with pytest.raises(ValueError):
            dump_path(str(tmp_path), tag, 0)  # type: ignore[arg-type]
    d = side("decode-0", OLD, tmp_path, kvplane_kv_dump_dir=str(tmp_path))
    local = Req("l", {DUMP_KEY: tag})
    assert d.request_finished(local, (1, 2)) == (False, None)  # no dump, blocks freed now
    assert d.build_step([]).dumps == ()
    if tag is not None:
        assert d.counters["kvplane_refused_dump_tags"] == 1 and d.warned
        assert d.stats() == {"kvplane_refused_dump_tags": 1} and d.stats() == {}


def test_a_plain_tag_still_dumps(tmp_path):
    d = side("decode-0", OLD, tmp_path, kvplane_kv_dump_dir=str(tmp_path))
    assert d.request_finished(Req("l", {DUMP_KEY: "run-1.req_7"}), (1, 2)) == (True, None)
    assert [x.tag for x in d.build_step([]).dumps] == ["run-1.req_7"]
    assert dump_path(str(tmp_path), "run-1.req_7.recv", 0) == str(tmp_path / "run-1.req_7.recv.rank0.pt")


def test_refusals_reach_the_stats_and_the_log_is_rate_limited(pd):
    p, d = pd
    params = grant(p)
    for i in range(25):
        assert not accepted(d, dict(params, remote_port=1000 + i), rid=f"r{i}")
    assert d.stats() == {"kvplane_refused_params": 25}
    assert len(d.warned) == 10  # the first ten; then every 1000th


def test_the_scheduler_halfs_counts_join_the_workers_in_vllms_stats():
    from kvplane.connector import vllm_stats

    worker = vllm_stats.stats_data(0, {"bytes_transferred": 10}, {"kvplane_leases": 2})
    sched = vllm_stats.scheduler_stats_data({"kvplane_refused_params": 3, "kvplane_refused_dump_tags": 1})
    reduced = vllm_stats.reduce(vllm_stats.merge(worker, sched))
    assert (reduced["kvplane_refused_params"], reduced["kvplane_refused_dump_tags"]) == (3, 1)
    assert reduced["bytes_transferred"] == 10 and reduced["kvplane_leases"] == 2  # the rank's gauges kept
    assert vllm_stats.is_empty(vllm_stats.scheduler_stats_data({}))
