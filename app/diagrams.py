"""Write every machine's diagram into a folder from the same tables.

``.mmd`` (Mermaid) always; ``.svg`` through graphviz when the ``dot``
binary is installed.  ``check`` compares the committed files with what the
code renders now.  Which folders: ``diagram_folders``.  Rendering needs the
``[diagrams]`` extra (transitions, graphviz).
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from kvplane.statemachines.machines import SPECS

from .diagram_folders import DiagramsUnavailable, committed, default_out


def have_dot() -> bool:
    return shutil.which("dot") is not None and importlib.util.find_spec("graphviz") is not None


def render_all(svg: bool = True) -> dict[str, bytes]:
    """File name -> content for every machine."""
    try:  # the [diagrams] extra
        from kvplane.statemachines.reference import render_dot, render_mermaid
        from kvplane.statemachines.render_composition import composition_files
    except ImportError as exc:
        raise DiagramsUnavailable(f"rendering diagrams needs the [diagrams] extra ({exc}): pip install 'kvplane[diagrams]'") from exc
    files: dict[str, bytes] = {}
    for name, spec in SPECS.items():
        files[f"{name}.mmd"] = render_mermaid(spec).encode()
        if svg:
            files[f"{name}.svg"] = render_dot(spec).pipe(format="svg")
    files.update(composition_files(SPECS, svg))
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


def stale_files(out_dir: Path | None = None, svg: bool | None = None) -> list[str]:
    """Names of diagram files that are missing or differ from a fresh render."""
    out_dir = committed() if out_dir is None else out_dir
    svg = have_dot() if svg is None else svg
    return [
        fname
        for fname, content in render_all(svg).items()
        if not (out_dir / fname).exists() or (out_dir / fname).read_bytes() != content
    ]
