"""Per-transfer figures of a run: latency from post to done and throughput.

Throughput in flight is bytes over the summed post-to-done times (byte
weighted: a long transfer counts for its bytes), so it says how fast data
moves while a transfer is posted, whatever the workload leaves idle between.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import attrs

from kvplane.transport.transfer_times import TransferSample


def nearest_rank(sorted_xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ascending ``sorted_xs``, nearest-rank."""
    if not sorted_xs:
        raise ValueError("no samples")
    return sorted_xs[min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))]


@attrs.frozen
class TransferStats:
    transfers: int
    nbytes: int
    seconds: float  # summed post -> done
    p50_ms: float
    p99_ms: float
    gbps: float  # nbytes / seconds

    @classmethod
    def of(cls, samples: Iterable[TransferSample]) -> "TransferStats | None":
        xs = list(samples)
        if not xs:
            return None
        secs = sorted(s.seconds for s in xs)
        total_s = sum(secs)
        nbytes = sum(s.nbytes for s in xs)
        return cls(transfers=len(xs), nbytes=nbytes, seconds=total_s, p50_ms=nearest_rank(secs, 0.5) * 1e3,
                   p99_ms=nearest_rank(secs, 0.99) * 1e3, gbps=nbytes / total_s / 1e9 if total_s > 0 else math.inf)

    def to_dict(self) -> dict:
        return {"transfers": self.transfers, "bytes": self.nbytes, "seconds": round(self.seconds, 6),
                "p50_ms": round(self.p50_ms, 4), "p99_ms": round(self.p99_ms, 4), "gbps": round(self.gbps, 3)}


def reads(samples: Iterable[TransferSample]) -> list[TransferSample]:
    return [s for s in samples if s.op == "READ"]
