"""The main job's data-path figures: per-transfer stats, the bare-READ size
sample, the summary's ``data_path`` and the bench's targets table (no NIXL,
no timing: the figures are computed from given samples)."""

import attrs
import pytest

from bench.datapath import GOAL, TARGET, tables
from kvplane.app.job.bare_read import size_sample
from kvplane.app.job.report import data_path
from kvplane.app.job.transfer_stats import TransferStats, nearest_rank
from kvplane.transport.transfer_times import TransferSample, TransferTimes


def sample(nbytes, ms, op="READ"):
    return TransferSample(op, nbytes, 1, ms / 1e3)


def test_stats_are_byte_weighted_with_nearest_rank_percentiles():
    xs = [sample(1_000_000, 1.0)] * 98 + [sample(4_000_000, 10.0), sample(1_000_000, 50.0)]
    st = TransferStats.of(xs)
    assert st.transfers == 100 and st.nbytes == 103_000_000
    assert st.p50_ms == pytest.approx(1.0) and st.p99_ms == pytest.approx(10.0)
    # bytes over summed seconds, not the mean of per-transfer rates
    assert st.gbps == pytest.approx(103_000_000 / (0.098 + 0.010 + 0.050) / 1e9)
    assert TransferStats.of([]) is None
    assert nearest_rank([3.0], 0.99) == 3.0
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)


def test_transfer_times_are_bounded():
    tt = TransferTimes(limit=2)
    for i in range(5):
        tt.note("READ", i, 1, 0.001)
    assert [s.nbytes for s in tt.samples] == [0, 1] and tt.not_kept == 3


def test_size_sample_spreads_over_the_sizes():
    assert size_sample([5, 1, 3], 10) == [1, 3, 5]
    got = size_sample(list(range(100)), 5)
    assert got[0] == 0 and got[-1] == 99 and len(got) == 5 and got == sorted(got)
    assert size_sample(list(range(10)), 1) == [5]


@attrs.define
class Side:
    transfers: list
    bare_reads: list = attrs.Factory(list)
    bare_read_error: str | None = None


def test_data_path_compares_all_reads_with_the_bare_read():
    P = Side([sample(2_000_000, 2.0), sample(1_000, 1.0, op="WRITE")])
    D = Side([sample(2_000_000, 2.0)], bare_reads=[sample(2_000_000, 1.0)])
    dp = data_path(P, D)
    assert dp["reads"]["transfers"] == 2 and dp["writes"]["transfers"] == 1
    assert dp["read_gbps_vs_bare"] == pytest.approx(0.5)
    assert data_path(P, None)["bare_nixl_read"] is None and data_path(P, None)["read_gbps_vs_bare"] is None


def _summary(dp):
    return {"data_path": dp, "ok": True, "requests": {"total": 48}, "wall_s": 9.0}


@pytest.mark.parametrize("ratio, met", [(0.75, "YES"), (GOAL, "YES"), (0.2, "NO")])
def test_targets_table_says_yes_or_no(ratio, met):
    reads = {"transfers": 40, "bytes": 1 << 26, "seconds": 0.1, "p50_ms": 1.0, "p99_ms": 5.0, "gbps": 2.0 * ratio}
    bare = {**reads, "gbps": 2.0}
    detail, targets = tables(_summary({"reads": reads, "writes": None, "bare_nixl_read": bare,
                                       "read_gbps_vs_bare": ratio}))
    assert targets.title.startswith("targets:")
    assert targets.columns == ["target", "measured", "goal", "met"]
    assert targets.rows == [[TARGET, f"{ratio:.0%} ({2.0 * ratio:.2f} / 2.00 GB/s)", ">= 50%", met]]
    assert [row[0] for row in detail.rows][0].startswith("job READs") and len(detail.rows) == 2


def test_targets_table_without_a_figure_is_not_met():
    _detail, targets = tables(_summary({"reads": None, "writes": None, "bare_nixl_read": None,
                                        "read_gbps_vs_bare": None, "bare_read_error": "TimeoutError: x"}))
    assert targets.rows[0][3] == "NO"
