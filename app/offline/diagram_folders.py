"""Where ``kvplane diagrams`` writes and what ``--check`` compares with.

Writing: the user's ``--out``; by default the checkout's ``diagrams/`` when
this code runs from a checkout, otherwise the current directory (never the
installed package).  Checking: ``--out`` when given; by default the diagrams
that came with this code: the checkout's, or, from a regular install, the
copy the wheel ships as package data (``kvplane/diagrams/``), so that the
installed tables are compared with the diagrams released with them.
"""
from __future__ import annotations

import importlib
from pathlib import Path


class DiagramsUnavailable(RuntimeError):
    """Diagrams cannot be rendered or found (a missing extra, no shipped copy)."""


def checkout_dir() -> Path | None:
    """The checkout's ``diagrams/`` when this code runs from a checkout
    (app/ beside pyproject.toml and statemachines/), else None.  Searched
    upwards, so that it holds at any depth of app/'s subpackages."""
    here = Path(__file__).resolve()
    for root in here.parents:
        if (root / "app").is_dir() and here.is_relative_to(root / "app"):
            if (root / "pyproject.toml").is_file() and (root / "statemachines" / "__init__.py").is_file():
                return root / "diagrams"
            return None
    return None


def default_out() -> Path:
    """Where ``kvplane diagrams`` writes without ``--out``."""
    return checkout_dir() or Path.cwd()


def committed() -> Path:
    """The diagrams that came with this code: the checkout's, or the wheel's
    package data (``kvplane.diagrams``, a data-only namespace package)."""
    here = checkout_dir()
    if here is not None:
        return here
    try:
        shipped = importlib.import_module("kvplane.diagrams")
    except ImportError as exc:
        raise DiagramsUnavailable(f"no diagrams were installed with this kvplane ({exc}); "
                                  "pass --out FOLDER to check a folder") from exc
    return Path(next(iter(shipped.__path__)))
