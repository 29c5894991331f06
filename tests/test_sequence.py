"""``kvplane sequence``: two recorded event logs as one Mermaid sequence
diagram.  The model (arrows and notes) and the text are checked on a
recorded loopback run (tests/sequence_support.py), the CLI on files, the
explorer's counterexample diagram on a mutant, and ``kvplane run``'s sample
diagrams on a short real run."""
from __future__ import annotations

import json
import re

import attrs
import pytest

from kvplane.app import cli
from kvplane.app.sequence_diagrams import command as S
from kvplane.app.offline.checks import write_violation
from kvplane.app.sequence_diagrams.mermaid import MermaidSyntaxError, check, escape, render
from kvplane.app.sequence_diagrams.model import Arrow, Kind, Line, Note, Selection
from kvplane.statemachines.explorer import explore
from kvplane.statemachines.machine import compile_machine
from kvplane.statemachines.machines import MACHINES, lease

from sequence_support import ODD_ID, recorded_pull


def exact_offset(lines: list[str], offset: float, shift: float = 0.0) -> list[str]:
    """``lines`` with every handshake measuring ``offset`` exactly (remote -
    local) and every time moved by ``shift``: the loopback's hand-driven
    clock makes its handshake samples off by half a step."""
    out = []
    for text in lines:
        obj = json.loads(text)
        if "t" in obj:
            obj["t"] += shift
        if obj.get("event") == "HandshakeOk":
            obj["data"]["samples"] = [[offset, 0.001]]
        out.append(json.dumps(obj))
    return out


@pytest.fixture(scope="module")
def logs():
    raw = recorded_pull()
    return {"P": raw["P"], "D": exact_offset(raw["D"], 0.0)}


@pytest.fixture(scope="module")
def diagram(logs):
    return S.diagram(logs["P"], logs["D"])


def kinds(items, kind, request=None):
    return [i for i in items if i.kind is kind and (request is None or request in i.request_ids)]


def index(d, item) -> int:
    return list(d.items).index(item)


def test_participants_are_the_two_sides(diagram):
    assert [(p.id, p.side) for p in diagram.participants] == [("P", "P"), ("D", "D")]
    proxied = S.model.build({"P": diagram.logs[0], "D": diagram.logs[1]}, Selection(proxy=True))
    assert [p.id for p in proxied.participants] == ["proxy", "P", "D"]
    assert kinds(proxied.items, Kind.PARAMS) and all(a.src == "proxy" for a in kinds(proxied.items, Kind.REQUEST))


def test_grant_read_completion_free_in_order(diagram):
    items = diagram.items
    grant = kinds(items, Kind.GRANT, "r1")[0]
    read = kinds(items, Kind.READ, "d1")[0]
    done = kinds(items, Kind.READ_DONE, "d1")[0]
    notif = next(a for a in kinds(items, Kind.NOTIF) if a.text.startswith("notif r1:"))
    free = kinds(items, Kind.FREE, "r1")[0]
    assert index(diagram, grant) < index(diagram, read) < index(diagram, notif) < index(diagram, free)
    assert index(diagram, read) < index(diagram, done)
    assert (read.src, read.dst, read.line) == ("D", "P", Line.SEND)
    assert (done.src, done.dst, done.line) == ("P", "D", Line.REPLY)
    assert isinstance(free, Note) and free.over == ("P",) and "consumed" in free.text
    assert grant.t <= read.t <= free.t


def test_one_heartbeat_arrow_per_batch(diagram, logs):
    sent = [a for text in logs["D"] for name, a in json.loads(text).get("actions", []) if name == "SendHeartbeat"]
    arrows = kinds(diagram.items, Kind.HEARTBEAT)
    assert len(sent) >= 2 and len(arrows) == len(sent)
    for arrow, batch in zip(arrows, sent):
        assert isinstance(arrow, Arrow) and (arrow.src, arrow.dst) == ("D", "P")
        assert arrow.request_ids == tuple(batch["request_ids"]) and len(arrow.request_ids) == 2
        assert arrow.text.startswith("HB x2")
    # P's receipt of each batch is one note (the lease extension), after the arrow.
    receipts = kinds(diagram.items, Kind.EXTEND)
    assert len(receipts) == len(arrows)
    for arrow, note in zip(arrows, receipts):
        assert index(diagram, arrow) < index(diagram, note)
    assert any("extends" in n.text for n in receipts)


def test_d_clock_is_corrected_with_the_handshake_offset(logs, diagram):
    # D's clock 40 s ahead: its handshake with P measures P - D = -40.
    ahead = exact_offset(logs["D"], -40.0, shift=40.0)
    shifted = S.diagram(logs["P"], ahead)
    assert shifted.clock.shift == pytest.approx(-40.0)
    assert "P - D = -40.000000" in render(shifted)
    strip = [(type(i), i.kind, i.text.split(", clock offset")[0]) for i in diagram.items]
    assert [(type(i), i.kind, i.text.split(", clock offset")[0]) for i in shifted.items] == strip
    assert [round(i.t, 6) for i in shifted.items] == [round(i.t, 6) for i in diagram.items]
    # Without an offset the 40 s stay: every D item comes after P's, out of order.
    unknown = [t for t in ahead if '"HandshakeOk"' not in t]
    raw = S.diagram(logs["P"], unknown)
    assert raw.clock.shift is None and "no clock offset known" in render(raw)
    first_d = next(n for n, i in enumerate(raw.items) if i.side == "D")
    assert all(i.side == "D" for i in raw.items[first_d:])


def test_request_filter_keeps_a_request_and_its_peer(logs, diagram):
    for rid in ("d1", "r1"):
        d = S.diagram(logs["P"], logs["D"], Selection(request_ids=(rid,)))
        ids = {x for i in d.items for x in i.request_ids}
        assert kinds(d.items, Kind.GRANT, "r1") and kinds(d.items, Kind.READ, "d1") and kinds(d.items, Kind.FREE, "r1")
        assert not kinds(d.items, Kind.READ, "d2") and not kinds(d.items, Kind.GRANT, ODD_ID) and "d2" not in ids
        # Engine-wide items (the handshake) stay; heartbeat batches carrying r1 stay.
        assert kinds(d.items, Kind.HANDSHAKE) and kinds(d.items, Kind.HEARTBEAT)
        assert all(a.text.endswith("(incl. r1)") for a in kinds(d.items, Kind.HEARTBEAT))
        assert len(d.items) < len(diagram.items)


def test_time_window(logs, diagram):
    d = S.diagram(logs["P"], logs["D"], Selection(start=1.0, end=2.5))
    assert d.items and all(1.0 <= i.t <= 2.5 for i in d.items)
    assert not kinds(d.items, Kind.GRANT) and not kinds(d.items, Kind.READ)


def test_cap_says_how_many_were_left_out(logs, diagram):
    d = S.diagram(logs["P"], logs["D"], Selection(max_events=5))
    assert len(d.items) == 5 and d.left_out == len(diagram.items) - 5
    text = render(d)
    assert f"{d.left_out} event(s) left out" in text and f"... {d.left_out} more event(s) left out" in text
    check(text)


def test_rendered_text_passes_the_strict_check_and_escapes_ids(diagram):
    text = render(diagram)
    assert check(text) == len(diagram.participants) + len(diagram.items)
    assert ODD_ID not in text and escape(ODD_ID) in text
    for line in text.splitlines()[1:]:
        label = line.lstrip().removeprefix("%%").split(": ", 1)[-1]
        assert not set(re.sub(r"#[0-9]+;", "", label)) & set(';#"%<>'), line


@pytest.mark.parametrize("line, why", [
    ("    D->>P: a;b", "unescaped"),
    ("    D->>P: issue #3", "unescaped"),
    ('    Note over P: say "hi', "unescaped"),
    ("    D->>Q: to nobody", "before it is declared"),
    ("    participant P as again", "declared twice"),
    ("  D->>P: two spaces", "four spaces"),
    ("    loop every second", "unescaped"),
])
def test_check_rejects_a_broken_line(diagram, line, why):
    good = render(diagram).splitlines()
    with pytest.raises(MermaidSyntaxError, match=why) as info:
        check("\n".join(good + [line]) + "\n")
    assert info.value.line == len(good) + 1
    with pytest.raises(MermaidSyntaxError):
        check("graph TD\n")


def test_cli_writes_a_file_or_stdout(logs, tmp_path, capsys, monkeypatch):
    p, d = tmp_path / "P.jsonl", tmp_path / "D.jsonl"
    p.write_text("\n".join(logs["P"]) + "\n")
    # A killed writer's torn last line is left out, and said so.
    d.write_text("\n".join(logs["D"]) + "\n" + logs["D"][-1][:25])
    monkeypatch.setenv("PATH", str(tmp_path))  # no mmdc
    out = tmp_path / "seq.mmd"
    assert cli.main(["sequence", str(p), str(d), "-o", str(out), "--request", "d1"]) == 0
    err = capsys.readouterr().err
    assert "mmdc" in err and "wrote Mermaid only" in err and str(out) in err
    text = out.read_text()
    check(text)
    assert "torn last line" in text and "requests: d1" in text
    assert cli.main(["sequence", str(p), str(d), "--max-events", "3"]) == 0
    cap = capsys.readouterr()
    check(cap.out)
    assert "left out past --max-events 3" in cap.err
    assert cli.main(["sequence", str(p), str(d), "--request", "nobody"]) == 2
    assert "appear in neither log" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n" + "\n".join(logs["D"]) + "\n")
    assert cli.main(["sequence", str(p), str(bad)]) == 2
    assert "line 1" in capsys.readouterr().err


def test_counterexample_is_written_as_a_sequence_diagram(tmp_path):
    # The lease mutant of test_explorer: a lease with no deadline is never reclaimed.
    states = tuple(attrs.evolve(s, deadline=None) if s.name in lease.HELD else s for s in lease.STATES)
    machines = {**MACHINES, "lease": compile_machine(attrs.evolve(lease.SPEC, states=states), check=False)}
    r = explore(machines=machines, requests=("read",), max_faults=0, max_depth=6)
    v = r.violations[0]
    paths = write_violation(v, str(tmp_path / "cex"))
    assert len(paths) == 2  # the replayable logs; the diagram beside them
    text = (tmp_path / "cex.mmd").read_text()
    check(text)
    assert "lease p0 granted" in text and escape("still holds") in text
    assert "Note over P" in text and "D->>P" in text


@pytest.mark.e2e
def test_run_writes_sample_diagrams_that_parse(tmp_path):
    """A short real run (two processes, NIXL): sequence.mmd for the first
    requests, and ``kvplane sequence`` on its logs prints a diagram that parses."""
    from kvplane.app.job.options import RunOptions
    from kvplane.app.job.orchestrator import nixl_installed, run_job

    if not nixl_installed():
        pytest.skip("NIXL is not installed (kvplane run needs it)")
    summary = run_job(RunOptions(out=str(tmp_path), quiet=True, requests=3, overload=1.5, hold_ttl=3.0,
                                 timeout=300.0, startup_timeout=600.0))
    written = summary["sequence_diagrams"]
    assert str(tmp_path / "sequence.mmd") in written
    text = (tmp_path / "sequence.mmd").read_text()
    check(text)
    assert "participant proxy" in text and "READ d-req0000" in text and "HB x" in text
    d = S.diagram(summary["logs"]["P"], summary["logs"]["D"])
    check(render(d))
    assert d.clock.shift is not None and kinds(d.items, Kind.READ) and kinds(d.items, Kind.FREE)


def _two_ranks(lines: list[str]) -> list[str]:
    """D's log as if P ran two TP ranks: requests and heartbeats address both."""
    out = []
    for text in lines:
        obj = json.loads(text)
        if obj.get("event") == "NewRequest":
            obj["data"]["remote_ranks"] = [0, 1]
        for name, a in obj.get("actions", []):
            if name in ("SendHeartbeat", "StartHeartbeat"):
                a["ranks"] = [0, 1]
        out.append(json.dumps(obj))
    return out


def test_a_participant_per_rank_when_the_log_shows_several(logs, diagram):
    d = S.diagram(logs["P"], _two_ranks(logs["D"]))
    assert [p.id for p in d.participants] == ["P_r0", "P_r1", "D"]
    hb = kinds(d.items, Kind.HEARTBEAT)
    assert len(hb) == 2 * len(kinds(diagram.items, Kind.HEARTBEAT))
    assert {a.dst for a in hb} == {"P_r0", "P_r1"}
    assert {a.dst for a in kinds(d.items, Kind.READ, "d1")} == {"P_r0", "P_r1"}
    assert all(n.over == ("P_r0", "P_r1") for n in kinds(d.items, Kind.GRANT))
    check(render(d))


def test_every_sequence_option_has_help():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "cmd").choices["sequence"]
    assert all(a.help for a in sub._actions), [a.dest for a in sub._actions if not a.help]
