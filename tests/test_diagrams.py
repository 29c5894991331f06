"""The committed diagrams are what the tables render, and they show what
a design review needs: guards, timers and terminal states."""
import subprocess
import sys

import pytest

from kvplane.app import diagram_folders, diagrams
from kvplane.statemachines.machines import SPECS
from kvplane.statemachines.reference import render_mermaid


def test_committed_mermaid_matches_tables():
    stale = diagrams.stale_files(svg=False)
    assert stale == [], f"run `kvplane diagrams`: stale {stale}"


@pytest.mark.skipif(not diagrams.have_dot(), reason="graphviz `dot` not installed")
def test_committed_svg_matches_tables():
    stale = [f for f in diagrams.stale_files(svg=True) if f.endswith(".svg")]
    assert stale == [], f"run `kvplane diagrams`: stale {stale}"


def test_every_transition_guard_timer_and_terminal_is_drawn():
    for name, spec in SPECS.items():
        text = render_mermaid(spec)
        for state in spec.states:
            assert f'as {state.name}' in text
            if state.terminal:
                assert f"{state.name} --> [*]" in text
            if state.deadline is not None:
                assert f'"{state.name} [' in text and "deadline" in text.split(f'"{state.name} [')[1].split('"')[0]
        for t in spec.table:
            if hasattr(t, "dest"):
                edge = [l for l in text.splitlines() if l.strip().startswith(f"{t.src} --> {t.dest}:")]
                assert edge, f"{name}: no edge {t.src} -> {t.dest}"
                if t.guard_doc:
                    assert f"[{t.guard_doc}]" in edge[0]


def test_check_detects_a_stale_file(tmp_path):
    diagrams.write_all(tmp_path, svg=False)
    assert diagrams.stale_files(tmp_path, svg=False) == []
    victim = tmp_path / "lease.mmd"
    victim.write_text(victim.read_text().replace("LeaseHeartbeat", "Heartbeat"))
    assert diagrams.stale_files(tmp_path, svg=False) == ["lease.mmd"]


def test_cli_renders_identically(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvplane.app.cli", "diagrams", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for fname, content in diagrams.render_all(svg=diagrams.have_dot()).items():
        assert (tmp_path / fname).read_bytes() == content
    check = subprocess.run([sys.executable, "-m", "kvplane.app.cli", "diagrams", "--check", "--out", str(tmp_path)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


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
