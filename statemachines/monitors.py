"""Liveness monitors over an event log (hot/cold, as in the P language).

An obligation is hot while a machine instance sits in a state that holds
the resource, and is discharged when the instance leaves every state that
holds it.  The obligations are derived from the machines' declared
``State.holds`` (so a new resource is monitored without touching this
file), minus ``COLD`` resources, which no party waits on: a connected
engine may stay connected for as long as it is used.

Reported: every obligation still hot at the end of the log, and every one
that was still hot after its instance's deadline had passed (a timer that
the embedder did not fire on time, or a state that has no timer at all is
reported at the end).  The log is replayed into a fresh plane (see
``replay``) and every transition, cascaded ones included, is observed.
"""
from __future__ import annotations

import heapq
import math
from typing import Any

import attrs

from .config import PlaneConfig
from .eventlog import EventLog, read_log
from .machines import LOGGED_MACHINES
from .replay import ReplayResult, replay
from .machine import Machine
from .observe import Step

# Held, but nobody waits for their release.
COLD = frozenset({"remote_agent"})
# Machines whose resources nobody waits on: a heartbeat batch holds its
# engine while requests' heartbeats flow, and those are hot themselves.
COLD_KINDS = frozenset({"heartbeat"})


def obligations(machines: dict[str, Machine] | None = None) -> dict[str, dict[str, frozenset[str]]]:
    """kind -> state -> hot resources held there (from the specs' ``holds``)."""
    out: dict[str, dict[str, frozenset[str]]] = {}
    for kind, m in (machines or LOGGED_MACHINES).items():
        if kind in COLD_KINDS:
            continue
        out[kind] = {s.name: frozenset(s.holds) - COLD for s in m.spec.states if frozenset(s.holds) - COLD}
    return out


@attrs.frozen
class HotObligation:
    kind: str
    key: Any
    resource: str
    state: str  # where it was when reported
    since: float  # when it became hot
    deadline: float | None
    reason: str  # "end_of_log" | "past_deadline"
    at: float  # time of the report (end of log, or the first line after the deadline)

    def __str__(self) -> str:
        dl = "no deadline" if self.deadline is None else f"deadline {self.deadline:g}"
        return (f"{self.kind}:{self.key} holds {self.resource!r} in {self.state} since t={self.since:g} "
                f"({dl}): {self.reason.replace('_', ' ')} at t={self.at:g}")


@attrs.define
class MonitorReport:
    lines: int = 0
    end_time: float | None = None
    hot: list[HotObligation] = attrs.Factory(list)
    discharged: int = 0
    replay: ReplayResult | None = None

    @property
    def divergence(self):
        """Where the replay stopped agreeing with the recorded log, or None."""
        return None if self.replay is None else self.replay.divergence

    @property
    def ok(self) -> bool:
        # A recorded log the machines do not reproduce is not the run the
        # monitors watched (they saw the replay): such a log fails.
        return not self.hot and self.divergence is None


# A live run polls its timers, so a deadline fires a little after it is due;
# only an obligation still hot this long past its deadline is reported.
DEFAULT_GRACE = 0.5


class LivenessMonitor:
    """Observer for ``replay``: tracks hot obligations per instance."""

    def __init__(self, machines: dict[str, Machine] | None = None, grace: float = DEFAULT_GRACE):
        # A NaN grace would make every "past deadline" comparison false.
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < math.inf:
            raise ValueError(f"grace must be a finite number >= 0, got {grace!r}")
        self.hot_states = obligations(machines)
        self.grace = grace
        # (kind, key) -> (instance, {hot resource: since})
        self.live: dict[tuple, tuple] = {}
        self.discharged = 0
        self.overdue: list[HotObligation] = []
        self._reported: set = set()
        self._deadlines: list = []  # heap of (deadline, kind, key), validated lazily

    def __call__(self, step: Step) -> None:
        kind, inst, now = step.kind, step.instance, step.now
        key = (kind, inst.key)
        hot = self.hot_states.get(kind, {}).get(inst.state, frozenset())
        prev = self.live.get(key)
        if prev is not None and prev[0] is not inst:
            prev = None  # a new incarnation under the same id
        if not hot:
            if prev is not None:
                self.discharged += len(prev[1])
                del self.live[key]
            return
        if prev is None:
            self.live[key] = (inst, {r: now for r in hot})
        elif prev[1].keys() != hot:
            since = prev[1]
            self.discharged += len(since.keys() - hot)
            self.live[key] = (inst, {r: since.get(r, now) for r in hot})
        if inst.deadline is not None:
            heapq.heappush(self._deadlines, (inst.deadline, kind, inst.key))

    def check_time(self, now: float) -> None:
        """Report obligations still hot more than ``grace`` after their deadline."""
        heap = self._deadlines
        while heap and heap[0][0] + self.grace < now:
            deadline, kind, key = heapq.heappop(heap)
            entry = self.live.get((kind, key))
            if entry is None:
                continue
            inst, hot = entry
            if inst.deadline != deadline:
                continue  # moved since (re-armed)
            tag = (kind, key, deadline)
            if tag in self._reported:
                continue
            self._reported.add(tag)
            for r in sorted(hot):
                self.overdue.append(HotObligation(kind, key, r, inst.state, hot[r], deadline, "past_deadline", now))

    def at_end(self, now: float) -> list[HotObligation]:
        out = list(self.overdue)
        for (kind, key), (inst, hot) in sorted(self.live.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            for r in sorted(hot):
                out.append(HotObligation(kind, key, r, inst.state, hot[r], inst.deadline, "end_of_log", now))
        return out


def check_log(source, config: PlaneConfig | None = None, *, machines: dict[str, Machine] | None = None,
              until: float | None = None, grace: float = DEFAULT_GRACE) -> MonitorReport:
    """Run the liveness monitors over a log (recorded or stimuli-only).

    Raises ``EventLogError`` on bad input, ValueError on a bad ``grace``.
    A replay divergence is kept in ``report.replay`` (the monitors still
    report what was seen up to it) and fails the report.
    """
    log = source if isinstance(source, EventLog) else read_log(source)
    mon = LivenessMonitor(machines, grace)
    result = replay(log, config, machines=machines, observer=mon,
                    before_line=lambda rec, plane: mon.check_time(rec.t), until=until)
    end = result.end_time if result.end_time is not None else 0.0
    mon.check_time(until if until is not None else end)
    return MonitorReport(lines=result.lines, end_time=result.end_time, hot=mon.at_end(end),
                         discharged=mon.discharged, replay=result)
