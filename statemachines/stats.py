"""The keys of ``ControlPlane.stats``: one small record per kind of count.

``str()`` of a key is its compact, stable name (``"ignored:lease:LEASED:
LeaseAbort"``, what summaries key their counts by); ``label`` is the same
key in words for report tables (``"ignored LeaseAbort in lease LEASED"``).
Nothing parses either back: readers match the record's type and fields.  Event names are class names, so the keys serialize.

``StatKeys`` interns the keys a plane counts under: counting then costs a
dict lookup that compares the interned key by identity.  The keys are
frozen msgspec Structs: their hash is computed in C and cached (an attrs
class's cached hash is still a Python call, twice per count).
"""
from __future__ import annotations

from typing import Any

import msgspec

# What an anomaly (``Anomaly.what``) can be.
UNKNOWN_ID = "unknown_id"  # no instance with this id, and the event creates none
UNKNOWN_KIND = "unknown_kind"  # addressed to no machine kind of the plane
PROTOCOL_VIOLATION = "protocol_violation"  # declared an error in the current state
NONFINITE_DEADLINE = "nonfinite_deadline"  # a deadline that is NaN or infinite
SOURCE_NOT_HELD = "source_not_held"  # would create a machine whose source is gone
_ANOMALY_LABELS = {
    UNKNOWN_ID: "{event} for an unknown {kind} id",
    UNKNOWN_KIND: "{event} for {kind}, a machine kind this plane does not have",
    PROTOCOL_VIOLATION: "protocol violation: {event} in {kind}",
    NONFINITE_DEADLINE: "non-finite deadline from {event} in {kind}",
    SOURCE_NOT_HELD: "{event} would create a {kind} whose source is gone",
}


class Ignored(msgspec.Struct, frozen=True, order=True, cache_hash=True, gc=False):
    """A declared ignore: ``event`` in ``state`` of a ``kind`` machine."""

    kind: str
    state: str
    event: str

    def __str__(self) -> str:
        return f"ignored:{self.kind}:{self.state}:{self.event}"

    @property
    def label(self) -> str:
        return f"ignored {self.event} in {self.kind} {self.state}"


class Final(msgspec.Struct, frozen=True, order=True, cache_hash=True, gc=False):
    """A ``kind`` machine ended in terminal ``state``."""

    kind: str
    state: str

    def __str__(self) -> str:
        return f"final:{self.kind}:{self.state}"

    @property
    def label(self) -> str:
        return f"{self.kind} ended {self.state}"


class FailClosed(msgspec.Struct, frozen=True, order=True, cache_hash=True, gc=False):
    """A protocol violation made a ``kind`` machine fail closed."""

    kind: str

    def __str__(self) -> str:
        return f"fail_closed:{self.kind}"

    @property
    def label(self) -> str:
        return f"{self.kind} failed closed on a protocol violation"


class SourceEnded(msgspec.Struct, frozen=True, order=True, cache_hash=True, gc=False):
    """A ``kind`` machine was fed its source's end instead of ``cause``
    (or because its source left its held states on ``cause``)."""

    kind: str
    cause: str

    def __str__(self) -> str:
        return f"source_ended:{self.kind}:{self.cause}"

    @property
    def label(self) -> str:
        return f"{self.kind} ended with its source (instead of {self.cause})"


class Anomaly(msgspec.Struct, frozen=True, order=True, cache_hash=True, gc=False):
    """An event the plane refused or repaired (see the constants above)."""

    what: str
    kind: str
    event: str

    def __str__(self) -> str:
        return f"{self.what}:{self.kind}:{self.event}"

    @property
    def label(self) -> str:
        return _ANOMALY_LABELS.get(self.what, "{what}: {event} for {kind}").format(
            what=self.what.replace("_", " "), kind=self.kind, event=self.event)


class StatKeys:
    """One key object per distinct key (see the module docstring)."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: dict[tuple, Any] = {}

    def __call__(self, record: type, *fields: str) -> Any:
        probe = (record, *fields)
        key = self._keys.get(probe)
        if key is None:
            key = self._keys[probe] = record(*fields)
        return key
