"""The TP mapping rule and the per-rank aggregation (pure)."""
import pytest
from hypothesis import given, strategies as st

from kvplane.statemachines.rank_results import BAD_RANK, DUPLICATE, UNKNOWN_REQUEST, RankResults
from kvplane.statemachines.tp_mapping import WHOLE, Part, Source, TpMapping, TpMismatch


def test_equal_tp_reads_the_same_rank_whole():
    m = TpMapping(2, 2)
    assert m.sources(1) == (Source(1),)
    assert m.consumers_per_holder_rank == 1


def test_holder_wider_reader_reads_several_ranks_into_parts():
    m = TpMapping(holder_tp=4, reader_tp=2)
    assert m.sources(1) == (Source(2, WHOLE, Part(0, 2)), Source(3, WHOLE, Part(1, 2)))
    assert m.readers_of(3) == (1,)
    assert m.consumers_per_holder_rank == 1


def test_reader_wider_reads_a_part_of_one_rank():
    m = TpMapping(holder_tp=1, reader_tp=2)
    assert m.sources(0) == (Source(0, Part(0, 2), WHOLE),)
    assert m.sources(1) == (Source(0, Part(1, 2), WHOLE),)
    assert m.readers_of(0) == (0, 1)
    assert m.consumers_per_holder_rank == 2


@pytest.mark.parametrize("h,r", [(3, 2), (0, 1), (1, 0), (2, 2000)])
def test_unmappable_sizes_are_refused(h, r):
    with pytest.raises(TpMismatch):
        TpMapping(h, r)


def test_reader_rank_out_of_range_is_refused():
    with pytest.raises(TpMismatch):
        TpMapping(2, 2).sources(2)


@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_every_head_is_read_exactly_once(h, r):
    """Heads as fractions of the whole: each reader rank's reads cover its
    heads exactly, and over all readers every head of every holder rank."""
    m = TpMapping(h, r)
    total = h * r  # heads, in units that both TPs divide
    read = []
    for rank in range(r):
        local_cover = []
        for s in m.sources(rank):
            remote_lo = s.holder_rank * (total // h) + s.remote.index * (total // h // s.remote.of)
            width = total // h // s.remote.of
            local_lo = rank * (total // r) + s.local.index * (total // r // s.local.of)
            assert width == total // r // s.local.of  # the slices are the same size
            assert remote_lo == local_lo  # the same heads
            read.extend(range(remote_lo, remote_lo + width))
            local_cover.extend(range(local_lo, local_lo + width))
        assert sorted(local_cover) == list(range(rank * (total // r), (rank + 1) * (total // r)))
    assert sorted(read) == list(range(total))
    for holder in range(h):
        assert len(m.readers_of(holder)) == m.consumers_per_holder_rank


def test_finished_only_when_every_rank_reported_once():
    agg = RankResults(3)
    agg.expect("a")
    assert agg.report(0, "a") is None
    assert agg.report(0, "a") is None  # duplicate: ignored, not counted twice
    assert agg.report(2, "a") is None
    assert agg.waiting_on("a") == (1,)
    out = agg.report(1, "a")
    assert out is not None and out.ok
    assert agg.ignored[DUPLICATE] == 1
    assert agg.report(1, "a") is None and agg.ignored[UNKNOWN_REQUEST] == 1
    assert agg.report(7, "a") is None and agg.ignored[BAD_RANK] == 1


def test_one_failed_rank_fails_the_request():
    agg = RankResults(2)
    agg.expect("a")
    agg.report(0, "a", ok=False)
    out = agg.report(1, "a")
    assert out is not None and not out.ok and out.failed_ranks == (0,)


def test_a_lost_rank_fails_what_waits_on_it():
    agg = RankResults(2)
    agg.expect("a")
    agg.expect("b")
    agg.report(1, "a")
    outs = agg.rank_lost(1)
    assert outs == []  # "a" had rank 1's report; "b" still waits on rank 0
    outs = agg.rank_lost(0)
    assert sorted(o.request_id for o in outs) == ["a", "b"] and not any(o.ok for o in outs)
    assert len(agg) == 0
