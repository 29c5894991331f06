"""MLA at TP > 1: replicated KV (every rank holds the whole latent) read
whole from one holder rank per reader rank; holder ranks nobody reads
lease nothing.  The mapping (pure) and the split connector over loopback."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from loopback_support import Clock, run
from split_support import SplitEngine, block_value, engine_pairs

from kvplane.connector.records import LeaseGrant
from kvplane.statemachines.tp_mapping import Source, TpMapping, TpMismatch

CFG = dict(kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0)


# ---------------------------------------------------------------- the mapping
@pytest.mark.parametrize("holder,reader,sources,unread", [
    (1, 2, [0, 0], ()),
    (2, 1, [0], (1,)),
    (2, 2, [0, 1], ()),
    (4, 2, [0, 2], (1, 3)),
    (2, 4, [0, 0, 1, 1], ()),
])
def test_each_reader_rank_reads_one_holder_rank_whole(holder, reader, sources, unread):
    m = TpMapping(holder, reader, replicated=True)
    assert [m.sources(r) for r in range(reader)] == [(Source(h),) for h in sources]  # whole blocks, no parts
    assert m.unread_holder_ranks == unread
    assert TpMapping(holder, reader).unread_holder_ranks == ()  # split heads: every holder rank is read


@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_every_read_holder_rank_expects_exactly_its_readers(holder, reader):
    m = TpMapping(holder, reader, replicated=True)
    for h in range(holder):
        readers = m.readers_of(h)
        assert (len(readers) == 0) == (h in m.unread_holder_ranks)
        assert not readers or len(readers) == m.consumers_per_holder_rank
    # Every reader rank has exactly one source, whole.
    assert all(len(m.sources(r)) == 1 and m.sources(r)[0].remote.whole and m.sources(r)[0].local.whole
               for r in range(reader))


def test_replicated_sizes_that_do_not_divide_are_refused():
    with pytest.raises(TpMismatch):
        TpMapping(3, 2, replicated=True)


def test_a_grant_names_its_unread_ranks():
    assert LeaseGrant(request_id="r", name="n", block_ids=(1,)).unread_ranks == ()
    assert LeaseGrant(request_id="r", name="n", block_ids=(1,), unread_ranks=[1, 3]).unread_ranks == (1, 3)


# ---------------------------------------------------------------- split connector over loopback
@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def engines(clock):
    with engine_pairs(clock, replicated=True, **CFG) as make:
        yield make


def pull(p: SplitEngine, d: SplitEngine, blocks=(1, 2, 3), local=(5, 6, 7)):
    p.fill(7, blocks, per_rank_tags=True)  # P rank h's copy is tagged 7 + h: D shows which rank it read
    p.sched.on_new_request("r1", {"do_remote_decode": True})
    delay, params = p.sched.request_finished("r1", blocks, reader_tp=d.tp)
    assert delay and params["tp_size"] == p.tp
    d.sched.on_new_request("d1", params)
    n, _ = d.sched.get_num_new_matched_tokens("d1", 16 * len(blocks), 0)
    d.sched.update_state_after_alloc("d1", local, n)
    return params


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 2), (4, 2)])
def test_each_decode_rank_reads_whole_blocks_of_its_one_prefill_rank(engines, clock, p_tp, d_tp):
    _, p, d = engines(p_tp, d_tp)
    mapping = TpMapping(p_tp, d_tp, replicated=True)
    params = pull(p, d)
    assert params["expected_consumers"] == mapping.consumers_per_holder_rank
    assert run(clock, (d, p), 5, until=lambda: "d1" in d.recving and "r1" in p.sending)
    for r in range(d_tp):
        (src,) = mapping.sources(r)
        for b, dst in zip((1, 2, 3), (5, 6, 7)):
            assert torch.equal(d.kv[r][dst], block_value(7 + src.holder_rank, b)), f"D rank {r} block {dst}"
    for h, w in enumerate(p.workers):
        if h in mapping.unread_holder_ranks:  # no lease at all: nothing to expire, nothing freed by a read
            assert w.counters["grants_unread_rank"] == 1
            assert w.driver.counters["blocks_freed_consumed"] == 0
            assert w.driver.counters["blocks_freed_expired"] == 0
        else:  # consumed by exactly its planned readers
            assert w.counters["grants_unread_rank"] == 0
            assert w.driver.counters["blocks_freed_consumed"] == 3, w.driver.engine_id
    assert p.held() == [] and d.held() == []
    assert d.failed == set()


def test_unread_prefill_ranks_report_at_the_grant_while_the_read_rank_still_holds(engines, clock):
    fabric, p, d = engines(2, 1)
    fabric.drop_notifs(receiver="P/tp0", prefix=b"r1-")  # D's completion to the rank it read is lost
    pull(p, d)
    p.step()
    # Rank 1 (unread) reported at its first step; rank 0 holds its lease for D's read.
    assert p.sched.waiting_on("r1") == (0,)
    assert run(clock, (d, p), 2, until=lambda: "d1" in d.recving)
    assert torch.equal(d.kv[0][5], block_value(7, 1))
    assert "r1" not in p.sending and p.workers[0].driver.plane.held() != []
    # Only the read rank's lease runs to its expiry (its completion was lost).
    assert run(clock, (d, p), 30, until=lambda: "r1" in p.sending)
    assert p.workers[0].driver.counters["blocks_freed_expired"] == 3
    assert p.workers[1].driver.counters["blocks_freed_expired"] == 0
    assert p.held() == [] and d.held() == []


def test_the_kv_check_compares_each_decode_rank_with_its_one_prefill_rank():
    from kvplane.app.vllm.kv_check import holder_view

    p_dumps = [{"kv": torch.full((2, 1, 32, 576), float(h))} for h in range(4)]
    for p_tp, d_tp in ((1, 2), (2, 1), (2, 2), (4, 2)):
        mapping = TpMapping(p_tp, d_tp, replicated=True)
        for r in range(d_tp):
            view = holder_view(p_dumps[:p_tp], p_tp, d_tp, r, replicated=True)
            assert view is p_dumps[mapping.sources(r)[0].holder_rank]  # whole: no head slicing


def test_an_unread_prefill_rank_s_empty_event_log_passes_only_as_unread(tmp_path):
    from kvplane.app.vllm.run import _replay

    header = tmp_path / "prefill.rank1.events.jsonl"  # a log the plane opened, with no event: its header
    header.write_text('{"v":1,"config":{}}\n')
    assert _replay(header, unread=True)["ok"]
    assert not _replay(header)["ok"]  # any other rank's empty log is a failure
