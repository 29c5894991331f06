"""Two real NIXL agents (no progress thread) in one process, DRAM on CPU."""

import itertools
import time

import pytest
import torch

from kvplane.transport.errors import MetadataRejected, NotFound, TransferFailed, TransportError
from kvplane.transport.layout import CacheLayout
from kvplane.transport.nixl_agent import NixlEndpoint, translate_nixl_error
from transfer_tracker import TransferTracker
from kvplane.transport.wire import (
    CorruptMetadata,
    TruncatedMetadata,
    decode_notif,
    encode_completion,
    frame_metadata,
    unframe_metadata,
)

from transfer_support import complete, wait_for

NB, BS = 8, 4096
_names = itertools.count()


@pytest.fixture
def pair():
    """(reader D, its cache, source P, its cache), metadata exchanged both ways."""
    n = next(_names)
    d, p = NixlEndpoint(f"D{n}"), NixlEndpoint(f"P{n}")
    d_cache = torch.zeros(NB, BS, dtype=torch.uint8)
    p_cache = torch.randint(0, 256, (NB, BS), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    d.register_kv_cache(d_cache, BS)
    p.register_kv_cache(p_cache, BS)
    # Through the wire framing, as in production.
    assert d.add_remote(unframe_metadata(frame_metadata(p.local_metadata()))) == p.name
    assert p.add_remote(d.local_metadata()) == d.name
    try:
        yield d, d_cache, p, p_cache
    finally:
        d.close()
        p.close()


def drain_until(ep, pred, timeout=2.0, also=()):
    """Collect ep's notifs until one satisfies pred.

    Without a progress thread the *sender* must poll as well until the UCX
    connection is wired up (measured: a first notif never arrives otherwise),
    so peers in ``also`` are pumped alongside.
    """
    got = []

    def step():
        for other in also:
            other.poll_notifs()
        got.extend(ep.poll_notifs())
        return any(pred(x) for x in got)

    wait_for(step, timeout)
    return got


def test_read_copies_exact_blocks_and_notifies_passive_side(pair):
    d, d_cache, p, p_cache = pair
    before = d_cache.clone()
    notif = encode_completion("req-1", 2)
    h = d.post_read(p.name, p.describe_cache(), [5, 1, 6], [0, 3, 7], notif)
    got = complete(d, h, p, notif)
    d.release(h)
    assert torch.equal(d_cache[[0, 3, 7]], p_cache[[5, 1, 6]])
    untouched = [1, 2, 4, 5, 6]
    assert torch.equal(d_cache[untouched], before[untouched])
    assert decode_notif(got[-1][1]).expected_consumers == 2


def test_write_pushes_blocks(pair):
    d, d_cache, p, p_cache = pair
    d_cache.fill_(0xAB)
    h = d.post_write(p.name, p.describe_cache(), [2], [4], b"w:1")
    complete(d, h, p, b"w:1")
    d.release(h)
    assert bool((p_cache[2] == 0xAB).all()) and not bool((p_cache[3] == 0xAB).all())


def test_notifs_arriving_before_a_post_are_not_lost(pair):
    # _post progresses UCX, which drains notifications; they must be kept.
    d, _, p, _ = pair
    h = d.post_read(p.name, p.describe_cache(), [0], [0], b"warm:1")
    complete(d, h, p, b"warm:1")  # connection wired up both ways
    d.release(h)
    p.send_notif(d.name, b"HB:early")
    for _ in range(20):  # P pushes it out; D does not poll notifs
        p.poll_notifs()
        time.sleep(0.001)
    h = d.post_read(p.name, p.describe_cache(), [1], [1], b"r:1")
    complete(d, h, p, b"r:1")
    d.release(h)
    assert (p.name, b"HB:early") in drain_until(d, lambda x: x[1] == b"HB:early", timeout=0.5)


def test_standalone_notifs_both_directions(pair):
    d, _, p, _ = pair
    d.send_notif(p.name, b"HB:a,b")
    assert (d.name, b"HB:a,b") in drain_until(p, lambda x: x[1] == b"HB:a,b", also=[d])
    p.send_notif(d.name, b"r:1")
    assert (p.name, b"r:1") in drain_until(d, lambda x: x[1] == b"r:1", also=[p])


def test_multi_region_cache_moves_block_in_every_region():
    d, p = NixlEndpoint("Dm"), NixlEndpoint("Pm")
    try:
        d_layers = [torch.zeros(4, 256, dtype=torch.float16) for _ in range(3)]
        p_layers = [torch.full((4, 256), float(i + 1), dtype=torch.float16) for i in range(3)]
        for t in d_layers:
            d.register_kv_cache(t, 512)
        for i, t in enumerate(p_layers):
            t[2] = -(i + 1)
            p.register_kv_cache(t, 512)
        assert len(p.describe_cache()["base_addrs"]) == 3
        name = d.add_remote(p.local_metadata())
        h = d.post_read(name, p.describe_cache(), [2], [1])
        wait_for(lambda: (p.poll_notifs(), d.poll_transfer(h) == "DONE")[1])
        d.release(h)
        for i in range(3):
            assert bool((d_layers[i][1] == -(i + 1)).all())
            assert bool((d_layers[i][0] == 0).all())
    finally:
        d.close()
        p.close()


def test_tracker_completes_and_releases(pair):
    d, _, p, _ = pair
    tr = TransferTracker(d)
    h = d.post_read(p.name, p.describe_cache(), [0], [0])
    tr.track(h, deadline=100.0, tag="req-9")
    res = None

    def step():
        nonlocal res
        p.poll_notifs()
        res = tr.poll(now=0.0)
        return res.completed

    wait_for(step)
    assert [t.tag for t in res.completed] == ["req-9"] and h.released and len(tr) == 0


def test_bad_block_ids_and_layouts_rejected_before_nixl(pair):
    d, _, p, _ = pair
    desc = p.describe_cache()
    with pytest.raises(IndexError, match="remote block id 8"):
        d.post_read(p.name, desc, [8], [0])
    with pytest.raises(ValueError, match="2 remote blocks vs 1 local"):
        d.post_read(p.name, desc, [0, 1], [0])
    with pytest.raises(ValueError, match="block size mismatch"):
        d.post_read(p.name, {**desc, "block_size": BS * 2, "num_blocks": NB // 2}, [0], [0])
    with pytest.raises(ValueError, match="lacks field"):
        d.post_read(p.name, {"v": 1}, [0], [0])
    with pytest.raises(NotFound, match="unknown remote"):
        d.post_read("nobody", desc, [0], [0])


def test_unregistered_remote_memory_is_a_typed_error(pair):
    d, _, p, _ = pair
    bogus = CacheLayout("DRAM", 0, BS, NB, (0x1000,)).to_dict()
    with pytest.raises(TransportError) as ei:
        d.post_read(p.name, bogus, [0], [0])
    assert ei.value.nixl_error and ei.value.nixl_error.startswith("nixl")


def test_notif_to_unknown_agent_is_typed(pair):
    d, *_ = pair
    with pytest.raises(NotFound, match="unknown remote agent 'ghost'"):
        d.send_notif("ghost", b"x")
    # NIXL's own NotFound (agent bypassing our bookkeeping) maps the same way.
    with pytest.raises(Exception) as ei:
        d._agent.send_notif("ghost", b"x")
    assert type(translate_nixl_error(ei.value, "send")) is NotFound


def test_garbage_metadata_rejected_by_nixl_as_typed_error(pair):
    d, *_ = pair
    with pytest.raises(MetadataRejected, match="nixlMismatchError"):
        d.add_remote(b"\x00garbage")


def test_framed_metadata_must_be_unframed_first(pair):
    d, _, p, _ = pair
    with pytest.raises(ValueError, match="unframe"):
        d.add_remote(frame_metadata(p.local_metadata()))


def test_truncated_or_corrupt_metadata_never_reaches_nixl():
    src, dst = NixlEndpoint("Psrc"), NixlEndpoint("Ddst")
    try:
        framed = frame_metadata(src.local_metadata())
        with pytest.raises(TruncatedMetadata):
            unframe_metadata(framed[: len(framed) // 2])
        bad = bytearray(framed)
        bad[-10] ^= 0xFF
        with pytest.raises(CorruptMetadata):
            unframe_metadata(bytes(bad))
        # The agent was not poisoned: the intact blob still loads under that name.
        assert dst.add_remote(unframe_metadata(framed)) == "Psrc"
    finally:
        src.close()
        dst.close()


def test_register_validates_shape():
    ep = NixlEndpoint("Dreg")
    try:
        with pytest.raises(ValueError, match="contiguous"):
            ep.register_kv_cache(torch.zeros(4, 8).t(), 16)
        with pytest.raises(ValueError, match="tensor size"):
            ep.register_kv_cache(torch.zeros(4, 8, dtype=torch.uint8), 16)
        ep.register_kv_cache(torch.zeros(4, 8, dtype=torch.uint8), 8)
        with pytest.raises(ValueError, match="does not match"):
            ep.register_kv_cache(torch.zeros(5, 8, dtype=torch.uint8), 8)
    finally:
        ep.close()


def test_translate_maps_by_class_name():
    class nixlRemoteDisconnectError(Exception):
        pass

    class nixlBackendError(Exception):
        pass

    e = translate_nixl_error(nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"), "READ 3")
    assert type(e).__name__ == "PeerDisconnected" and "READ 3" in str(e) and "DISCONNECT" in str(e)
    assert isinstance(translate_nixl_error(nixlBackendError("x"), "op"), TransferFailed)


def test_an_agent_with_worker_threads_reads_the_same_bytes():
    """NixlConnector's ``num_threads`` reaches NIXL (its UCX backend starts that many
    threads) and the agent, still polled, moves the same bytes."""
    import os

    def threads() -> int:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))

    before = threads()
    d, p = NixlEndpoint("Dthreads", num_threads=2), NixlEndpoint("Pthreads", backends=["UCX"], num_threads=2)
    try:
        assert threads() >= before + 4  # two per agent, besides UCX's own
        d_cache, p_cache = torch.zeros(NB, BS, dtype=torch.uint8), torch.randint(0, 256, (NB, BS), dtype=torch.uint8)
        d.register_kv_cache(d_cache, BS)
        p.register_kv_cache(p_cache, BS)
        d.add_remote(p.local_metadata())
        p.add_remote(d.local_metadata())
        h = d.post_read(p.name, p.describe_cache(), [4, 2], [0, 1], b"t:1")
        complete(d, h, p, b"t:1")
        d.release(h)
        assert torch.equal(d_cache[[0, 1]], p_cache[[4, 2]])
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("backend", ["NO_SUCH_BACKEND", "LIBFABRIC"])
def test_a_backend_that_cannot_start_here_is_refused_naming_what_is_installed(backend):
    if backend == "LIBFABRIC" and _starts("LIBFABRIC"):
        pytest.skip("this machine has a libfabric provider")
    with pytest.raises(NotFound) as info:
        NixlEndpoint(f"D{backend}", backends=["UCX", backend])
    assert backend in str(info.value) and "plugins installed" in str(info.value) and "UCX" in str(info.value)


def _starts(backend: str) -> bool:
    try:
        NixlEndpoint(f"probe{backend}", backends=[backend]).close()
    except NotFound:
        return False
    return True
