"""What the driver and the connector need from a transfer endpoint.

``NixlEndpoint`` (real NIXL) and ``LoopbackEndpoint`` (in-process, for
tests) both provide it, and so does any wrapper around one (``faults``).
Every method may raise a ``TransportError`` subclass (``errors``); block
ids are the endpoint's own cache blocks, ``remote_desc`` a peer's
``describe_cache()``.

With tensor parallelism a transfer moves a part of each block:
``remote_part`` / ``local_part`` are ``(index, of)``, the ``index``-th of
``of`` equal contiguous byte slices of a block in every region (``(0, 1)``:
the whole block).  The two slices must be equally large; a bad part, a block
size that does not divide, or unequal slices raise a ValueError subclass
before anything is posted.  Blocks of different sizes on the two sides
(P's and D's ``--block-size``) move as slice pairs (``post_read_slices``).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from .block_sizes import SlicePair
from .handle import XferHandle
from .layout import WHOLE_BLOCK, BlockPart


@runtime_checkable
class Endpoint(Protocol):
    # ------------------------------------------------------------ memory
    def register_kv_cache(self, tensor: Any, block_size_bytes: int) -> Any:
        """Register one more region of the KV cache ([num_blocks, ...] contiguous)."""

    def describe_cache(self) -> dict:
        """The serializable layout a peer passes to post_read / post_write."""

    # ------------------------------------------------------------ peers
    def local_metadata(self) -> bytes:
        """This agent's metadata, unframed (the handshake frames it)."""

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's unframed metadata; returns the peer's agent name."""

    def remove_remote(self, name: str) -> None: ...

    # ------------------------------------------------------------ transfers
    def post_read(self, remote_name: str, remote_desc: dict, remote_block_ids: Sequence[int],
                  local_block_ids: Sequence[int], notif: bytes = b"", *,
                  remote_part: BlockPart = WHOLE_BLOCK, local_part: BlockPart = WHOLE_BLOCK,
                  local_first_region: int | None = None) -> XferHandle:
        """Pull (a part of) remote blocks into (a part of) local ones; ``notif``
        reaches the peer on completion.  ``local_first_region``: the remote
        holds a layer slice, read into local regions from there (``layer_slice``)."""

    def post_write(self, remote_name: str, remote_desc: dict, remote_block_ids: Sequence[int],
                   local_block_ids: Sequence[int], notif: bytes = b"", *,
                   remote_part: BlockPart = WHOLE_BLOCK, local_part: BlockPart = WHOLE_BLOCK,
                   local_first_region: int | None = None) -> XferHandle:
        """Push (a part of) local blocks into (a part of) remote ones (push mode)."""

    def post_read_slices(self, remote_name: str, remote_desc: dict, slices: Sequence[SlicePair],
                         notif: bytes = b"") -> XferHandle:
        """Pull each pair's remote slice into its local slice: blocks of
        different sizes (``block_sizes.slice_pairs``)."""

    def post_write_slices(self, remote_name: str, remote_desc: dict, slices: Sequence[SlicePair],
                          notif: bytes = b"") -> XferHandle:
        """Push each pair's local slice into its remote slice."""

    def poll_transfer(self, handle: XferHandle) -> str:
        """``"DONE"`` or ``"PROC"``; a failed transfer raises."""

    def release(self, handle: XferHandle, *, missing_ok: bool = False) -> None:
        """Free a handle (cancelling a transfer still in flight)."""

    # ------------------------------------------------------------ notifications
    def send_notif(self, remote_name: str, msg: bytes) -> None: ...

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """(sender agent name, message) of every notification since the last call."""

    def close(self) -> None: ...
