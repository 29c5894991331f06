"""The Endpoint protocol and the fault-injecting wrapper."""
from __future__ import annotations

import inspect
import random

import pytest

from kvplane.transport.endpoint import Endpoint
from kvplane.transport.faults import DropNotifications
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

MEMBERS = [n for n, v in vars(Endpoint).items() if inspect.isfunction(v) and not n.startswith("_")]


def test_the_protocol_names_what_the_driver_calls():
    assert {"local_metadata", "describe_cache", "add_remote", "remove_remote", "post_read", "post_write",
            "poll_transfer", "release", "send_notif", "poll_notifs"} <= set(MEMBERS)


@pytest.mark.parametrize("cls_name", ["loopback", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_both_endpoints_provide_the_protocol(cls_name):
    if cls_name == "nixl":
        cls = pytest.importorskip("kvplane.transport.nixl_agent").NixlEndpoint
    else:
        cls = LoopbackEndpoint
    for name in MEMBERS:
        want = list(inspect.signature(getattr(Endpoint, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} vs Endpoint.{name}{want}"


def test_dropping_wrapper_loses_a_seeded_share_and_passes_the_rest_through():
    fab = LoopbackFabric()
    sender, receiver = LoopbackEndpoint(fab, "D"), LoopbackEndpoint(fab, "P")
    sender.add_remote(receiver.local_metadata())
    wrapped = DropNotifications(receiver, rate=0.5, seed=7)
    assert isinstance(wrapped, Endpoint) and isinstance(receiver, Endpoint)
    msgs = [f"r{i}:1".encode() for i in range(40)]
    for m in msgs:
        sender.send_notif("P", m)
    got = wrapped.poll_notifs()
    rng = random.Random(7)
    assert got == [("D", m) for m in msgs if not rng.random() < 0.5]
    assert wrapped.dropped == len(msgs) - len(got) > 0
    assert wrapped.local_metadata() == receiver.local_metadata() and wrapped.inner is receiver
    with pytest.raises(ValueError):
        DropNotifications(receiver, rate=1.5)
