"""Write every machine's diagram from the same tables.

``.mmd`` (Mermaid) always; ``.svg`` through graphviz when the ``dot``
binary and the ``graphviz`` package are installed.  ``stale_files``
compares a folder with what the code renders now.

Where: the user's ``--out``; by default the checkout's ``diagrams/`` when
this code runs from a checkout, otherwise the current directory (never the
installed package).  The wheel ships the committed diagrams as package data
(``kvplane.diagrams``), so ``kvplane diagrams --check`` from a regular install
compares the installed tables with the diagrams released with them.

Rendering needs ``transitions`` (and ``graphviz`` for SVG): the ``[diagrams]``
extra.
"""
from __future__ import annotations

import importlib
import importlib.util
import shutil
from pathlib import Path

from kvplane.statemachines.machines import SPECS

INSTALL_HINT = "pip install 'kvplane[diagrams]'"


class DiagramsUnavailable(RuntimeError):
    """The rendering libraries (the ``[diagrams]`` extra) are not installed."""


def checkout_dir() -> Path | None:
    """The checkout's ``diagrams/`` when this code runs from a checkout
    (app/ beside pyproject.toml and statemachines/), else None."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "statemachines" / "__init__.py").is_file():
        return root / "diagrams"
    return None


def default_out() -> Path:
    """Where ``kvplane diagrams`` writes without ``--out``."""
    return checkout_dir() or Path.cwd()


def committed() -> Path:
    """The diagrams that came with this code: the checkout's, or the wheel's
    package data (``kvplane/diagrams/``, a data-only namespace package)."""
    here = checkout_dir()
    if here is not None:
        return here
    try:
        shipped = importlib.import_module("kvplane.diagrams")
    except ImportError as exc:
        raise DiagramsUnavailable(f"no diagrams were installed with this kvplane ({exc}); "
                                  "pass --out FOLDER to check a folder") from exc
    return Path(next(iter(shipped.__path__)))


def have_dot() -> bool:
    """Whether SVG can be rendered: the ``dot`` binary and the graphviz package."""
    return shutil.which("dot") is not None and importlib.util.find_spec("graphviz") is not None


def render_all(svg: bool = True) -> dict[str, bytes]:
    """File name -> content for every machine."""
    try:
        from kvplane.statemachines.reference import render_dot, render_mermaid
    except ImportError as exc:
        raise DiagramsUnavailable(f"rendering diagrams needs the [diagrams] extra ({exc}): {INSTALL_HINT}") from exc
    files: dict[str, bytes] = {}
    for name, spec in SPECS.items():
        files[f"{name}.mmd"] = render_mermaid(spec).encode()
        if svg:
            files[f"{name}.svg"] = render_dot(spec).pipe(format="svg")
    return files


def write_all(out_dir: Path | None = None, svg: bool | None = None) -> list[Path]:
    out_dir = default_out() if out_dir is None else out_dir
    svg = have_dot() if svg is None else svg
    files = render_all(svg)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, content in files.items():
        path = out_dir / fname
        path.write_bytes(content)
        written.append(path)
    return written


def stale_files(out_dir: Path | None = None, svg: bool | None = None) -> list[str]:
    """Names of diagram files that are missing or differ from a fresh render
    (in ``out_dir``; by default the diagrams that came with this code)."""
    folder = committed() if out_dir is None else out_dir
    svg = have_dot() if svg is None else svg
    return [
        fname
        for fname, content in render_all(svg).items()
        if not (folder / fname).is_file() or (folder / fname).read_bytes() != content
    ]
