"""kvplane: the control plane of a disaggregated prefill/decode KV-cache connector.

One import namespace: ``kvplane.statemachines`` (the pure core),
``kvplane.transport`` (NIXL, loopback, wire formats, side channel),
``kvplane.connector`` (the driver and the engine-facing facades) and
``kvplane.app`` (the command line and the main job).

The repository keeps those subpackages as top-level folders; this folder
holds a symbolic link to each, so a checkout (or a git worktree of it) imports
its own code under these names, as mypy reads it and as the wheel installs it.
"""
__version__ = "0.1.0"
