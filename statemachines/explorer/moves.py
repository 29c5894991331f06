"""The moves (BFS edges) and the schedulers' phase table.

``STEPS`` is the one statement of which scheduler step happens in which
phase: ``Model.moves`` offers them as choices, ``Model.drain_move`` takes
the first one enabled (arrivals excepted) as the fault-free continuation.
"""
from __future__ import annotations

import attrs

from .world import ALLOCATED, ARRIVED, FINISHED, LOADING, NEW, RUNNING


@attrs.frozen
class Step:
    """One scheduler step of a request's turn.

    Turn 1: D reads P's lease (D's scheduler); turn 2: P reads back the
    blocks D held (P's scheduler), once turn 1 finished.
    """

    name: str
    turn: int
    phase: int  # the turn's phase in which the step is enabled
    then: int  # the phase it leads to
    # A new request arrives: a choice of the environment, never a drain step.
    arrival: bool = False
    # Only once the recv was reported (the scheduler runs what it loaded).
    needs_report: bool = False
    # P must be up (it grants the lease, or is the turn-2 reader).
    needs_prefill: bool = False


STEPS = (
    Step("arrive", 1, NEW, ARRIVED, arrival=True, needs_prefill=True),
    Step("alloc", 1, ARRIVED, ALLOCATED),
    Step("start", 1, ALLOCATED, LOADING),
    Step("run", 1, LOADING, RUNNING, needs_report=True),
    Step("finish", 1, RUNNING, FINISHED),
    Step("arrive2", 2, NEW, ARRIVED, arrival=True, needs_prefill=True),
    Step("alloc2", 2, ARRIVED, ALLOCATED, needs_prefill=True),
    Step("start2", 2, ALLOCATED, LOADING, needs_prefill=True),
    Step("run2", 2, LOADING, RUNNING, needs_report=True, needs_prefill=True),
    Step("finish2", 2, RUNNING, FINISHED, needs_prefill=True),
)
STEP_AT: dict[tuple[int, int], Step] = {(s.turn, s.phase): s for s in STEPS}
assert len(STEP_AT) == len(STEPS), "one step per (turn, phase)"


# ------------------------------------------------------------------ moves
@attrs.frozen
class Schedule:
    """A scheduler step (``STEPS``) of request ``request``."""

    step: Step
    request: int


@attrs.frozen
class Abort:
    """D's scheduler aborts the request (budgeted by ``max_aborts``)."""

    request: int


@attrs.frozen
class AbortLease:
    """P aborts a push's lease: its client went away (budgeted with the aborts)."""

    request: int


@attrs.frozen
class Deliver:
    """Deliver ``net[index]``."""

    index: int


@attrs.frozen
class Inject:
    """Fault ``fault`` (one of the message's ``FAULTS``) hits ``net[index]``."""

    fault: str
    index: int


@attrs.frozen
class Late:
    """The hung transfer ``stalled[index]`` completes after all."""

    index: int


@attrs.frozen
class Tick:
    """Time advances to the next deadline; ``lose_heartbeats``: the batches
    D sends then are lost (a fault)."""

    lose_heartbeats: bool = False


@attrs.frozen
class Crash:
    """P crashes and stays down."""


@attrs.frozen
class Restart:
    """D crashes and starts again at once: a new incarnation, the same engine id."""


@attrs.frozen
class Stall:
    """D stalls (a fault) for at most ``ExploreConfig.stall`` seconds."""


@attrs.frozen
class Resume:
    """A stalled D runs again."""


@attrs.frozen
class CrashRank:
    """The rank world: worker rank plane ``plane`` ("P1", "D0") crashes and stays down."""

    plane: str


@attrs.frozen
class TickLosing:
    """The rank world: time advances as in ``Tick``, and the heartbeat batch
    D rank plane ``src`` sends to P rank ``rank`` then is lost (a fault)."""

    src: str
    rank: int


@attrs.frozen
class WorkerOutput:
    """The engine world: vLLM's engine on ``side`` ("D", "P") takes the workers' output its
    ranks reported since its last step (update_from_output)."""

    side: str


@attrs.frozen
class EngineCall:
    """The engine world: vLLM's scheduler does ``name`` (``engine_model.CALLS``) to request ``request``."""

    name: str
    request: int


Move = (Schedule | Abort | AbortLease | Deliver | Inject | Late | Tick | Crash | Restart | Stall | Resume | CrashRank
        | TickLosing | EngineCall | WorkerOutput)

STEP_NAMED: dict[str, Step] = {s.name: s for s in STEPS}


def schedule(name: str, request: int) -> Schedule:
    """``Schedule`` by step name: ``schedule("arrive", 0)``."""
    return Schedule(STEP_NAMED[name], request)
