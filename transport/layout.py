"""Serializable description of a registered KV cache.

A reader needs the peer's addresses to build remote descriptor lists.  A cache
is one or more regions (e.g. one tensor per layer), each ``num_blocks`` blocks of
``block_size`` bytes; block id ``b`` of a transfer moves block ``b`` of every
region (``descriptors`` turns block lists into byte spans).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import attrs

from .errors import IncompatibleLayout, InvalidPart, TransportError

LAYOUT_VERSION = 1
MEM_TYPES = ("DRAM", "VRAM")


class BlockIdOutOfRange(TransportError, IndexError):
    """A block id that is no block of the layout (e.g. a peer's params naming
    a block past the holder's pool): a refused transfer, never a crash.  An
    IndexError too, for callers that index the pool themselves."""


def _addresses(addrs: Iterable[int]) -> tuple[int, ...]:
    return tuple(addrs)  # typed: ``converter=tuple`` leaves the item type unsolved for mypy


def _positive(_inst: Any, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attr.name} must be a positive int, got {value!r}")


# A part of a block: (index, of), the index-th of ``of`` equal contiguous slices.
BlockPart = tuple[int, int]
WHOLE_BLOCK: BlockPart = (0, 1)


def check_part(part: object, side: str) -> BlockPart:
    """``part`` as an ``(index, of)`` tuple; InvalidPart unless ``of >= 1`` and
    ``0 <= index < of`` are ints (bools refused).  A list pair is accepted
    (msgpack decodes tuples as lists)."""
    if not isinstance(part, (tuple, list)) or len(part) != 2:
        raise InvalidPart(f"{side} part must be an (index, of) pair of ints, got {part!r}")
    index, of = part
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (index, of)):
        raise InvalidPart(f"{side} part must be an (index, of) pair of ints, got {part!r}")
    if of < 1:
        raise InvalidPart(f"{side} part {tuple(part)!r}: of must be >= 1")
    if not 0 <= index < of:
        raise InvalidPart(f"{side} part {tuple(part)!r}: index must be in [0, {of})")
    return index, of


@attrs.frozen
class CacheLayout:
    mem_type: str = attrs.field(validator=attrs.validators.in_(MEM_TYPES))
    device_id: int = attrs.field(validator=attrs.validators.instance_of(int))
    block_size: int = attrs.field(validator=_positive)
    num_blocks: int = attrs.field(validator=_positive)
    base_addrs: tuple[int, ...] = attrs.field(converter=_addresses)

    @base_addrs.validator
    def _check_addrs(self, _attr: attrs.Attribute, value: tuple[int, ...]) -> None:
        if not value:
            raise ValueError("a cache layout needs at least one region")
        if any(isinstance(a, bool) or not isinstance(a, int) or a <= 0 for a in value):
            raise ValueError(f"base addresses must be positive ints, got {value!r}")

    @property
    def region_bytes(self) -> int:
        return self.block_size * self.num_blocks

    def check_block_ids(self, block_ids: Sequence[int], side: str) -> None:
        for b in block_ids:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise BlockIdOutOfRange(
                    f"{side} block id {b!r} out of range [0, {self.num_blocks})"
                )

    def part_size(self, of: int, side: str = "") -> int:
        """Bytes of one of ``of`` equal slices of a block; IncompatibleLayout
        when the block size does not divide by ``of``."""
        if self.block_size % of:
            raise IncompatibleLayout(
                f"{side + ' ' if side else ''}block size {self.block_size} B does not divide "
                f"into {of} equal parts"
            )
        return self.block_size // of

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": LAYOUT_VERSION,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "base_addrs": list(self.base_addrs),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CacheLayout":
        """Parse a peer's description; any problem is a ValueError naming it."""
        if not isinstance(d, dict):
            raise ValueError(f"cache description must be a dict, got {type(d).__name__}")
        if d.get("v") != LAYOUT_VERSION:
            raise ValueError(f"cache description version {d.get('v')!r} != {LAYOUT_VERSION}")
        try:
            return cls(
                mem_type=d["mem_type"],
                device_id=d["device_id"],
                block_size=d["block_size"],
                num_blocks=d["num_blocks"],
                base_addrs=d["base_addrs"],
            )
        except KeyError as e:
            raise ValueError(f"cache description lacks field {e.args[0]!r}") from e
        except TypeError as e:
            raise ValueError(f"bad cache description: {e}") from e

    def check_pairable(self, remote: "CacheLayout", local_first_region: int | None = None) -> None:
        """Block-for-block transfers need equal block sizes and paired regions
        (:meth:`check_regions`)."""
        if remote.block_size != self.block_size:
            raise IncompatibleLayout(
                f"block size mismatch: local {self.block_size} B, remote {remote.block_size} B"
            )
        self.check_regions(remote, local_first_region)

    def check_regions(self, remote: "CacheLayout", local_first_region: int | None = None) -> None:
        """None: equal region counts, region ``i`` with region ``i``; an int
        (a peer holding a layer slice, ``layer_slice``): the remote regions
        pair with local regions ``local_first_region ..``, which must exist."""
        if local_first_region is None:
            if len(remote.base_addrs) != len(self.base_addrs):
                raise IncompatibleLayout(
                    f"region count mismatch: local {len(self.base_addrs)}, "
                    f"remote {len(remote.base_addrs)}"
                )
            return
        if isinstance(local_first_region, bool) or not isinstance(local_first_region, int) or \
                local_first_region < 0 or local_first_region + len(remote.base_addrs) > len(self.base_addrs):
            raise IncompatibleLayout(
                f"remote regions ({len(remote.base_addrs)}) from local region {local_first_region!r} "
                f"run past the local {len(self.base_addrs)}"
            )

    def check_pairable_parts(
        self, remote: "CacheLayout", local_part: BlockPart, remote_part: BlockPart,
        local_first_region: int | None = None,
    ) -> int:
        """Slice-for-slice transfers (``remote_part`` of each remote block to or
        from ``local_part`` of each local block) need paired regions, block
        sizes divisible by the parts' ``of`` and equal slice sizes.  Returns the
        slice size in bytes; two whole blocks are :meth:`check_pairable`."""
        if local_part[1] == 1 and remote_part[1] == 1:
            self.check_pairable(remote, local_first_region)
            return self.block_size
        self.check_regions(remote, local_first_region)
        local_size = self.part_size(local_part[1], "local")
        remote_size = remote.part_size(remote_part[1], "remote")
        if local_size != remote_size:
            raise IncompatibleLayout(
                f"slice size mismatch: local part {local_part} of a {self.block_size} B block is "
                f"{local_size} B, remote part {remote_part} of a {remote.block_size} B block is "
                f"{remote_size} B"
            )
        return local_size
