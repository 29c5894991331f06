"""The synthetic request stream of ``kvplane run``: one cycle of request
kinds, shuffled per cycle by the run's seed, and each request's record of
what happened to it (turn 1: D reads P; turn 2: P reads D's held blocks).
"""
from __future__ import annotations

import random

import attrs

from .options import RunOptions

# Request kinds of the synthetic stream, one cycle (shuffled per cycle).
KINDS = ("normal", "prefix", "normal", "multiturn", "full_awaited", "normal",
         "prefix", "multiturn_late", "full_notify", "normal", "multiturn", "prefix")


@attrs.define
class Req:
    lid: str
    kind: str
    nblocks: int
    prefix: int
    arrive: float
    push: bool
    hold: bool = False
    late: bool = False
    turn1: str | None = None  # ok | recomputed | corrupt | failed
    detail: str = ""
    turn2: str | None = None  # ok | recomputed | corrupt | failed | skipped
    hold_at: float | None = None
    hold_params: dict | None = None
    turn2_due: float | None = None
    sent: bool = False
    decoder: str = ""  # the decode engine the proxy routed it to (orchestrator role)
    prefiller: str = ""  # the prefill engine the proxy routed it to (turn 1 and its turn 2)

    @property
    def done(self) -> bool:
        return self.turn1 is not None and (not self.hold or self.turn2 is not None)


def make_stream(opts: RunOptions) -> list[Req]:
    rng = random.Random(opts.seed)
    kinds: list[str] = []
    while len(kinds) < opts.requests:
        cycle = list(KINDS)
        rng.shuffle(cycle)
        kinds += cycle
    reqs = []
    for i, kind in enumerate(kinds[: opts.requests]):
        n = rng.randint(opts.min_blocks, opts.max_blocks)
        prefix = {"prefix": rng.randint(1, n - 1), "full_awaited": n, "full_notify": n}.get(kind, 0)
        reqs.append(Req(lid=f"req{i:04d}", kind=kind, nblocks=n, prefix=prefix, arrive=i * opts.spacing,
                        push=opts.push and prefix < n, hold=kind.startswith("multiturn"),
                        late=kind == "multiturn_late"))
    return reqs

