"""Builders shared by every machine that runs a NIXL transfer (a READ or a WRITE).

The transfer handle is the ``xfer`` resource; releasing it says whether the
transport must cancel a transfer that may still be in flight.
"""
from __future__ import annotations

from typing import Any

from ..actions import ReleaseXfer
from ..emit import emits


@emits(ReleaseXfer)
def release_xfer(inst: Any, ev, cfg, now) -> ReleaseXfer:
    """The transfer completed or failed: nothing is in flight."""
    return ReleaseXfer(inst.key, cancel=False)


@emits(ReleaseXfer)
def cancel_xfer(inst: Any, ev, cfg, now) -> ReleaseXfer:
    """The transfer may still be in flight (deadline, abort, engine or lease lost)."""
    return ReleaseXfer(inst.key, cancel=True)
