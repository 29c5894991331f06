"""Write every machine's diagram into a folder from the same tables.

``.mmd`` (Mermaid) always; ``.svg`` through graphviz when the ``dot``
binary is installed.  ``check`` compares the committed files with what the
code decides now: the Mermaid text, and for an SVG the DOT source it was
drawn from (stamped into the SVG as a hash), so that the check does not
depend on the graphviz version that drew it.  Which folders:
``diagram_folders``.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

from kvplane.statemachines.machines import SPECS
from kvplane.statemachines.machines.engine_request import SPEC as ENGINE_REQUEST
from kvplane.statemachines.render_composition import composition_text
from kvplane.statemachines.render_machine import DiagramText, machine_texts

from .diagram_folders import DiagramsUnavailable, committed, default_out

__all__ = ["DiagramsUnavailable", "have_dot", "sources", "render_all", "write_all", "stale_files", "dot_stamp"]

_STAMP = re.compile(r"<!-- kvplane-dot-source-sha256: ([0-9a-f]{64}) -->")


def have_dot() -> bool:
    return shutil.which("dot") is not None


def sources(specs=None) -> dict[str, DiagramText]:
    """File stem -> Mermaid and DOT text, for every machine (in parts where
    a machine is large) and the composition; by default also the
    engine-side request machine, drawn beside the plane's (it is not one of
    the plane's machines, so not in the composition)."""
    boundary = [ENGINE_REQUEST] if specs is None else []
    specs = SPECS if specs is None else specs
    texts: dict[str, DiagramText] = {}
    for spec in [*specs.values(), *boundary]:
        texts.update(machine_texts(spec))
    texts["composition"] = composition_text(specs)
    return texts


def _sha(dot: str) -> str:
    return hashlib.sha256(dot.encode()).hexdigest()


def dot_stamp(svg: bytes) -> str | None:
    """The hash of the DOT source an SVG was drawn from, if it has one."""
    m = _STAMP.search(svg.decode(errors="replace"))
    return m.group(1) if m else None


def _svg(dot: str) -> bytes:
    drawn = subprocess.run(["dot", "-Tsvg"], input=dot.encode(), capture_output=True, check=True).stdout
    at = drawn.index(b"<svg")
    return drawn[:at] + f"<!-- kvplane-dot-source-sha256: {_sha(dot)} -->\n".encode() + drawn[at:]


def render_all(svg: bool = True, specs=None) -> dict[str, bytes]:
    """File name -> content for every diagram."""
    files: dict[str, bytes] = {}
    for stem, text in sources(specs).items():
        files[f"{stem}.mmd"] = text.mermaid.encode()
        if svg:
            files[f"{stem}.svg"] = _svg(text.dot)
    return files


def write_all(out_dir: Path | None = None, svg: bool | None = None) -> list[Path]:
    out_dir = default_out() if out_dir is None else out_dir
    svg = have_dot() if svg is None else svg
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, content in render_all(svg).items():
        path = out_dir / fname
        path.write_bytes(content)
        written.append(path)
    return written


def stale_files(out_dir: Path | None = None, svg: bool | None = None, specs=None) -> list[str]:
    """Names of diagram files that are missing or differ from what the
    tables decide now.  ``svg``: also the SVGs (by their DOT source); by
    default when ``dot`` is installed or the folder has SVGs."""
    out_dir = committed() if out_dir is None else out_dir
    stale = []
    for stem, text in sources(specs).items():
        mmd = out_dir / f"{stem}.mmd"
        if not mmd.exists() or mmd.read_bytes() != text.mermaid.encode():
            stale.append(mmd.name)
        path = out_dir / f"{stem}.svg"
        check_svg = svg if svg is not None else (have_dot() or any(out_dir.glob("*.svg")))
        if check_svg and (not path.exists() or dot_stamp(path.read_bytes()) != _sha(text.dot)):
            stale.append(path.name)
    return stale
