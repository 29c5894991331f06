"""Backend-neutral transfer handle shared by the NIXL and loopback endpoints."""

from __future__ import annotations

import itertools
from typing import Any

import attrs

DONE = "DONE"
PROC = "PROC"

_ids = itertools.count(1)


@attrs.define(eq=False)
class XferHandle:
    """One posted transfer.  Identity equality: a handle is a resource."""

    op: str  # "READ" | "WRITE"
    remote_name: str
    notif: bytes
    num_blocks: int
    # Backend object (nixl_xfer_handle, or the loopback's record).
    raw: Any = attrs.field(repr=False)
    # Bytes the transfer moves: num_blocks x slice size (the block size for
    # whole blocks) x regions.
    nbytes: int = attrs.field(kw_only=True)
    # Descriptor pairs handed to the backend (contiguous block runs coalesced:
    # ``descriptors.plan_transfer``).
    descriptors: int = attrs.field(kw_only=True, default=0)
    # perf_counter when the post began, and when the transfer was first seen done.
    posted_at: float = attrs.field(kw_only=True, default=0.0)
    done_at: float | None = attrs.field(kw_only=True, default=None)
    id: int = attrs.field(factory=lambda: next(_ids))
    released: bool = False
