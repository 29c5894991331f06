"""One observer protocol: every observer is a callable taking a ``Step``.

Two places produce steps.  Each of the ControlPlane's ``observers``
(``plane.observe(obs)``; its ``recorder`` is the event log's, one of them)
sees one step per top-level stimulus (the event log writes one line per
step, replay compares them; a worker learns why recvs failed; a tally
counts), built once for all of them.  An observer with a ``capture(stimulus,
out)`` method (the event log's writer) is handed each stimulus as the plane
kept it instead (``Stimulus``),
without a Step: building one, and its timer action, was most of what
recording cost the plane; the writer encodes the line from the parts later,
in the order ``stimulus_actions`` gives.  ``observed`` wraps compiled
machines (or reference interpreters) so that an observer also sees every
transition, cascaded ones included (replay's lifecycle counts, the liveness
monitors); those steps carry the instance and its deadline before the
transition.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs

from .base import Action, Event
from .machine import timer_action


# Not frozen: one is built per recorded stimulus on the hot path, and a
# frozen attrs class costs about three times as much to build.  Observers
# read steps; none may change one.
@attrs.define(slots=True)
class Step:
    event: Event
    now: float
    kind: str  # the machine kind (or the heartbeat timer's)
    key: Any  # the machine instance's id
    # None when no instance handled the event (refused, unknown kind, a
    # heartbeat timer): the log line then has no states.
    state_before: str | None
    state_after: str | None
    actions: Sequence[Action]
    # Transition steps (``observed``) only: the instance and its deadline
    # before the transition (the instance itself holds the new one).
    deadline_before: float | None = None
    instance: Any = None

    @property
    def machine(self) -> str:
        """The event log's ``machine`` field: ``"<kind>:<id>"``."""
        return f"{self.kind}:{self.key}"


Observer = Callable[[Step], None]


class CaptureObserver:
    """An observer given as two functions: ``capture(stimulus, out)``, which
    the plane hands each stimulus as it kept it (``Stimulus``; ``out`` its
    external actions, the cascade's included, or None), so that no Step is
    built for it; and ``step(step)``, for the Steps the plane builds itself
    (a refused stimulus, which no instance handled).  An observer that only
    reads the stimulus's external actions needs no Step: they are ``out``."""

    __slots__ = ("capture", "step")

    def __init__(self, capture: Callable[[Stimulus, Sequence[Action] | None], None], step: Observer):
        self.capture = capture
        self.step = step

    def __call__(self, step: Step) -> None:
        self.step(step)


class ObservedMachine:
    """A machine (compiled or reference) that reports every ``apply`` and
    ``handle`` to an observer; everything else is the wrapped machine's.
    ``wrap``: applied once to what reports a transition (building its Step
    and calling the observer), e.g. to time that apart from the machine's
    own work (``kvplane run``'s ``PlaneCpu.apart``)."""

    # The plane reads these on every dispatch: copied, not forwarded by
    # ``__getattr__`` (a slot left unset, as for a machine without one, forwards).
    _COPIED = ("name", "spec", "terminal_states", "new")
    __slots__ = ("inner", "observer", "_report", *_COPIED)

    def __init__(self, inner: Any, observer: Observer, wrap: Callable[[Callable], Callable] | None = None):
        self.inner = inner
        self.observer = observer
        self._report = self._step if wrap is None else wrap(self._step)
        for name in self._COPIED:
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def _step(self, inst: Any, event: Event, now: float, before: str, acts: Any, deadline: float | None) -> None:
        self.observer(Step(event, now, self.inner.name, inst.key, before, inst.state, acts, deadline, inst))

    def apply(self, inst, event, config, now):
        before, deadline = inst.state, inst.deadline
        acts = self.inner.apply(inst, event, config, now)
        self._report(inst, event, now, before, acts, deadline)
        return acts

    def handle(self, inst, event, config, now):
        before, deadline = inst.state, inst.deadline
        acts = self.inner.handle(inst, event, config, now)
        self._report(inst, event, now, before, acts, deadline)
        return acts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def observed(machines: dict[str, Any], observer: Observer,
             wrap: Callable[[Callable], Callable] | None = None) -> dict[str, Any]:
    # Any: an ObservedMachine stands in for the Machine it wraps (the plane's
    # ``machines``), forwarding what it does not observe.
    return {kind: ObservedMachine(m, observer, wrap) for kind, m in machines.items()}


# One top-level stimulus as the plane keeps it while its cascade runs (a
# plain tuple: one is built per recorded stimulus): event, now, kind, key,
# state before, state after, the addressed machine's own actions, its
# deadline before and after.
Stimulus = tuple[Event, float, str, Any, "str | None", "str | None", Sequence[Action], "float | None", "float | None"]


def stimulus_actions(stimulus: Stimulus, out: Sequence[Action] | None) -> Sequence[Action]:
    """The actions of a stimulus's log line: the addressed machine's own, its
    timer's, then the external effects of the internal events they set off
    (``cascade_effects``), so replay also checks what other machines did.
    ``out`` is the plane's output for the stimulus (None: nothing, or no
    cascade); it starts with the externals of the stimulus's own actions.
    Without a cascade or a timer change the machine's own list is returned
    (a step is read-only).  The event log's encoder follows the same order."""
    _, _, kind, key, _, _, acts, old_deadline, deadline = stimulus
    timer = timer_action(kind, key, old_deadline, deadline) if deadline != old_deadline else None
    effects = cascade_effects(acts, out) if out else ()
    if timer is not None:
        return [*acts, timer, *effects]
    return [*acts, *effects] if effects else acts


def cascade_effects(acts: Sequence[Action], out: Sequence[Action]) -> Sequence[Action]:
    """What the internal events set off by ``acts`` added to the world's
    actions: ``out`` (the plane's output after the cascade) starts with the
    externals of ``acts``, the cascade's follow."""
    own_out = 0
    for a in acts:
        if not a.internal:
            own_out += 1
    return out[own_out:]


def stimulus_step(stimulus: Stimulus, out: Sequence[Action] | None) -> Step:
    """The Step a recorder without ``capture`` sees; ``out`` as for ``stimulus_actions``."""
    event, now, kind, key, before, after, _, _, _ = stimulus
    return Step(event, now, kind, key, before, after, stimulus_actions(stimulus, out))
