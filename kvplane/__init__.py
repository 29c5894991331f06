"""kvplane: the control plane of a disaggregated prefill/decode KV-cache connector.

One import namespace: ``kvplane.statemachines`` (the pure core),
``kvplane.transport`` (NIXL, loopback, wire formats, side channel),
``kvplane.connector`` (the driver and the engine-facing facades) and
``kvplane.app`` (the command line and the main job).

The repository keeps those subpackages as top-level folders; the wheel puts
them inside this package (see ``[tool.setuptools.package-dir]``). In a checkout
the folders beside this one are added to the search path so that a checkout,
or a git worktree of it, always imports its own code.
"""
from __future__ import annotations

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "statemachines" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's own __path__)

__version__ = "0.1.0"
