"""The JSONL event log: one stimulus a line, versioned.

Format (ARCHITECTURE.md, "Event log")::

    {"v":1,"config":{...}}                                   optional header
    {"v":1,"seq":N,"t":now,"machine":"kind:id","event":"Name","data":{...},
     "state_before":"...","state_after":"...","actions":[["Name",{...}],...]}

- ``data`` and each action's dict are the attrs fields of the object; tuples
  become JSON lists and are restored by the class's attrs converters on load
  (nested lists, for a field without a converter, become tuples again).
- ``state_before``/``state_after`` are null for a stimulus that reached no
  instance (unknown id); ``actions`` are the ones the addressed machine
  emitted, internal ones (ArmTimer, AcquireEngine...) included.
- Timer firings are stimuli too: ``TimerFired`` lines, including heartbeat
  timers (``machine`` "heartbeat:<engine>", no states, the SendHeartbeat as
  action).  Replay reproduces them by calling ``fire_due`` (see replay.py).
- A stimuli-only line omits state_before/state_after/actions; ``seq`` and
  ``machine`` may be omitted in hand-written logs.
- The header records the PlaneConfig the log was made under.

Recording is cheap enough to leave on: the recorder only appends the
(immutable) event, the states and the action list to a buffer; ``flush``
serializes.  All file I/O of ``statemachines`` lives in this module and
takes paths or streams explicitly.
"""
from __future__ import annotations

import io
import json
import os
from typing import Any, Iterable, Iterator, TextIO

import attrs

from .actions import ALL_ACTIONS
from .base import ArmTimer, CancelTimer, Event
from .config import PlaneConfig
from .events import ALL_EVENTS

LOG_VERSION = 1

# Every action class, internal timer actions included, by name.
ACTION_TYPES: dict[str, type] = {**ALL_ACTIONS, "ArmTimer": ArmTimer, "CancelTimer": CancelTimer}


class EventLogError(ValueError):
    """A log that cannot be read; ``line`` is the 1-based line number."""

    def __init__(self, line: int, message: str):
        self.line = line
        self.message = message
        super().__init__(f"line {line}: {message}")


class MalformedLine(EventLogError):
    """Not JSON, not an object, or a required field missing or of the wrong type."""


class UnknownEvent(EventLogError):
    """An event (or action) name this version does not define, or fields it does not have."""


class UnsupportedVersion(EventLogError):
    """A ``v`` other than the one this reader understands."""


# ------------------------------------------------------------------ encoding
_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(a.name for a in attrs.fields(cls))
    return names


def fields_of(obj: Any) -> dict:
    """The attrs fields of an event or action as a dict (values not copied)."""
    return {n: getattr(obj, n) for n in _field_names(type(obj))}


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"not serializable in the event log: {value!r}")


def action_json(actions: Iterable) -> list:
    """Actions as ``[[name, {fields}], ...]`` with JSON types (tuples as lists)."""
    return [[type(a).__name__, _plain(fields_of(a))] for a in actions]


def _plain(value: Any) -> Any:
    # The JSON round trip, without the string: what a loaded line compares equal to.
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    return value


def encode(seq: int, event: Event, now: float, label: str, before: str | None, after: str | None,
           actions: Iterable | None) -> str:
    """One log line (no newline).  ``actions`` None writes a stimuli-only line."""
    rec = {"v": LOG_VERSION, "seq": seq, "t": now, "machine": label, "event": type(event).__name__,
           "data": fields_of(event)}
    if actions is not None:
        rec["state_before"] = before
        rec["state_after"] = after
        rec["actions"] = [[type(a).__name__, fields_of(a)] for a in actions]
    return json.dumps(rec, separators=(",", ":"), default=_json_default)


def header(config: PlaneConfig) -> str:
    return json.dumps({"v": LOG_VERSION, "config": attrs.asdict(config)}, separators=(",", ":"))


class EventLogWriter:
    """A ControlPlane recorder writing JSONL.

    ``plane.recorder = writer`` (or ``EventLogWriter.attach``).  Each call
    appends a tuple to a buffer; ``flush()`` serializes it to the stream
    (automatically every ``flush_every`` records).  ``stimuli_only`` drops
    states and actions.
    """

    def __init__(self, stream: TextIO, *, config: PlaneConfig | None = None, flush_every: int = 4096,
                 stimuli_only: bool = False):
        self.stream = stream
        self.flush_every = flush_every
        self.stimuli_only = stimuli_only
        self.seq = 0
        self._buf: list = []
        if config is not None:
            stream.write(header(config) + "\n")

    @classmethod
    def attach(cls, plane, stream: TextIO, **kw) -> "EventLogWriter":
        writer = cls(stream, config=plane.config, **kw)
        plane.recorder = writer
        return writer

    def __call__(self, event, now, label, before, after, actions) -> None:
        buf = self._buf
        buf.append((event, now, label, before, after, actions))
        if len(buf) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        buf, self._buf = self._buf, []
        seq = self.seq
        only = self.stimuli_only
        lines = []
        for event, now, label, before, after, actions in buf:
            seq += 1
            lines.append(encode(seq, event, now, label, before, after, None if only else actions))
        self.seq = seq
        if lines:
            self.stream.write("\n".join(lines) + "\n")
        self.stream.flush() if hasattr(self.stream, "flush") else None

    def close(self) -> None:
        self.flush()


def record_to_path(plane, path: str | os.PathLike, **kw) -> tuple[EventLogWriter, TextIO]:
    """Open ``path`` and attach a writer; the caller closes the stream after ``writer.flush()``."""
    stream = open(path, "w", encoding="utf-8")
    return EventLogWriter.attach(plane, stream, **kw), stream


class MemoryLog(EventLogWriter):
    """A writer into memory, for tests and the explorer's counterexamples."""

    def __init__(self, **kw):
        super().__init__(io.StringIO(), **kw)

    def lines(self) -> list[str]:
        self.flush()
        return self.stream.getvalue().splitlines()


# ------------------------------------------------------------------ decoding
@attrs.frozen
class LogRecord:
    line: int
    seq: int
    t: float
    machine: str | None
    event: Event
    data: dict
    # Present only on recorded lines; None where the line omits it.
    recorded: bool = False
    state_before: str | None = None
    state_after: str | None = None
    actions: list | None = None


@attrs.frozen
class EventLog:
    config: PlaneConfig | None
    records: tuple[LogRecord, ...]


def _tuplify(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    return value


def build(registry: dict[str, type], name: str, data: dict, line: int, what: str) -> Any:
    cls = registry.get(name)
    if cls is None:
        raise UnknownEvent(line, f"unknown {what} {name!r}")
    if not isinstance(data, dict):
        raise MalformedLine(line, f"{what} data must be an object, got {type(data).__name__}")
    kwargs = {}
    for a in attrs.fields(cls):
        if a.name in data:
            v = data[a.name]
            # A converter restores its own tuples; elsewhere lists were tuples.
            kwargs[a.name] = v if a.converter is not None else _tuplify(v)
    extra = set(data) - set(kwargs)
    if extra:
        raise UnknownEvent(line, f"{what} {name} has no field(s) {sorted(extra)}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise MalformedLine(line, f"bad {what} {name} data: {exc}") from None


def _iter_lines(source) -> Iterator[str]:
    if isinstance(source, (str, os.PathLike)):
        with open(source, encoding="utf-8") as f:
            yield from f
    else:
        yield from source


def parse_config(obj: Any, line: int) -> PlaneConfig:
    if not isinstance(obj, dict):
        raise MalformedLine(line, "config must be an object")
    try:
        return PlaneConfig(**obj)
    except (TypeError, ValueError) as exc:
        raise MalformedLine(line, f"bad config: {exc}") from None


def parse_line(text: str, line: int) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedLine(line, f"not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise MalformedLine(line, "a log line must be a JSON object")
    v = obj.get("v")
    if v != LOG_VERSION:
        if isinstance(v, int) and not isinstance(v, bool):
            raise UnsupportedVersion(line, f"log version {v} (this reader understands {LOG_VERSION})")
        raise MalformedLine(line, f"missing or invalid version 'v': {v!r}")
    return obj


def read_log(source) -> EventLog:
    """Parse a log from a path, an open file or an iterable of lines.

    Raises an ``EventLogError`` subclass naming the first bad line.
    """
    config = None
    records: list[LogRecord] = []
    last_t = float("-inf")
    for n, text in enumerate(_iter_lines(source), start=1):
        if not text.strip():
            continue
        obj = parse_line(text, n)
        if "config" in obj and "event" not in obj:
            if records or config is not None:
                raise MalformedLine(n, "the config header must be the first line")
            config = parse_config(obj["config"], n)
            continue
        name = obj.get("event")
        if not isinstance(name, str):
            raise MalformedLine(n, "missing 'event'")
        t = obj.get("t")
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise MalformedLine(n, f"missing or non-numeric time 't': {t!r}")
        if t < last_t:
            raise MalformedLine(n, f"time goes backwards ({t} after {last_t})")
        last_t = t
        seq = obj.get("seq", n)
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise MalformedLine(n, f"non-integer 'seq': {seq!r}")
        data = obj.get("data", {})
        event = build(ALL_EVENTS, name, data, n, "event")
        recorded = "state_after" in obj or "actions" in obj
        actions = obj.get("actions")
        if recorded:
            if not isinstance(actions, list) or not all(
                isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], dict)
                for a in actions
            ):
                raise MalformedLine(n, "'actions' must be a list of [name, {fields}]")
            for a_name, a_data in actions:
                build(ACTION_TYPES, a_name, a_data, n, "action")  # validates names and fields
        machine = obj.get("machine")
        if machine is not None and not isinstance(machine, str):
            raise MalformedLine(n, "'machine' must be a string")
        records.append(LogRecord(n, seq, float(t), machine, event, data, recorded,
                                 obj.get("state_before"), obj.get("state_after"), actions))
    return EventLog(config, tuple(records))
