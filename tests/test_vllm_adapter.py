"""The vLLM connector's halves without vLLM: settings (NixlConnector's keys
and defaults), kv_transfer_params in vLLM's shape, and the scheduler half's
request paths (what vLLM's lifecycle turns into for the plane)."""
from __future__ import annotations

import pytest

from kvplane.connector.kv_dump import DUMP_KEY
from kvplane.connector.params import BadTransferParams
from kvplane.connector.records import RankInfo, WorkerReport
from kvplane.connector.vllm_params import from_vllm, to_vllm
from kvplane.connector.vllm_scheduler import VllmSchedulerSide
from kvplane.connector.vllm_settings import settings_from
from kvplane.statemachines.config import ConfigError
from vllm_support import Req, Status


# ---------------------------------------------------------------- settings
INSECURE = {"kvplane_insecure": True}


def test_defaults_are_nixl_connectors():
    s = settings_from(INSECURE, environ={})
    assert s.plane.kv_lease_duration == 30 and s.plane.heartbeat_interval == 5 and s.plane.lease_extension == 20
    assert s.plane.decoder_kv_blocks_ttl == 480
    assert s.plane.engine_ttl == 3600
    assert s.plane.kv_load_failure_policy == "fail"
    assert s.bidirectional is False and s.enforce_handshake_compat is True
    assert s.insecure and s.unknown_keys == ()


def test_keys_are_read_and_checked():
    s = settings_from({"kv_lease_duration": 12, "bidirectional_kv_xfer": True, "engine_ttl": 60,
                       "push_registration_timeout": 9, "kv_recompute_threshold": 64, "surprise": 1, **INSECURE},
                      kv_load_failure_policy="recompute")
    assert (s.plane.kv_lease_duration, s.plane.heartbeat_interval, s.plane.lease_extension) == (12, 2, 8)
    assert s.bidirectional and s.plane.engine_ttl == 60 and s.plane.push_registration_timeout == 9
    assert s.plane.kv_load_failure_policy == "recompute"
    assert s.unknown_keys == ("surprise",)  # NixlConnector's own keys are known, not unknown


@pytest.mark.parametrize("extra, key", [
    ({"kv_lease_duration": 3}, "kv_lease_duration"),
    ({"kv_lease_duration": float("nan")}, "kv_lease_duration"),
    ({"bidirectional_kv_xfer": "yes"}, "bidirectional_kv_xfer"),
    ({"kvplane_drop_notifications": 2.0}, "kvplane_drop_notifications"),
    ({"kvplane_side_channel_port": 70000}, "kvplane_side_channel_port"),
    ({"kvplane_trusted_peers": {"d": "key"}}, "kvplane_trusted_peers"),  # trust needs our own key
    ({"kvplane_insecure": False}, "kvplane_secret_file"),  # neither a secret nor insecure: refused
    ({"kvplane_insecure": "yes"}, "kvplane_insecure"),
    ({"kvplane_event_log": 5}, "kvplane_event_log"),
    ({"kvplane_side_channel_bind_host": "no host!"}, "kvplane_side_channel_bind_host"),
    ({"kvplane_ucx_net_devices": "eth0;rm"}, "kvplane_ucx_net_devices"),
    ({"backends": "UCX"}, "backends"),
    ({"backends": []}, "backends"),
    ({"backends": ["UCX", "UCX"]}, "backends"),
    ({"backends": ["POSIX"]}, "backends"),  # storage only: no way to read a remote engine
    ({"backends": ["UCX; rm"]}, "backends"),
    ({"num_threads": -1}, "num_threads"),
    ({"num_threads": True}, "num_threads"),
    ({"num_threads": 1000}, "num_threads"),
])
def test_bad_values_name_their_key(extra, key):
    with pytest.raises(ConfigError) as info:
        settings_from({**INSECURE, **extra}, environ={})
    assert info.value.field == key


def test_nixl_backends_and_threads_are_nixlconnectors_keys_with_kvplanes_thread_default():
    plain = settings_from(INSECURE, environ={})
    assert (plain.nixl_backends, plain.nixl_num_threads) == (("UCX",), 0)
    given = settings_from({**INSECURE, "backends": ["UCX", "POSIX"], "num_threads": 2}, environ={})
    assert (given.nixl_backends, given.nixl_num_threads, given.unknown_keys) == (("UCX", "POSIX"), 2, ())


def test_placement_keys_bind_and_advertise_apart():
    """Peers are told side_channel_host; the side channel binds the bind host (default: the same)."""
    plain = settings_from({"kvplane_insecure": True}, side_channel_host="10.0.0.5")
    assert plain.bind_host == "10.0.0.5" and plain.ucx_net_devices is None
    apart = settings_from({"kvplane_insecure": True, "kvplane_side_channel_bind_host": "0.0.0.0",
                           "kvplane_ucx_net_devices": "eth0,mlx5_0:1"},
                          side_channel_host="10.0.0.5")
    assert (apart.side_channel_host, apart.bind_host, apart.ucx_net_devices) == ("10.0.0.5", "0.0.0.0",
                                                                                "eth0,mlx5_0:1")


# ---------------------------------------------------------------- params
BLOCKS = list(range(3, 22))  # 19 blocks of 16: the 300 tokens of vllm_support.Req
P_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_host": "127.0.0.1",
            "remote_port": 5600, "remote_request_id": "r-abc", "remote_block_ids": BLOCKS,
            "expected_consumers": 1, "remote_expiry": 100.0, "remote_renewable": True, "tp_size": 1,
            "remote_rank_ports": [5600], "remote_ranks": [0]}


def test_params_out_carry_vllm_keys_and_come_back():
    out = to_vllm(P_PARAMS, num_tokens=300)
    assert out["do_remote_prefill"] is True and out["do_remote_decode"] is False
    assert out["remote_block_ids"] == [BLOCKS]  # one list per KV cache group
    assert out["remote_num_tokens"] == 300 and out["tp_size"] == 1
    assert out["remote_blocks_expiry_time"] is None  # a lease is renewed by heartbeats
    back = from_vllm(out)
    assert back["remote_block_ids"] == BLOCKS
    hold = to_vllm(dict(P_PARAMS, remote_renewable=False), num_tokens=1)
    assert hold["remote_blocks_expiry_time"] == 100.0


def test_params_in_refuse_what_kvplane_cannot_move():
    with pytest.raises(BadTransferParams, match="KV cache groups"):
        from_vllm(dict(P_PARAMS, remote_block_ids=[[1], [2]]))
    with pytest.raises(BadTransferParams, match="dcp_size"):
        from_vllm(dict(P_PARAMS, dcp_size=2))
    with pytest.raises(BadTransferParams, match="transfer_mode"):
        from_vllm(dict(P_PARAMS, transfer_mode="push"))
    with pytest.raises(BadTransferParams):
        from_vllm(["not", "a", "dict"])
    # A NixlConnector-style expiry becomes the remote expiry.
    assert from_vllm({k: v for k, v in P_PARAMS.items() if k != "remote_expiry"}
                     | {"remote_blocks_expiry_time": 7.0})["remote_expiry"] == 7.0


# ---------------------------------------------------------------- the scheduler half


def side(name="decode-0", **extra) -> VllmSchedulerSide:
    s = VllmSchedulerSide(name, settings_from({**INSECURE, **extra}))
    s.add_ranks({0: RankInfo(rank=0, engine_id=f"{name}/tp0", side_channel_port=5700, public_key=None)})
    return s


def d_params(**kw):
    return dict(to_vllm(P_PARAMS, num_tokens=300), **kw)


def test_awaited_recv_runs_only_after_vllm_heard_of_it():
    d = side()
    r = Req("a", d_params())
    d.on_new_request(r)
    assert d.get_num_new_matched_tokens(r, 0) == (300, True)
    d.update_state_after_alloc(r, (7, 8, 9), 300)
    d.update_state_after_alloc(r, (7, 8, 9, 10), 0)  # vLLM's second call, after the recv: ignored
    step = d.build_step(["a"])
    assert [n.request_id for n in step.meta.new_requests] == ["a"]
    assert [(ld.request_id, ld.block_ids, ld.awaiting) for ld in step.meta.loads] == [("a", (7, 8, 9), True)]
    assert step.meta.running == ()  # scheduled ids before the recv is reported are not "running"
    d.update_from_workers([WorkerReport(rank=0, finished_recving={"a"})])
    assert d.build_step(["a"]).meta.running == ("a",)
    assert d.build_step(["a"]).meta.running == ()  # once
    delay, params = d.request_finished(r, (7, 8, 9, 10))
    assert (delay, params) == (False, None)
    assert [f.request_id for f in d.build_step([]).meta.finished] == ["a"]


def test_abort_before_alloc_notifies_p_at_once_and_awaits_nothing():
    d = side()
    r = Req("a", d_params(), status=Status("FINISHED_ABORTED"))
    d.on_new_request(r)
    assert d.request_finished(r, ()) == (False, None)
    meta = d.build_step([]).meta
    # An unawaited empty recv: the worker notifies P, vLLM is never told.
    assert [(ld.request_id, ld.block_ids, ld.awaiting) for ld in meta.loads] == [("a", (), False)]
    assert meta.aborts == ()
    assert d.counters["aborted_before_alloc"] == 1


def test_abort_while_awaited_aborts_the_recv():
    d = side()
    r = Req("a", d_params())
    d.on_new_request(r)
    d.get_num_new_matched_tokens(r, 0)
    d.update_state_after_alloc(r, (1, 2, 3), 300)
    d.build_step([])
    r.status = Status("FINISHED_ABORTED")
    assert d.request_finished(r, (1, 2, 3)) == (False, None)  # vLLM frees once the recv is reported
    assert d.build_step([]).meta.aborts == ("a",)


def test_nothing_to_load_is_not_awaited():
    d = side()
    r = Req("a", d_params())
    d.on_new_request(r)
    assert d.get_num_new_matched_tokens(r, 300) == (0, False)
    d.update_state_after_alloc(r, (1, 2, 3), 0)
    loads = d.build_step([]).meta.loads
    assert [(ld.block_ids, ld.awaiting) for ld in loads] == [((), False)]


def test_bad_params_are_counted_and_computed_locally():
    warned = []
    d = VllmSchedulerSide("decode-0", settings_from(INSECURE), warn=lambda *a: warned.append(a))
    r = Req("a", d_params(remote_block_ids=[[1], [2]]))
    d.on_new_request(r)
    assert d.get_num_new_matched_tokens(r, 0) == (0, False)
    assert d.counters["bad_transfer_params"] == 1 and warned
    assert d.build_step([]).meta.empty


def test_prefill_finished_normally_leases_and_answers_in_vllms_shape():
    p = side("prefill-0")
    r = Req("x", {"do_remote_decode": True})
    p.on_new_request(r)
    delay, params = p.request_finished(r, (4, 5, 6))
    assert delay is True
    assert params["remote_engine_id"] == "prefill-0" and params["remote_block_ids"] == [[4, 5, 6]]
    assert params["remote_port"] == 5700 and params["do_remote_prefill"] is True
    assert params["remote_request_id"].startswith("x-")  # the lease's unguessable name
    grants = p.build_step([]).meta.grants
    assert [(g.request_id, g.block_ids) for g in grants] == [("x", (4, 5, 6))]


def test_prefill_aborted_frees_now():
    p = side("prefill-0")
    r = Req("x", {"do_remote_decode": True}, status=Status("FINISHED_ABORTED"))
    p.on_new_request(r)
    assert p.request_finished(r, (4, 5, 6)) == (False, None)
    assert p.build_step([]).meta.grants == ()


def test_dumps_hold_blocks_except_under_a_lease(tmp_path):
    d = side(kvplane_kv_dump_dir=str(tmp_path))
    local = Req("l", {DUMP_KEY: "t.local"})
    assert d.request_finished(local, (1, 2)) == (True, None)  # held until dumped
    p = side("prefill-0", kvplane_kv_dump_dir=str(tmp_path))
    r = Req("x", {"do_remote_decode": True, DUMP_KEY: "t.p"})
    p.on_new_request(r)
    delay, _ = p.request_finished(r, (4, 5))
    dumps = p.build_step([]).dumps
    assert delay is True and [(x.tag, x.holds_blocks) for x in dumps] == [("t.p", False)]
    assert [(x.tag, x.holds_blocks) for x in d.build_step([]).dumps] == [("t.local", True)]
    # No dump folder: the tag is ignored.
    plain = side()
    assert plain.request_finished(Req("l", {DUMP_KEY: "t"}), (1,)) == (False, None)


def test_only_the_facades_import_vllm():
    """vLLM is an optional extra: the core, the transport, the connector's
    halves and the job never import it; only what vLLM itself loads does."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    importing = sorted(str(p.relative_to(root)) for folder in ("statemachines", "transport", "connector", "app")
                       for p in (root / folder).rglob("*.py")
                       if re.search(r"^\s*(from|import) vllm\b", p.read_text(), re.M))
    assert importing == ["app/vllm/nixl_dump.py", "connector/vllm.py"]
