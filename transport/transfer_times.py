"""Each transfer's time from post to done, as the endpoint that posted it saw it.

"Done" is the poll (or the post itself) that first returned DONE, so the
figure includes how often the owner polls: it is the latency the engine
gets, not the wire's.  Bounded: past ``limit`` samples only counts grow.
"""
from __future__ import annotations

import attrs

SAMPLES_KEPT = 100_000


@attrs.frozen
class TransferSample:
    op: str  # "READ" | "WRITE"
    nbytes: int
    descriptors: int
    seconds: float  # post -> done


@attrs.define
class TransferTimes:
    limit: int = SAMPLES_KEPT
    samples: list[TransferSample] = attrs.Factory(list)
    not_kept: int = 0  # transfers done past ``limit``

    def note(self, op: str, nbytes: int, descriptors: int, seconds: float) -> None:
        if len(self.samples) < self.limit:
            self.samples.append(TransferSample(op, nbytes, descriptors, seconds))
        else:
            self.not_kept += 1
