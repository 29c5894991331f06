"""Builders shared by every machine that references a remote engine.

A machine whose instance has an ``engine_id`` takes the engine (it must be
connected, and is never evicted while referenced), drops it, and reports
activity on it the same way; its table names these builders like its own.
"""
from __future__ import annotations

from typing import Any

from ..actions import AcquireEngine, NoteActivity, ReleaseEngine
from ..emit import emits


@emits(AcquireEngine)
def acquire_engine(inst: Any, ev, cfg, now) -> AcquireEngine:
    return AcquireEngine(inst.engine_id, inst.KIND, inst.key)


@emits(ReleaseEngine)
def release_engine(inst: Any, ev, cfg, now) -> ReleaseEngine:
    return ReleaseEngine(inst.engine_id, inst.KIND, inst.key)


@emits(NoteActivity)
def note_activity(inst: Any, ev, cfg, now) -> NoteActivity:
    """Any READ, WRITE or completion refreshes the engine's liveness."""
    return NoteActivity(inst.engine_id)
