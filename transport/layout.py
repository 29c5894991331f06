"""Serializable description of a registered KV cache.

A reader needs the peer's addresses to build remote descriptor lists.  A cache
is one or more regions (e.g. one tensor per layer), each ``num_blocks`` blocks of
``block_size`` bytes; block id ``b`` of a transfer moves block ``b`` of every
region, so descriptor index = ``region * num_blocks + block``.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import attrs

LAYOUT_VERSION = 1
MEM_TYPES = ("DRAM", "VRAM")


def _addresses(addrs: Iterable[int]) -> tuple[int, ...]:
    return tuple(addrs)  # typed: ``converter=tuple`` leaves the item type unsolved for mypy


def _positive(_inst: Any, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attr.name} must be a positive int, got {value!r}")


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
                raise IndexError(
                    f"{side} block id {b!r} out of range [0, {self.num_blocks})"
                )

    def descriptors(self) -> list[tuple[int, int, int]]:
        """All (addr, len, device) triples, region-major, for prep_xfer_dlist."""
        return [
            (base + b * self.block_size, self.block_size, self.device_id)
            for base in self.base_addrs
            for b in range(self.num_blocks)
        ]

    def indices(self, block_ids: Sequence[int]) -> list[int]:
        """Descriptor indices moving ``block_ids`` in every region."""
        return [r * self.num_blocks + b for r in range(len(self.base_addrs)) for b in block_ids]

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

    def check_pairable(self, remote: "CacheLayout") -> None:
        """Block-for-block transfers need equal block sizes and region counts."""
        from .errors import IncompatibleLayout

        if remote.block_size != self.block_size:
            raise IncompatibleLayout(
                f"block size mismatch: local {self.block_size} B, remote {remote.block_size} B"
            )
        if len(remote.base_addrs) != len(self.base_addrs):
            raise IncompatibleLayout(
                f"region count mismatch: local {len(self.base_addrs)}, "
                f"remote {len(remote.base_addrs)}"
            )
