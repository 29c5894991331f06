"""The committed diagrams are what the tables render, and they show what
a design review needs: guards, timers and terminal states."""
import re
import subprocess
import sys
from pathlib import Path

import attrs

from kvplane.app.offline import diagram_folders, diagrams
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.machines import SPECS
from kvplane.statemachines.render_machine import machine_texts, mermaid_safe
from kvplane.statemachines.spec import Transition

COMMITTED = Path(__file__).resolve().parent.parent / "diagrams"


def _mermaid(spec) -> str:
    """Every part of a machine's drawing, as one text."""
    return "".join(t.mermaid for t in machine_texts(spec).values())


def test_committed_mermaid_matches_tables():
    stale = diagrams.stale_files(svg=False)
    assert stale == [], f"run `kvplane diagrams`: stale {stale}"


def test_committed_svg_was_drawn_from_the_current_dot_source():
    """Compared by the DOT source each SVG is stamped with, not its bytes:
    another graphviz version draws the same source differently."""
    stale = [f for f in diagrams.stale_files(svg=True) if f.endswith(".svg")]
    assert stale == [], f"run `kvplane diagrams`: stale {stale}"


def test_every_transition_guard_timer_and_terminal_is_drawn():
    for name, spec in SPECS.items():
        text = _mermaid(spec)
        lines = [line.strip() for line in text.splitlines()]
        for state in spec.states:
            assert f"as {state.name}" in text
            if state.terminal:
                assert f"{state.name} --> [*]" in lines
            if state.deadline is not None:
                assert any(line.startswith(f"{state.name} : timer ") for line in lines), (name, state.name)
        for t in spec.table:
            if not isinstance(t, Transition):
                continue
            if t.src == t.dest:  # drawn inside the box, as an internal transition
                drawn = [line for line in lines if line.startswith(f"{t.src} : ↻ ")]
            else:
                drawn = [line for line in lines if line.startswith(f"{t.src} --> {t.dest} :")]
            assert drawn, f"{name}: no edge {t.src} -> {t.dest}"
            if t.guard_doc:
                assert any(f"[{mermaid_safe(t.guard_doc)}]" in line for line in drawn), (name, t.guard_doc)


def test_the_initial_state_is_not_drawn_in_an_error_colour():
    for spec in SPECS.values():
        text = _mermaid(spec)
        assert f"[*] --> {spec.initial}" in text
        assert f"class {spec.initial} initial" in text
        assert not re.search(r"classDef initial .*(red|salmon)", text)


def test_each_deadline_shows_its_configured_value():
    """The value comes from PlaneConfig, so a changed default shows."""
    cfg = PlaneConfig()
    expected = {
        "decode_request": {"recv_timeout": cfg.recv_timeout, "transfer_timeout": cfg.transfer_timeout,
                           "push_registration_timeout": cfg.push_registration_timeout},
        "lease": {"kv_lease_duration": cfg.kv_lease_duration, "lease_extension": cfg.lease_extension},
        "push_write": {"push_registration_timeout": cfg.push_registration_timeout,
                       "transfer_timeout": cfg.transfer_timeout},
        "remote_engine": {"handshake_timeout": cfg.handshake_timeout, "handshake_backoff": cfg.handshake_backoff,
                          "stale_after": cfg.stale_after},
    }
    for name, settings in expected.items():
        text = (COMMITTED / f"{name}.mmd").read_text()
        for setting, value in settings.items():
            assert f"{setting} {value:g} s" in text, (name, setting)
    lease = (COMMITTED / "lease.mmd").read_text()
    assert "max(old, now + lease_extension)" in lease  # a heartbeat's self-loop effect
    other = machine_texts(SPECS["decode_request"], PlaneConfig(recv_timeout=77.0))["decode_request"].mermaid
    assert "recv_timeout 77 s" in other and "timer 77 s" in other


def _svg_size(path: Path) -> tuple[float, float]:
    head = path.read_text()[:2000]
    m = re.search(r'<svg width="([0-9.]+)pt" height="([0-9.]+)pt"', head)
    assert m, path
    return float(m.group(1)), float(m.group(2))


def test_every_committed_svg_fits_a_screen():
    svgs = sorted(COMMITTED.glob("*.svg"))
    assert svgs
    for path in svgs:
        width, height = _svg_size(path)
        assert width <= 2 * height, f"{path.name}: {width:g} x {height:g} pt is wider than 2:1"


def test_mermaid_is_plain_state_diagram_text():
    for path in COMMITTED.glob("*.mmd"):
        text = path.read_text()
        if path.stem == "composition":
            continue
        assert "stateDiagram-v2" in text
        title = text.splitlines()[1]
        assert title.startswith("title: ") and ":" not in title[len("title: "):], title  # YAML front matter
        lines = text.splitlines()[4:]
        labels, in_note = [], False
        for line in lines:
            if line.strip().startswith(("note ", "end note")):
                in_note = line.strip().startswith("note ")
            elif in_note:
                labels.append(line)
        labels += [line.split(" : ", 1)[1] for line in lines if " : " in line]
        assert labels
        for label in labels:
            assert not set(";#{}<>:") & set(label), (path.name, label)


def test_check_detects_a_stale_file(tmp_path):
    diagrams.write_all(tmp_path, svg=False)
    assert diagrams.stale_files(tmp_path, svg=False) == []
    victim = tmp_path / "lease.mmd"
    victim.write_text(victim.read_text().replace("LeaseHeartbeat", "Heartbeat"))
    assert diagrams.stale_files(tmp_path, svg=False) == ["lease.mmd"]


def test_a_table_change_makes_the_committed_diagrams_stale():
    lease = SPECS["lease"]
    fewer = attrs.evolve(lease, table=lease.table[:-1])
    stale = diagrams.stale_files(COMMITTED, svg=True, specs={**SPECS, "lease": fewer})
    assert "lease.mmd" in stale and "lease.svg" in stale


def test_an_svg_without_its_stamp_is_stale(tmp_path):
    for path in COMMITTED.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    victim = tmp_path / "push_write.svg"
    victim.write_text(re.sub(r"<!-- kvplane-dot-source-sha256: [0-9a-f]+ -->", "", victim.read_text()))
    assert diagrams.stale_files(tmp_path, svg=True) == ["push_write.svg"]


def test_cli_renders_identically(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvplane.app.cli", "diagrams", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for fname, content in diagrams.render_all(svg=diagrams.have_dot()).items():
        if fname.endswith(".mmd"):
            assert (tmp_path / fname).read_bytes() == content
        else:
            assert diagrams.dot_stamp((tmp_path / fname).read_bytes()) == diagrams.dot_stamp(content)
    check = subprocess.run([sys.executable, "-m", "kvplane.app.cli", "diagrams", "--check", "--out", str(tmp_path)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    (tmp_path / "lease.mmd").write_text("stale")
    check = subprocess.run([sys.executable, "-m", "kvplane.app.cli", "diagrams", "--check", "--out", str(tmp_path)],
                           capture_output=True, text=True)
    assert check.returncode == 1 and "lease.mmd" in check.stdout


def test_outside_a_checkout_diagrams_go_to_the_cwd(tmp_path, monkeypatch):
    """An installed kvplane writes where the user is, never into site-packages."""
    monkeypatch.setattr(diagram_folders, "checkout_dir", lambda: None)
    monkeypatch.chdir(tmp_path)
    assert diagrams.default_out() == tmp_path
    written = diagrams.write_all(svg=False)
    assert written and all(p.parent == tmp_path for p in written)


def test_outside_a_checkout_check_compares_the_shipped_diagrams(monkeypatch):
    """The wheel ships diagrams/ as the data package kvplane.diagrams; --check
    without --out compares the installed tables with it."""
    from pathlib import Path

    repo_diagrams = Path(__file__).resolve().parent.parent / "diagrams"
    assert diagrams.committed() == repo_diagrams
    monkeypatch.setattr(diagram_folders, "checkout_dir", lambda: None)
    assert diagrams.committed().resolve() == repo_diagrams.resolve()
    assert diagrams.stale_files(svg=False) == []
