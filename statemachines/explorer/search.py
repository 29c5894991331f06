"""Breadth-first search over the model, liveness drains, counterexamples.

No I/O and no clock reads: writing a counterexample's logs is the caller's
(``Violation.logs`` holds them), and so is timing, unless a ``clock`` is
passed in; a ``progress`` callback gets counts only (``SearchProgress``),
so the caller computes rates with its own clock.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, cast

import attrs

from ..eventlog import MemoryLog
from ..machine import Machine
from .checks import Found
from .config import ExploreConfig
from .model import Model
from .ranks import model_for
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
    ``ranks.model_for``: one plane a side, or one per rank with ``ranks``).
    Violations carry the shortest move sequence and replayable logs.
    ``clock`` (e.g. ``time.perf_counter``) times the run into ``elapsed``.
    ``progress`` is called every ``progress_every`` expanded states with a
    ``SearchProgress``.
    """
    cfg = attrs.evolve(config or ExploreConfig(), **overrides)
    model = (model_factory or model_for)(cfg, machines)
    res = ExploreResult(cfg)
    start = clock() if clock is not None else 0.0
    sym = cfg.symmetry
    w0 = model.initial()
    k0 = model.canon(w0, sym)
    parent: dict = {k0: None}  # canonical state -> (parent state, move) on a shortest path
    depth = {k0: 0}
    frontier = deque([(w0, k0)])
    drain_ok: set = set()
    found_kinds: set = set()

    def trace(k) -> list[Move]:
        moves = []
        while parent[k] is not None:
            k, m = parent[k]
            moves.append(m)
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
        w, k = frontier.popleft()
        dk = depth[k]
        expanded += 1
        if progress is not None and expanded % progress_every == 0:
            progress(SearchProgress(states=len(parent), expanded=expanded, transitions=res.transitions, depth=dk,
                                    frontier=len(frontier), violations=len(res.violations),
                                    max_depth=cfg.max_depth, max_states=cfg.max_states))
        if cfg.liveness and k not in drain_ok:
            bad = _drain(model, w, k, drain_ok, sym)
            res.drained += 1
            if bad is not None:
                kind, message, extra = bad
                if report(kind, message, trace(k) + extra):
                    break
        if dk >= cfg.max_depth:
            res.frontier_cut += 1
            continue
        for m in model.moves(w):
            w2 = w.clone()
            res.transitions += 1
            try:
                model.apply(w2, m)
            except Found as f:
                if report(f.kind, f.message, trace(k) + [m]):
                    stop = True
                    break
                continue
            k2 = model.canon(w2, sym)
            if k2 in parent:
                continue
            parent[k2] = (k, m)
            depth[k2] = dk + 1
            res.max_depth_reached = max(res.max_depth_reached, dk + 1)
            frontier.append((w2, k2))
            if len(parent) >= cfg.max_states:
                res.truncated = True
                stop = True
                break
    res.states = len(parent)
    if clock is not None:
        res.elapsed = clock() - start
    return res


def _drain(model: Model, w: World, k, drain_ok: set, sym: bool):
    """Run the fault-free continuation; None when it ends clean, else
    (kind, message, moves).  Every state on a clean drain is memoized."""
    w = w.clone()
    path_keys = [k]
    moves: list[Move] = []
    for _ in range(model.cfg.drain_limit):
        m = model.drain_move(w)
        if m is None:
            problems = model.quiescent_problems(w)
            if problems:
                return "liveness", "; ".join(problems), moves
            drain_ok.update(path_keys)
            return None
        moves.append(m)
        try:
            model.apply(w, m)
        except Found as f:
            return f.kind, f.message + " (during the fault-free drain)", moves
        k2 = model.canon(w, sym)
        if k2 in drain_ok:
            drain_ok.update(path_keys)
            return None
        path_keys.append(k2)
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
