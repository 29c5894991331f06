"""LoopbackFabric: same surface as NixlEndpoint, deterministic fault injection."""

import pytest
import torch

from kvplane.transport.errors import MetadataRejected, NotFound, PeerDisconnected, TransferFailed
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric
from transfer_tracker import TransferTracker
from kvplane.transport.wire import decode_notif, encode_completion, encode_heartbeat

NB, BS = 6, 64


@pytest.fixture
def net():
    fab = LoopbackFabric()
    d, p = LoopbackEndpoint(fab, "D"), LoopbackEndpoint(fab, "P")
    d_cache = torch.zeros(NB, BS, dtype=torch.uint8)
    p_cache = torch.arange(NB * BS, dtype=torch.int32).remainder(251).to(torch.uint8).reshape(NB, BS)
    d.register_kv_cache(d_cache, BS)
    p.register_kv_cache(p_cache, BS)
    assert d.add_remote(p.local_metadata()) == "P"
    assert p.add_remote(d.local_metadata()) == "D"
    return fab, d, d_cache, p, p_cache


def run(ep, h, max_polls=10):
    for _ in range(max_polls):
        if ep.poll_transfer(h) == "DONE":
            return
    raise AssertionError("transfer did not complete")


def test_read_copies_on_completion_and_notifies(net):
    fab, d, d_cache, p, p_cache = net
    h = d.post_read("P", p.describe_cache(), [4, 2], [0, 5], encode_completion("r1", 1))
    assert not d_cache.any()  # nothing moves before completion
    run(d, h)
    assert torch.equal(d_cache[[0, 5]], p_cache[[4, 2]]) and not d_cache[1:5].any()
    assert p.poll_notifs() == [("D", b"r1:1")]
    assert p.poll_notifs() == []


def test_write_and_dtype_agnostic_regions():
    fab = LoopbackFabric(transfer_polls=3)
    a, b = LoopbackEndpoint(fab, "A"), LoopbackEndpoint(fab, "B")
    ta, tb = torch.randn(4, 8), torch.zeros(4, 8)
    a.register_kv_cache(ta, 32)
    b.register_kv_cache(tb, 32)
    a.add_remote(b.local_metadata())
    h = a.post_write("B", b.describe_cache(), [3], [1])
    assert [a.poll_transfer(h) for _ in range(3)] == ["PROC", "PROC", "DONE"]
    assert torch.equal(tb[3], ta[1]) and not tb[:3].any()


def test_drop_duplicate_delay(net):
    fab, d, _, p, _ = net
    fab.drop_notifs(receiver="P", prefix=b"HB:")
    fab.duplicate_notifs(receiver="P", prefix=b"dup")
    fab.delay_notifs(receiver="P", prefix=b"late", polls=3)
    for m in (b"HB:a", b"late:1", b"dup:1", b"HB:b"):
        d.send_notif("P", m)
    assert p.poll_notifs() == [("D", b"dup:1"), ("D", b"dup:1"), ("D", b"HB:b")]  # only 1 HB dropped
    assert p.poll_notifs() == []
    assert p.poll_notifs() == [("D", b"late:1")]  # 3rd poll after sending


def test_reverse_order(net):
    fab, d, _, p, _ = net
    fab.reverse_notifs(receiver="P", count=3)
    d.send_notif("P", b"1")
    d.send_notif("P", b"2")
    assert p.poll_notifs() == []  # held until the 3rd
    d.send_notif("P", b"3")
    d.send_notif("P", b"4")
    assert [m for _, m in p.poll_notifs()] == [b"3", b"2", b"1", b"4"]


def test_fail_and_hang_transfers_with_tracker(net):
    fab, d, d_cache, p, _ = net
    fab.fail_transfers(remote="P", message="link flap")
    fab.hang_transfers(remote="P")
    tr = TransferTracker(d)
    h_fail = d.post_read("P", p.describe_cache(), [0], [0], b"a:1")
    h_hang = d.post_read("P", p.describe_cache(), [1], [1], b"b:1")
    h_ok = d.post_read("P", p.describe_cache(), [2], [2], b"c:1")
    tr.track(h_fail, 10.0, "a")
    tr.track(h_hang, 10.0, "b")
    tr.track(h_ok, 10.0, "c")
    r1 = tr.poll(now=1.0)
    assert [t.tag for t in r1.completed] == ["c"]
    assert [(t.tag, type(e)) for t, e in r1.failed] == [("a", TransferFailed)]
    assert "link flap" in str(r1.failed[0][1])
    assert r1.timed_out == [] and len(tr) == 1
    assert not tr.poll(now=9.99)
    r2 = tr.poll(now=10.0)
    assert [t.tag for t in r2.timed_out] == ["b"] and h_hang.released and h_fail.released
    assert not d_cache[:2].any()  # failed / hung transfers moved nothing
    assert p.poll_notifs() == [("D", b"c:1")]  # and sent no notification


def test_kill_peer(net):
    fab, d, _, p, _ = net
    h = d.post_read("P", p.describe_cache(), [0], [0])
    p.send_notif("D", b"before-death:1")
    fab.kill("P")
    with pytest.raises(PeerDisconnected):
        d.poll_transfer(h)
    with pytest.raises(PeerDisconnected):
        d.post_read("P", p.describe_cache(), [0], [0])
    with pytest.raises(PeerDisconnected):
        d.send_notif("P", b"x")
    with pytest.raises(PeerDisconnected):
        p.send_notif("D", b"zombie")  # the dead agent's own calls fail too
    assert d.poll_notifs() == []  # undelivered notifs from the dead peer are gone


def test_clock_skew(net):
    fab, *_ = net
    fab.set_clock_offset("P", 12.5)
    assert fab.clock("P", 100.0) == 112.5 and fab.clock("D", 100.0) == 100.0
    assert fab.clock_offset("P") == 12.5


def test_metadata_and_peer_errors(net):
    fab, d, _, p, _ = net
    with pytest.raises(MetadataRejected):
        d.add_remote(b"\x00garbage")
    e = LoopbackEndpoint(fab, "E")
    with pytest.raises(NotFound):
        e.send_notif("P", b"x")  # never added
    with pytest.raises(ValueError, match="already"):
        LoopbackEndpoint(fab, "D")
    with pytest.raises(IndexError):
        d.post_read("P", p.describe_cache(), [NB], [0])


def test_fault_rules_are_deterministic():
    def scenario():
        fab = LoopbackFabric()
        a, b = LoopbackEndpoint(fab, "A"), LoopbackEndpoint(fab, "B")
        a.add_remote(b.local_metadata())
        fab.drop_notifs(count=2, prefix=b"x")
        fab.delay_notifs(polls=2, prefix=b"y")
        fab.duplicate_notifs(prefix=b"z", copies=3)
        out = []
        for i in range(6):
            a.send_notif("B", [b"x", b"y", b"z"][i % 3] + str(i).encode())
            out.append(b.poll_notifs())
        return out, fab.delivered

    assert scenario() == scenario()


def test_codec_over_loopback(net):
    _, d, _, p, _ = net
    d.send_notif("P", encode_heartbeat(["r1", "r2"]))
    (sender, msg), = p.poll_notifs()
    assert decode_notif(msg).request_ids == ("r1", "r2")
