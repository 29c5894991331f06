"""The bench runner's target summary: every section's "targets:" rows, gathered once."""
import pytest

from bench.report import Table, add_target, collect_targets, targets_table, to_markdown


def test_target_rows_of_every_section_are_gathered_in_order():
    a = targets_table("a.targets", "section a")
    add_target(a, "1. fast", "80 µs", "<= 100 µs", True, us=80)
    b = targets_table("b.targets", "section b")
    add_target(b, "2. slow", "0.5x", ">= 0.67x", False)
    other = Table("a.events", "not a target table", ["x", "y"], rows=[[1, 2]])
    summary = collect_targets([a, other, b])
    assert summary is not None and summary.title == "Targets"
    assert summary.rows == [["1. fast", "80 µs", "<= 100 µs", "YES"], ["2. slow", "0.5x", ">= 0.67x", "NO"]]
    assert [d["source"] for d in summary.data] == ["a.targets", "b.targets"]
    assert summary.notes == ["1 of 2 targets met."]
    assert "| 1. fast | 80 µs | <= 100 µs | YES |" in to_markdown([summary], {})


def test_no_target_table_no_summary():
    assert collect_targets([Table("a", "plain", ["x"])]) is None


@pytest.mark.parametrize("columns,row", [
    (["target", "measured", "goal"], ["t", "1", "2"]),
    (["target", "measured", "goal", "met"], ["t", "1", "2", "yes"]),
])
def test_a_malformed_target_table_is_refused(columns, row):
    bad = Table("bad.targets", "targets: bad", columns, rows=[row])
    with pytest.raises(ValueError, match="bad.targets"):
        collect_targets([bad])
