"""Which ranks of a holder engine a reader rank reads, and which part of a block.

Tensor parallelism shards the KV heads: rank ``r`` of an engine with TP
``t`` holds heads ``[r*H/t, (r+1)*H/t)`` of every block.  A reader with a
different TP than the holder reads, for each of its ranks, exactly the
holder ranks that hold its heads:

* holder TP >= reader TP (ratio ``k = holder/reader``): reader rank ``r``
  reads holder ranks ``r*k .. r*k+k-1`` whole, holder rank ``r*k+j`` into
  part ``j`` of ``k`` of each local block;
* reader TP > holder TP (ratio ``k = reader/holder``): reader rank ``r``
  reads part ``r % k`` of ``k`` of each block of holder rank ``r // k``,
  into its whole local block; the ``k`` readers of one holder rank are its
  consumers (``expected_consumers``, fixed when the lease is planned).

A "part ``i`` of ``n``" is the ``i``-th of ``n`` equal contiguous slices of
a block: a rank's block is laid out head-major, so a head shard is one
slice.  Pure: no I/O; the explorer and both connector sides use it.

``holder_pp``: the holder runs pipeline parallel, each of its stages a
contiguous slice of the layers on ``holder_tp`` ranks (stage ``s``'s TP
rank ``t`` is the holder's rank ``s * holder_tp + t``).  A reader rank
(PP 1, every layer) reads its heads from each stage: the sources above,
once per stage, each into the local layers that stage holds (the stage says
which in its handshake: ``transport.layer_slice``); a holder rank's
consumers are the same as without PP.

``replicated``: every rank holds the whole KV (MLA's latent is not split
by heads).  Reader rank ``r`` then reads whole blocks from ONE holder rank,
``r * holder_tp // reader_tp`` (NixlConnector's ``compute_tp_mapping`` for
``is_mla``); a holder wider than the reader has ranks nobody reads
(``unread_holder_ranks``): their blocks are not leased at all.
"""
from __future__ import annotations

import functools

import attrs

# Ranks of one engine (TP x PP) a request may be spread over.
MAX_TP = 1024


class TpMismatch(ValueError):
    """The two TP sizes cannot be mapped onto each other (not divisible, out of range)."""


@attrs.frozen
class Part:
    """Slice ``index`` of ``of`` equal slices of a block (``of == 1``: the whole block)."""

    index: int = 0
    of: int = 1

    @property
    def whole(self) -> bool:
        return self.of == 1


WHOLE = Part()


@attrs.frozen
class Source:
    """One read of a reader rank: holder rank ``holder_rank``'s ``remote`` part
    of each block, into the reader's ``local`` part."""

    holder_rank: int
    remote: Part = WHOLE
    local: Part = WHOLE


def _check_tp(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TP:
        raise TpMismatch(f"{name} must be an int in 1..{MAX_TP}, got {value!r}")
    return value


@attrs.frozen
class TpMapping:
    """The mapping between a holder engine's TP and a reader engine's TP."""

    holder_tp: int = attrs.field(converter=int)
    reader_tp: int = attrs.field(converter=int)
    replicated: bool = attrs.field(default=False, kw_only=True)
    holder_pp: int = attrs.field(default=1, kw_only=True)

    def __attrs_post_init__(self) -> None:
        h = _check_tp("holder_tp", self.holder_tp)
        r = _check_tp("reader_tp", self.reader_tp)
        if _check_tp("holder_pp", self.holder_pp) * h > MAX_TP:
            raise TpMismatch(f"holder TP {h} x PP {self.holder_pp} ranks exceed {MAX_TP}")
        big, small = max(h, r), min(h, r)
        if big % small:
            raise TpMismatch(f"TP sizes must divide each other: holder {h}, reader {r}")

    @property
    def ratio(self) -> int:
        return max(self.holder_tp, self.reader_tp) // min(self.holder_tp, self.reader_tp)

    @property
    def consumers_per_holder_rank(self) -> int:
        """How many reader ranks read each holder rank that is read (its
        lease's expected consumers; replicated KV: the unread ones have none)."""
        return max(1, self.reader_tp // self.holder_tp)

    @property
    def unread_holder_ranks(self) -> tuple[int, ...]:
        """Holder ranks no reader rank reads (replicated KV with a wider
        holder only): they lease nothing and free their blocks at once."""
        if not self.replicated or self.holder_tp <= self.reader_tp:
            return ()
        k = self.ratio
        return tuple(h for h in range(self.holder_ranks) if h % self.holder_tp % k)

    @property
    def holder_ranks(self) -> int:
        """The holder's ranks: TP x PP."""
        return self.holder_tp * self.holder_pp

    def sources(self, reader_rank: int) -> tuple[Source, ...]:
        """What reader rank ``reader_rank`` reads, in holder-rank order
        (stage by stage when the holder runs PP)."""
        if isinstance(reader_rank, bool) or not isinstance(reader_rank, int) or not (
                0 <= reader_rank < self.reader_tp):
            raise TpMismatch(f"reader rank {reader_rank!r} out of range [0, {self.reader_tp})")
        stage0 = self._stage_sources(reader_rank)
        return tuple(attrs.evolve(src, holder_rank=stage * self.holder_tp + src.holder_rank)
                     for stage in range(self.holder_pp) for src in stage0)

    def _stage_sources(self, reader_rank: int) -> tuple[Source, ...]:
        k = self.ratio
        if self.replicated:  # one whole-block source: the holder's KV is on each of its ranks
            return (Source(reader_rank * self.holder_tp // self.reader_tp),)
        if self.holder_tp >= self.reader_tp:
            if k == 1:
                return (Source(reader_rank),)
            return tuple(Source(reader_rank * k + j, WHOLE, Part(j, k)) for j in range(k))
        return (Source(reader_rank // k, Part(reader_rank % k, k), WHOLE),)

    def readers_of(self, holder_rank: int) -> tuple[int, ...]:
        """The reader ranks that read holder rank ``holder_rank``."""
        if not 0 <= holder_rank < self.holder_ranks:
            raise TpMismatch(f"holder rank {holder_rank!r} out of range [0, {self.holder_ranks})")
        return tuple(r for r in range(self.reader_tp)
                     if any(s.holder_rank == holder_rank for s in self.sources(r)))


@functools.lru_cache(maxsize=64)
def tp_mapping(holder_tp: int, reader_tp: int, *, replicated: bool = False, holder_pp: int = 1) -> TpMapping:
    """``TpMapping(...)`` made once per set of sizes: the connector asks for
    one per request, and a mapping never changes (TpMismatch is raised each
    time, never kept).  The sizes must be hashable (ints, as validated params
    give them)."""
    return TpMapping(holder_tp, reader_tp, replicated=replicated, holder_pp=holder_pp)
