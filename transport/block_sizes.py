"""Moving a token range between caches whose blocks hold different numbers
of tokens (vLLM's ``--block-size`` on P and on D; NixlConnector's
``block_size_ratio``).

A block is ``rows`` rows (the rank's KV heads) each holding a contiguous
run of ``tokens`` token slots, every slot equally wide: vLLM's CPU layout
(LBHNC, ``[num_blocks, kv_heads, block_size, 2 * head_size]``).  Where one
side's blocks hold ``r`` times the other's tokens, a large block's row is
``r`` small blocks' rows back to back, so the unit both sides can address
is one row of a small block: ``(row, sub-block)`` of the large block is the
part ``row * r + sub`` of ``rows * r`` equal byte slices, the same row of
the small block its part ``row`` of ``rows``.  Both slices are equally long
when a token row is equally wide on both sides (same head size and dtype:
the transport checks it).  Equal block sizes pair whole blocks.

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


class BlockMappingError(ValueError):
    """Two block shapes, or block lists and a token range, that do not pair:
    refused before anything is posted."""


def _positive(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BlockMappingError(f"{attr.name} must be a positive int, got {value!r}")


@attrs.frozen
class BlockShape:
    """One side's blocks: ``tokens`` token slots in each of ``rows`` rows."""

    tokens: int = attrs.field(validator=_positive)
    rows: int = attrs.field(validator=_positive)


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
    if local.rows != remote.rows:
        raise BlockMappingError(f"rows per block differ: local {local.rows}, remote {remote.rows} (a KV head "
                                "split across ranks and a block-size ratio together are not paired)")
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
    local_subs, remote_subs = local.tokens // unit, remote.tokens // unit
    out = []
    for start in range(first_token, num_tokens, unit):
        lb = local_ids[(start - first_token) // local.tokens]
        rb = remote_ids[start // remote.tokens]
        lsub, rsub = start % local.tokens // unit, start % remote.tokens // unit
        for row in range(local.rows):
            out.append(SlicePair(lb, (row * local_subs + lsub, local.rows * local_subs),
                                 rb, (row * remote_subs + rsub, remote.rows * remote_subs)))
    return tuple(out)
