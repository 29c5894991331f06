"""Which of a model's layers a cache's regions are (pipeline parallelism).

An engine with pipeline parallel size ``pp`` runs each stage in its own
worker, holding a contiguous slice of the model's layers: its KV cache is
one region per layer of that slice.  A stage says which slice in its cache
description (``LAYER_SLICE``: first layer, layer count, the model's total);
a reader whose cache holds every layer (PP 1) pairs the stage's regions
``0 .. count-1`` with its own regions ``first .. first+count-1``
(NixlConnector's ``_remote_region_offset``).  A description without the key
is the whole model.  Pure: no I/O.
"""
from __future__ import annotations

from typing import Any

import attrs

from .errors import IncompatibleLayout

# The key of a cache description (``endpoint.describe_cache()``) a driver adds
# where its embedder registered a layer slice of the model.
LAYER_SLICE = "layer_slice"
MAX_LAYERS = 4096


def _layer_count(_inst: Any, attr: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LAYERS:
        raise ValueError(f"{attr.name} must be an int in 0..{MAX_LAYERS}, got {value!r}")


@attrs.frozen
class LayerSlice:
    """Layers ``first .. first+count-1`` of a model of ``total`` layers."""

    first: int = attrs.field(validator=_layer_count)
    count: int = attrs.field(validator=_layer_count)
    total: int = attrs.field(validator=_layer_count)

    def __attrs_post_init__(self) -> None:
        if self.count < 1 or self.first + self.count > self.total:
            raise ValueError(f"layers {self.first}..{self.first + self.count - 1} are no slice of a "
                             f"{self.total}-layer model")

    @property
    def whole(self) -> bool:
        return self.first == 0 and self.count == self.total

    def to_list(self) -> list[int]:
        return [self.first, self.count, self.total]

    @classmethod
    def from_value(cls, value: object) -> "LayerSlice":
        """A peer's ``[first, count, total]``; ValueError naming the problem."""
        if not isinstance(value, (list, tuple)) or len(value) != 3:
            raise ValueError(f"{LAYER_SLICE} must be [first, count, total], got {value!r:.60}")
        return cls(*value)


def local_first_region(cache: dict, local_regions: int, local_slice: LayerSlice | None = None) -> int | None:
    """Where a peer's regions go in this cache (``local_regions`` regions):
    None when both hold the whole model (region ``i`` pairs with region
    ``i``); else the first local region the peer's slice pairs with.
    IncompatibleLayout when the slice is malformed, is no slice of this
    model, or when this side holds a slice itself (a reader with PP > 1:
    NixlConnector refuses it too)."""
    value = cache.get(LAYER_SLICE) if isinstance(cache, dict) else None
    if value is None:
        return None
    try:
        remote = LayerSlice.from_value(value)
    except (TypeError, ValueError) as exc:
        raise IncompatibleLayout(f"peer's {LAYER_SLICE}: {exc}") from None
    if local_slice is not None and not local_slice.whole:
        raise IncompatibleLayout(f"this cache holds layers {local_slice.to_list()}: a layer slice is read "
                                 f"only into a cache of the whole model")
    if remote.total != local_regions:
        raise IncompatibleLayout(f"peer holds layers {remote.first}..{remote.first + remote.count - 1} of "
                                 f"{remote.total}; this cache has {local_regions} layer regions")
    regions = cache.get("base_addrs")
    if not isinstance(regions, (list, tuple)) or len(regions) != remote.count:
        raise IncompatibleLayout(f"peer says it holds {remote.count} layers but describes "
                                 f"{len(regions) if isinstance(regions, (list, tuple)) else '?'} regions")
    return remote.first
