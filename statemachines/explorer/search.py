"""Breadth-first search over the model, liveness drains, counterexamples.

No I/O and no clock reads: writing a counterexample's logs is the caller's
(``Violation.logs`` holds them), and so is timing, unless a ``clock`` is
passed in; a ``progress`` callback gets counts only (``SearchProgress``),
so the caller computes rates with its own clock.
"""
from __future__ import annotations

import gc
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator, cast

import attrs

from ..eventlog import MemoryLog
from ..machine import Machine
from .checks import Found
from .config import ExploreConfig
from .model import Model
from .engine_model import model_for
from .moves import Move
from .world import World


@attrs.define
class Violation:
    kind: str
    message: str
    moves: list[str]  # the shortest move sequence, as readable steps
    logs: dict = attrs.Factory(dict)  # plane name -> JSONL lines (replayable, see ``replay``)

    def __str__(self) -> str:
        steps = "\n".join(f"  {n:3d}. {m}" for n, m in enumerate(self.moves, 1))
        return f"{self.kind}: {self.message}\n{steps}"


@attrs.frozen
class SearchProgress:
    """Where the search is, for a progress display (counts, no times)."""

    states: int  # distinct states found so far
    expanded: int  # states taken off the frontier (their successors generated)
    transitions: int
    depth: int  # BFS depth of the state being expanded
    frontier: int  # states waiting to be expanded
    violations: int
    max_depth: int  # the bounds (ExploreConfig's)
    max_states: int


# How many expansions between two progress callbacks (a few ms of search).
PROGRESS_EVERY = 500


@attrs.define
class ExploreResult:
    config: ExploreConfig
    states: int = 0
    transitions: int = 0
    max_depth_reached: int = 0
    frontier_cut: int = 0  # states at max_depth whose successors were not explored
    drained: int = 0
    elapsed: float = 0.0  # by the ``clock`` passed to explore; 0 without one
    violations: list = attrs.Factory(list)
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def states_per_second(self) -> float:
        return self.states / self.elapsed if self.elapsed > 0 else float("inf")


def explore(config: ExploreConfig | None = None, *, machines: dict[str, Machine] | None = None,
            model_factory: Callable[[ExploreConfig, dict[str, Machine] | None], Model] | None = None,
            clock: Callable[[], float] | None = None,
            progress: Callable[[SearchProgress], None] | None = None, progress_every: int = PROGRESS_EVERY,
            **overrides: Any) -> ExploreResult:
    """Breadth-first exploration of every interleaving up to ``max_depth``.

    ``overrides`` are ExploreConfig fields (``explore(requests=("read",))``).
    ``model_factory`` builds the model from the config and machines (default
    ``engine_model.model_for``: one plane a side, one per rank with ``ranks``,
    or the engine world with ``engine``).
    Violations carry the shortest move sequence and replayable logs.
    ``clock`` (e.g. ``time.perf_counter``) times the run into ``elapsed``.
    ``progress`` is called every ``progress_every`` expanded states with a
    ``SearchProgress``.
    """
    cfg = attrs.evolve(config or ExploreConfig(), **overrides)
    model = (model_factory or model_for)(cfg, machines)
    res = ExploreResult(cfg)
    start = clock() if clock is not None else 0.0
    with _collector_paused():
        _search(model, cfg, res, progress, progress_every)
    if clock is not None:
        res.elapsed = clock() - start
    return res


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The search keeps every state it finds (keys, worlds waiting to be
    expanded) and makes no reference cycles: the cyclic garbage collector
    would only walk that growing heap again and again (a third of the run),
    and reference counting frees what the search drops without it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _search(model: Model, cfg: ExploreConfig, res: ExploreResult, progress: Callable[[SearchProgress], None] | None,
            progress_every: int) -> None:
    sym = cfg.symmetry
    # Every canonical state met (by the search or a drain) gets a number, so
    # that a key (a large nested tuple, hashed anew on every lookup) is
    # hashed once; the search's bookkeeping is by number.
    ids: dict[tuple, int] = {}
    w0 = model.initial()
    s0 = ids.setdefault(model.canon(w0, sym), 0)
    parent: dict[int, tuple[int, Move] | None] = {s0: None}  # state -> (parent, move) on a shortest path
    depth = {s0: 0}
    frontier = deque([(w0, s0)])
    drain_ok: set[int] = set()
    found_kinds: set = set()

    def trace(s: int) -> list[Move]:
        moves = []
        step = parent[s]
        while step is not None:
            s, m = step
            moves.append(m)
            step = parent[s]
        return moves[::-1]

    def report(kind, message, moves) -> bool:
        if kind in found_kinds:
            return False
        found_kinds.add(kind)
        res.violations.append(_counterexample(model, kind, message, moves))
        return cfg.stop_at_first

    stop = False
    expanded = 0
    while frontier and not stop:
        w, s = frontier.popleft()
        ds = depth[s]
        expanded += 1
        if progress is not None and expanded % progress_every == 0:
            progress(SearchProgress(states=len(parent), expanded=expanded, transitions=res.transitions, depth=ds,
                                    frontier=len(frontier), violations=len(res.violations),
                                    max_depth=cfg.max_depth, max_states=cfg.max_states))
        if cfg.liveness and s not in drain_ok:
            bad = _drain(model, w, s, drain_ok, sym, ids, _Ahead(parent, ds, cfg.max_depth))
            res.drained += 1
            if bad is not None:
                kind, message, extra = bad
                if report(kind, message, trace(s) + extra):
                    break
        if ds >= cfg.max_depth:
            res.frontier_cut += 1
            continue
        ahead, w.ahead = w.ahead, None
        for m in model.moves(w):
            res.transitions += 1
            if ahead is not None and ahead[0] == m:
                _, w2, s2 = ahead
            else:
                w2 = w.clone()
                try:
                    model.apply(w2, m)
                except Found as f:
                    if report(f.kind, f.message, trace(s) + [m]):
                        stop = True
                        break
                    continue
                s2 = ids.setdefault(model.canon(w2, sym), len(ids))
            if s2 in parent:
                continue
            parent[s2] = (s, m)
            depth[s2] = ds + 1
            res.max_depth_reached = max(res.max_depth_reached, ds + 1)
            frontier.append((w2, s2))
            if len(parent) >= cfg.max_states:
                res.truncated = True
                stop = True
                break
    res.states = len(parent)


class _Ahead:
    """When a drain step may be kept for the search: the drain starts at the
    world being expanded, and a step's result is the successor the search
    would compute for the same move while the drain stays on worlds the
    search will expand (new states within the depth bound)."""

    __slots__ = ("parent", "depth", "max_depth")

    def __init__(self, parent: dict, depth: int, max_depth: int):
        self.parent = parent
        self.depth = depth
        self.max_depth = max_depth


def _drain(model: Model, w: World, s: int, drain_ok: set[int], sym: bool, ids: dict[tuple, int],
           keep: _Ahead | None = None):
    """Run the fault-free continuation from state number ``s`` (``ids``
    numbers the states met); None when it ends clean, else (kind, message,
    moves).  Every state on a clean drain is memoized in ``drain_ok``.

    With ``keep``, the steps from worlds the search will expand are applied
    to copies and kept on the world they start from (``World.ahead``), so
    the search does not apply them again; past that the drain works on one
    copy in place."""
    path = [s]
    moves: list[Move] = []
    depth = keep.depth if keep is not None else 0
    # ``w`` is shared with the search while the drain keeps its steps.
    keeping = keep is not None and depth < keep.max_depth
    if not keeping:
        w = w.clone()
    for _ in range(model.cfg.drain_limit):
        m = model.drain_move(w)
        if m is None:
            problems = model.quiescent_problems(w)
            if problems:
                return "liveness", "; ".join(problems), moves
            drain_ok.update(path)
            return None
        moves.append(m)
        src = w
        if keeping:
            w = w.clone()
        try:
            model.apply(w, m)
        except Found as f:
            return f.kind, f.message + " (during the fault-free drain)", moves
        s2 = ids.setdefault(model.canon(w, sym), len(ids))
        if keeping:
            assert keep is not None
            src.ahead = (m, w, s2)
            depth += 1
            keeping = depth < keep.max_depth and s2 not in keep.parent
            if not keeping:
                w = w.clone()  # kept for the search: the rest of the drain works on a copy
        if s2 in drain_ok:
            drain_ok.update(path)
            return None
        path.append(s2)
    return "liveness", f"no quiescence within {model.cfg.drain_limit} fault-free steps", moves


def _counterexample(model: Model, kind: str, message: str, moves: list[Move]) -> Violation:
    """Re-execute the moves on fresh planes with recorders: readable steps and logs."""
    w = model.initial(record=True)
    recorders = {n: cast(MemoryLog, p.recorder) for n, p in w.planes.items()}  # record=True gave each one
    labels = []
    for m in moves:
        labels.append(model.describe(w, m))
        try:
            model.apply(w, m)
        except Found:
            break
    logs = {n: r.lines() for n, r in recorders.items()}
    return Violation(kind, message, labels, logs)
