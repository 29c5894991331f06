"""PlaneConfig from a vLLM-style kv_transfer_config dict (issue 14, item 9)."""
from __future__ import annotations

import math

import pytest

from kvplane.statemachines.config import ConfigError, FromKvTransferConfig, PlaneConfig


def _vllm_style(**extra):
    return {"kv_connector": "KvplaneConnector", "kv_connector_module_path": "kvplane.connector", "kv_role": "kv_both",
            "kv_buffer_device": "cpu", "kv_connector_extra_config": extra}


def test_the_extra_config_sets_the_plane_and_vllms_own_keys_are_left_alone():
    got = PlaneConfig.from_kv_transfer_config(_vllm_style(kv_lease_duration=12, decoder_kv_blocks_ttl=60.0,
                                                          recv_timeout=45.5))
    assert isinstance(got, FromKvTransferConfig) and got.unknown_keys == ()
    cfg = got.config
    assert (cfg.kv_lease_duration, cfg.decoder_kv_blocks_ttl, cfg.recv_timeout) == (12, 60.0, 45.5)
    assert cfg.heartbeat_interval == 2 and cfg.lease_extension == 8
    assert cfg.transfer_timeout == PlaneConfig().transfer_timeout  # the rest keep their defaults


def test_no_extra_config_gives_the_defaults():
    assert PlaneConfig.from_kv_transfer_config({"kv_connector": "X"}).config == PlaneConfig()
    assert PlaneConfig.from_kv_transfer_config({"kv_connector_extra_config": None}).config == PlaneConfig()


def test_unknown_keys_are_returned_not_raised():
    got = PlaneConfig.from_kv_transfer_config(_vllm_style(kv_lease_duraton=12, backends=["UCX"]))
    assert got.unknown_keys == ("backends", "kv_lease_duraton")
    assert got.config == PlaneConfig()


def test_the_load_failure_policy_may_be_a_top_level_key_as_in_vllm():
    d = {**_vllm_style(), "kv_load_failure_policy": "fail"}
    assert PlaneConfig.from_kv_transfer_config(d).config.kv_load_failure_policy == "fail"
    d["kv_connector_extra_config"] = {"kv_load_failure_policy": "fail"}
    assert PlaneConfig.from_kv_transfer_config(d).config.kv_load_failure_policy == "fail"
    d["kv_connector_extra_config"] = {"kv_load_failure_policy": "recompute"}
    with pytest.raises(ConfigError) as exc:
        PlaneConfig.from_kv_transfer_config(d)
    assert exc.value.field == "kv_load_failure_policy"


@pytest.mark.parametrize("key, value", [
    ("kv_lease_duration", "30"), ("kv_lease_duration", math.nan), ("kv_lease_duration", math.inf),
    ("kv_lease_duration", True), ("kv_lease_duration", 2), ("recv_timeout", None), ("handshake_max_attempts", 2.5),
    ("kv_load_failure_policy", "retry"),
])
def test_a_bad_value_raises_config_error_naming_the_field(key, value):
    with pytest.raises(ConfigError) as exc:
        PlaneConfig.from_kv_transfer_config(_vllm_style(**{key: value}))
    assert exc.value.field == key


@pytest.mark.parametrize("d, field", [
    ([("kv_lease_duration", 30)], "kv_transfer_config"),
    ({"kv_connector_extra_config": "kv_lease_duration=30"}, "kv_connector_extra_config"),
])
def test_a_config_that_is_not_a_dict_raises_config_error(d, field):
    with pytest.raises(ConfigError) as exc:
        PlaneConfig.from_kv_transfer_config(d)
    assert exc.value.field == field
