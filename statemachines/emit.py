"""How a table row names an action it emits.

A row lists ``Emit`` records: the action class built (what the diagrams,
the validator's resource accounting and the event log see) and the
machine-local function that builds it from the instance and the event.
Action classes carry only their fields and resources; what goes into them
is written beside the table that emits them, one builder per meaning
(``cancel_xfer`` and ``release_xfer`` both build ``ReleaseXfer``).

    @emits(ReleaseXfer)
    def cancel_xfer(r, ev, cfg, now):
        return ReleaseXfer(r.key, cancel=True)
"""
from __future__ import annotations

from typing import Any, Callable

import attrs

from .base import Action

Builder = Callable[[Any, Any, Any, float], Action]


@attrs.frozen
class Emit:
    action: type[Action]
    build: Builder = attrs.field(repr=False)

    @property
    def name(self) -> str:
        """The builder's name (the row's meaning, e.g. ``cancel_xfer``)."""
        return self.build.__name__

    # The resources of the action built, read statically by the validator.
    @property
    def acquires(self) -> frozenset[str]:
        return self.action.acquires

    @property
    def releases(self) -> frozenset[str]:
        return self.action.releases


def emits(action: type[Action]) -> Callable[[Builder], Emit]:
    """Decorate a builder function as the row entry that emits ``action``."""

    def wrap(build: Builder) -> Emit:
        return Emit(action, build)

    return wrap
