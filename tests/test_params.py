"""kv_transfer_params at the proxy boundary: every wrong type, value or size
is a BadTransferParams naming the field, and what is accepted is what a
notification can carry."""
from __future__ import annotations

import math

import pytest

from kvplane.connector.params import MAX_RANKS, BadTransferParams, RemoteKV
from kvplane.transport import wire

GOOD = dict(remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5555, remote_request_id="p-r1",
            remote_block_ids=[3, 4], remote_ranks=[0, 1], expected_consumers=2, remote_expiry=1234.5,
            remote_renewable=True)


def test_round_trip_and_defaults():
    rk = RemoteKV.from_dict(GOOD)
    assert RemoteKV.from_dict(rk.to_dict()) == rk
    assert rk.side_channel == "tcp://127.0.0.1:5555"
    minimal = {k: GOOD[k] for k in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id",
                                    "remote_block_ids")}
    rk = RemoteKV.from_dict({**minimal, "do_remote_prefill": True, "push": True})  # vLLM's keys are ignored
    assert (rk.remote_ranks, rk.expected_consumers, rk.remote_expiry, rk.remote_renewable) == ((0,), 1, None, False)
    assert RemoteKV.from_dict({**GOOD, "remote_expiry": 7}).remote_expiry == 7.0
    assert RemoteKV.from_dict({**GOOD, "remote_expiry": None}).remote_expiry is None


_DROP = object()


@pytest.mark.parametrize("field, value, why", [
    ("remote_expiry", math.nan, "finite number"),
    ("remote_expiry", math.inf, "finite number"),
    ("remote_expiry", -math.inf, "finite number"),
    ("remote_expiry", 10**400, "out of range"),  # float() of it would overflow
    ("remote_expiry", "soon", "finite number"),
    ("remote_expiry", True, "finite number"),
    ("remote_ranks", None, "remote_ranks"),  # issue 9 item 10: was a bare TypeError
    ("remote_ranks", [], "remote_ranks"),
    ("remote_ranks", [0, "1"], "remote_ranks"),
    ("remote_ranks", [MAX_RANKS], "remote_ranks"),
    ("remote_ranks", [-1], "remote_ranks"),
    ("remote_ranks", 0, "remote_ranks"),
    ("expected_consumers", True, "expected_consumers"),
    ("expected_consumers", 0, "expected_consumers"),
    ("expected_consumers", wire.MAX_EXPECTED_CONSUMERS + 1, "expected_consumers"),
    ("expected_consumers", 2.0, "expected_consumers"),
    ("expected_consumers", None, "expected_consumers"),
    ("remote_renewable", 1, "remote_renewable"),
    ("remote_renewable", None, "remote_renewable"),
    ("remote_request_id", "a:b", "reserved character"),  # its completion "a:b:1" would be ambiguous
    ("remote_request_id", "HB", "reserved"),
    ("remote_request_id", "x" * (wire.MAX_ID_BYTES + 1), "longer than 256 bytes"),
    ("remote_request_id", None, "must be str"),
    ("remote_request_id", _DROP, "missing 'remote_request_id'"),
    ("remote_engine_id", {}, "must be str"),
    ("remote_engine_id", "", "must not be empty"),
    ("remote_host", "a host", "not a hostname"),
    ("remote_host", None, "host must be str"),
    ("remote_port", 0, "port must be an int in 1..65535"),
    ("remote_port", "5555", "port must be an int"),
    ("remote_port", True, "port must be an int"),
    ("remote_block_ids", None, "must be a list"),
    ("remote_block_ids", [1, -2], "block id -2"),
    ("remote_block_ids", [1.5], "block id 1.5"),
    ("remote_block_ids", [False], "block id False"),
    ("remote_block_ids", list(range(wire.MAX_BLOCK_IDS + 1)), "more than 131072"),
])
def test_every_wrong_field_is_a_bad_transfer_params_naming_it(field, value, why):
    d = dict(GOOD)
    if value is _DROP:
        del d[field]
    else:
        d[field] = value
    with pytest.raises(BadTransferParams) as ei:
        RemoteKV.from_dict(d)
    assert why in str(ei.value) and repr(field) in str(ei.value)


@pytest.mark.parametrize("d", [None, [], "params", 3])
def test_not_a_dict(d):
    with pytest.raises(BadTransferParams, match="must be a dict"):
        RemoteKV.from_dict(d)


def test_accepted_params_always_encode_their_completion():
    """What from_dict accepts, the driver can put on the wire: no later crash in encode_completion."""
    rk = RemoteKV.from_dict({**GOOD, "remote_request_id": "é" * 128, "expected_consumers": wire.MAX_EXPECTED_CONSUMERS})
    notif = wire.decode_notif(wire.encode_completion(rk.remote_request_id, rk.expected_consumers))
    assert notif == wire.CompletionNotif(rk.remote_request_id, rk.expected_consumers)


@pytest.mark.parametrize("change", [{"remote_expiry": math.nan}, {"remote_expiry": -math.inf},
                                    {"remote_ranks": None}, {"remote_request_id": "a:b"}])
def test_the_scheduler_refuses_bad_params_before_the_plane_sees_them(change):
    """Issue 9, item 3: a NaN expiry reached the READ gate; now the request is
    refused at on_new_request and nothing is created or held."""
    from kvplane.connector.connector import KVPlaneScheduler
    from kvplane.connector.driver import PlaneDriver
    from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

    driver = PlaneDriver(engine_id="D", endpoint=LoopbackEndpoint(LoopbackFabric(), "D"), clock=lambda: 0.0)
    try:
        sched = KVPlaneScheduler(driver)
        with pytest.raises(BadTransferParams):
            sched.on_new_request("d1", {**GOOD, **change, "do_remote_prefill": True})
        assert driver.plane.get("decode_request", "d1") is None and driver.plane.held() == []
        assert driver.directory == {}
        assert sched.get_num_new_matched_tokens("d1", 64, 0) == (0, False)
    finally:
        driver.close()
