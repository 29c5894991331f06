"""Replay an event log into a fresh ControlPlane.

How timers are replayed: a ``TimerFired`` line (machine or heartbeat
timer) is reproduced by calling ``fire_due(t)`` at the line's time, never
by feeding the event: the replayed plane decides itself which timers are
due, so a timer the recorded plane fired and the replayed one would not
(or the reverse) shows as a divergence instead of being forced.  Everything
``fire_due`` records (several firings) is matched, in order, against the
next log lines.  Lines of any other event are fed with ``handle(event, t)``.

- A recorded line (with state_after/actions) must be reproduced exactly:
  machine, state_before, state_after and actions.  The first difference is
  reported as a ``Divergence`` (seq, line, expected vs got), and replay stops.
  ``fire_due`` is only called where the log has a TimerFired line, exactly as
  the recorded plane was driven.
- A stimuli-only line advances time first (``fire_due(t)``), then is fed; a
  hand-written TimerFired line simply means "advance time to t".

The config comes from the argument, else the log's header line
(``{"v":1,"config":{...}}``), else the defaults.  The result summarizes
requests per final state, lease and engine counts, and the leak report
(``ControlPlane.held()`` at the end); a divergence or a leak fails it.
"""
from __future__ import annotations

import os
from collections import Counter, deque
from typing import Any, Callable, Iterable

import attrs

from .base import TimerFired
from .config import PlaneConfig
from .eventlog import EventLog, EventLogError, LogRecord, LogStream, action_json, read_log, same_actions
from .events import EngineAcquire, EngineRelease
from .machines import LOGGED_MACHINES
from .machines.heartbeat import KIND as HEARTBEAT
from .plane import ControlPlane
from .machine import Machine
from .lifecycle_counts import LifecycleCounts
from .observe import Observer, Step, observed
from .stats import PROTOCOL_VIOLATION, UNKNOWN_ID, UNKNOWN_KIND, Anomaly, Final

@attrs.define
class Divergence:
    seq: int
    line: int
    what: str  # "machine", "state_before", "state_after", "actions", "event", "missing", "extra"
    expected: Any
    got: Any

    def __str__(self) -> str:
        return f"seq {self.seq} (line {self.line}): {self.what} differs: expected {self.expected!r}, got {self.got!r}"


@attrs.define
class ReplayResult:
    lines: int = 0
    recorded_lines: int = 0
    config: PlaneConfig | None = None
    divergence: Divergence | None = None
    requests: Counter = attrs.Factory(Counter)  # decode_request final (or current) state -> count
    leases: Counter = attrs.Factory(Counter)  # granted / extended / expired / released
    engines_evicted: int = 0
    # Each eviction: {"engine", "at", "cause"} (lifecycle_counts.LifecycleCounts.evictions).
    evictions: list = attrs.Factory(list)
    held: list = attrs.Factory(list)  # the leak report: ControlPlane.held() at the end
    anomalies: Counter = attrs.Factory(Counter)  # stats.Anomaly -> count (unknown ids and kinds, violations)
    end_time: float | None = None
    plane: ControlPlane | None = None
    # A log without a config header that replays only under an older
    # version's defaults: which ones (LEGACY_DEFAULTS), else None.
    assumed: str | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None and not self.held


class _Counts:
    """Observer that tallies lease and engine lifecycles (``LifecycleCounts``,
    the same count the main job's summary makes) into the result."""

    KINDS = LifecycleCounts.KINDS  # the only kinds it counts

    def __init__(self, result: ReplayResult, chained: Observer | None):
        self.r = result
        self.counts = LifecycleCounts(leases=result.leases)
        self.chained = chained

    def __call__(self, step: Step) -> None:
        self.counts(step)
        if self.chained is not None:
            self.chained(step)


# The defaults of older versions, newest first, for a log without a config
# header (a header states the config; one lacking a key is read as from
# before that key, eventlog.parse_config).  Such a log replays under today's
# defaults, else under the first of these it reproduces exactly.
LEGACY_DEFAULTS: tuple[tuple[str, PlaneConfig], ...] = (
    ("heartbeats in lockstep (before heartbeat_spread)", PlaneConfig(heartbeat_spread=False)),
    ("heartbeats in lockstep, engines STALE at engine_ttl (before engine_stale_after, 5a6f572)",
     PlaneConfig(heartbeat_spread=False, engine_stale_after=PlaneConfig().engine_ttl)),
)


def _rereadable(source) -> bool:
    return isinstance(source, (str, os.PathLike, EventLog, list, tuple))


def _legacy_replay(source, machines, until) -> ReplayResult | None:
    """A header-less log's replay under the first older defaults it
    reproduces exactly (no observer: a probe), or None."""
    for why, cfg in LEGACY_DEFAULTS:
        r = replay(source, cfg, machines=machines, until=until)
        if r.divergence is None:
            r.assumed = why
            return r
    return None


def replay(source, config: PlaneConfig | None = None, *, machines: dict[str, Machine] | None = None,
           observer: Observer | None = None, before_line: Callable[[LogRecord, ControlPlane], None] | None = None,
           until: float | None = None) -> ReplayResult:
    """Replay ``source`` (a path, an open file, an iterable of lines, or an
    ``EventLog``).  ``until`` advances time after the last line (to see what
    timers would still release).  Raises ``EventLogError`` on bad input,
    the first bad line of the whole log, as ``read_log`` does."""
    stream = None
    records: Iterable[LogRecord]
    if isinstance(source, EventLog):
        records, log_config = source.records, source.config
    elif observer is None and before_line is None:
        # Nobody sees a line before the log is known good, so the log can be
        # read as it is replayed: a bad line still raises (``check_rest``
        # reads what a divergence leaves), and nothing is held in memory.
        stream = LogStream(source)
        records, log_config = stream, stream.config
    else:
        source = read_log(source)
        records, log_config = source.records, source.config
    if stream is None and config is None and log_config is None and (observer is not None or before_line is not None):
        # A header-less log whose observer must see one replay only: its
        # config is chosen first, by a probe.
        probe = replay(source, machines=machines, until=until)
        if probe.assumed is not None:
            config = probe.config
    cfg = config or log_config or PlaneConfig()
    result = ReplayResult(config=cfg)
    counts = _Counts(result, observer)
    table = dict(machines or LOGGED_MACHINES)
    # Observing a transition costs a Step: without a caller's observer only
    # the kinds the counts read are observed.
    watched = table if observer is not None else {k: m for k, m in table.items() if k in _Counts.KINDS}
    plane = ControlPlane(cfg, machines={**table, **observed(watched, counts)})
    produced: deque = deque()
    plane.recorder = produced.append
    result.plane = plane

    try:
        _replay_records(records, plane, produced, result, before_line)
    except EventLogError:
        raise  # the stream's: the first bad line
    except Exception:
        if stream is not None:
            stream.check_rest()  # a bad line further on is the error, as when the log was read first
        raise
    if stream is not None:
        stream.check_rest()  # what a divergence left unread: a bad line there still fails the log
    if until is not None and result.divergence is None:
        plane.recorder = None
        plane.fire_due(until)
        result.end_time = until
    result.engines_evicted = counts.counts.engines_evicted
    result.evictions = counts.counts.evictions
    _summarize(result, plane)
    if (result.divergence is not None and config is None and log_config is None and observer is None
            and before_line is None and _rereadable(source)):
        legacy = _legacy_replay(source, machines, until)
        if legacy is not None:
            return legacy
    elif config is not None and log_config is None:
        result.assumed = next((why for why, cfg in LEGACY_DEFAULTS if cfg == config), None)
    return result


def _replay_records(records: Iterable[LogRecord], plane: ControlPlane, produced: deque, result: ReplayResult,
                    before_line: Callable[[LogRecord, ControlPlane], None] | None) -> None:
    """Feed or match each record; stops at the first divergence (in ``result``)."""
    for rec in records:
        if before_line is not None:
            before_line(rec, plane)
        result.lines += 1
        result.end_time = rec.t
        if rec.recorded:
            result.recorded_lines += 1
            if _old_batcher_reference(rec):
                continue
            if not produced and type(rec.event) is TimerFired:
                plane.fire_due(rec.t)
                if not produced:
                    result.divergence = Divergence(rec.seq, rec.line, "missing", _describe(rec),
                                                   "no timer due at this time in replay")
                    break
            if produced:
                # This line was caused by fire_due: match it, do not feed it.
                got = produced.popleft()
                if got.event != rec.event:
                    result.divergence = Divergence(rec.seq, rec.line, "event", _describe(rec),
                                                   f"{type(got.event).__name__} {got.event!r} at {got.now}")
                    break
            else:
                plane.handle(rec.event, rec.t)
                got = produced.popleft()
            div = _compare(rec, got)
            if div is not None:
                result.divergence = div
                break
        else:
            if produced:
                # A recorded line's fire_due produced more than the log holds.
                got = produced[0]
                result.divergence = Divergence(rec.seq, rec.line, "extra", _describe(rec), _produced(got))
                break
            plane.fire_due(rec.t)
            if type(rec.event) is not TimerFired:
                plane.handle(rec.event, rec.t)
            produced.clear()
    else:
        if produced and result.divergence is None:
            got = produced[0]
            result.divergence = Divergence(-1, -1, "extra", "end of log", _produced(got))


def _old_batcher_reference(rec: LogRecord) -> bool:
    """A line of a log from before the heartbeat batcher was a machine: it
    took and dropped its engine reference through lines of their own, which
    the heartbeat line (matched without states, see _compare) now covers."""
    return (isinstance(rec.event, (EngineAcquire, EngineRelease)) and rec.event.requester_kind == HEARTBEAT
            and rec.state_before is not None)


def _describe(rec: LogRecord) -> str:
    return f"{rec.machine or '?'} {type(rec.event).__name__} {rec.data}"


def _produced(step: Step) -> str:
    return f"{step.machine} {type(step.event).__name__} at {step.now}"


def _compare(rec: LogRecord, got: Step) -> Divergence | None:
    label, before, after, actions = got.machine, got.state_before, got.state_after, got.actions
    if rec.state_before is None and rec.state_after is None and before is not None and got.kind == HEARTBEAT:
        # A log from before the heartbeat batcher was a machine: no states, and
        # its engine reference on lines of their own (fed next): what it sent.
        before = after = None
        actions = [a for a in actions if type(a).__name__ == "SendHeartbeat"]
    if rec.machine is not None and rec.machine != label:
        return Divergence(rec.seq, rec.line, "machine", rec.machine, label)
    if rec.state_before != before:
        return Divergence(rec.seq, rec.line, "state_before", rec.state_before, before)
    if rec.state_after != after:
        return Divergence(rec.seq, rec.line, "state_after", rec.state_after, after)
    if rec.actions is not None and not same_actions(rec.actions, actions):
        return Divergence(rec.seq, rec.line, "actions", rec.actions, action_json(actions))
    return None


def _summarize(result: ReplayResult, plane: ControlPlane) -> None:
    for key, n in plane.stats.items():
        if isinstance(key, Final) and key.kind == "decode_request":
            result.requests[key.state] += n
        elif isinstance(key, Anomaly) and key.what in (UNKNOWN_ID, UNKNOWN_KIND, PROTOCOL_VIOLATION):
            result.anomalies[key] += n
    for inst in plane.instances.get("decode_request", {}).values():
        result.requests[inst.state] += 1
    result.held = plane.held()
