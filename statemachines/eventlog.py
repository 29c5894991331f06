"""The JSONL event log: one stimulus a line, versioned.

Format (docs/event-logs.md)::

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
  batches (``machine`` "heartbeat:<engine>"; logs from before the batch was a
  machine have no states there).  Replay reproduces them by calling
  ``fire_due`` (see replay.py).
- A stimuli-only line omits state_before/state_after/actions; ``seq`` and
  ``machine`` may be omitted in hand-written logs.
- The header records the PlaneConfig the log was made under.

Recording is cheap enough to leave on: the plane hands the writer each
stimulus as it kept it (``observe.Stimulus``: no Step built), the writer
makes its line's record (a msgspec Struct holding the event and action
objects themselves, no dicts), encodes 32 records at a time in one msgspec
call (``json`` for a line holding a non-finite float, see "line encoding"),
and ``flush`` writes what was encoded.  Lines are the same JSON objects as
ever; only the text may differ from what ``json.dumps`` wrote (non-ASCII
characters as UTF-8, not ``\\u`` escapes; floats in their shortest form; the
keys of a mapping inside a value sorted, as a set's elements are), which every JSON reader,
this one included, reads as the same values.  ``read_log`` reads a whole
log into records; ``LogStream`` reads one as it is iterated, with the same
checks and errors (replay's way).  All file I/O of
``statemachines`` lives in this module and takes paths or streams explicitly.
"""
from __future__ import annotations

import io
import json
import math
import os
from typing import Any, Callable, Iterable, Iterator, Sequence, TextIO, TypeGuard

import attrs
import msgspec
import orjson

from .actions import ALL_ACTIONS
from .recv_failure import RecvFailure
from .base import Action, ArmTimer, CancelTimer, Event
from .base import fields as class_fields
from .base import runs_code_when_built
from .engine_calls import ENGINE_ACTIONS, ENGINE_EVENTS
from .config import PlaneConfig
from .events import ALL_EVENTS
from .machine import timer_action
from .observe import Step, Stimulus, cascade_effects, stimulus_actions

LOG_VERSION = 1

# Every action class, internal timer actions included, by name.
ACTION_TYPES: dict[str, type] = {**ALL_ACTIONS, **ENGINE_ACTIONS, "ArmTimer": ArmTimer, "CancelTimer": CancelTimer}
# Every event a line may name: the plane's, and the scheduler half's (engine_calls).
LOG_EVENTS: dict[str, type] = {**ALL_EVENTS, **ENGINE_EVENTS}


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
# What a line says about an object: its fields (``_field_names``), and whether
# each may hold a non-finite float (``_finite_check``); see "line encoding".
_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(a.name for a in class_fields(cls))
    return names


def _finite_check(name: str, options: tuple[str, ...]) -> Callable[[Any], bool] | None:
    """The finiteness check of a field's value, or None for a field that
    cannot hold a float (indices, strings, bools)."""
    if "tuple" in options:
        return None if _TUPLE_ELEMENTS.get(name) in (_INDEX, _STR) else _finite
    if set(options) <= {"str", "int", "bool", "None"}:
        return None
    if set(options) <= {"float", "int", "None"}:
        return _finite_number
    return _finite_or_str  # Any: mostly string ids


def _finite_number(v: Any) -> bool:
    return v.__class__ is not float or v - v == 0.0  # x - x is 0.0 for a finite float only


def _finite_or_str(v: Any) -> bool:
    return v.__class__ is str or _finite(v)


def _finite(v: Any) -> bool:
    if v.__class__ is float:
        return math.isfinite(v)
    if isinstance(v, (tuple, list)):
        return all(_finite(x) for x in v)
    return True


def action_json(actions: Iterable) -> list:
    """Actions as ``[[name, {fields}], ...]`` with JSON types (tuples as lists)."""
    plains = _PLAINS
    return [[a.__class__.__name__, (plains.get(a.__class__) or _plain_getter(a.__class__))(a)] for a in actions]


def same_actions(recorded: list, actions: Sequence) -> bool:
    """``recorded == action_json(actions)``, without building the lists; a
    field written only when set (``omit_defaults``) that a line lacks is not
    compared (a line written before the field existed: ``ReportRecv.reason``)."""
    if len(recorded) != len(actions):
        return False
    plains = _PLAINS
    for entry, a in zip(recorded, actions):
        cls = a.__class__
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == cls.__name__):
            return False
        written = (plains.get(cls) or _plain_getter(cls))(a)
        if entry[1] != written and not _same_but_unwritten(entry[1], written, cls):
            return False
    return True


def _same_but_unwritten(recorded: Any, written: dict, cls: type) -> bool:
    """Whether ``recorded`` is ``written`` less fields it may lack (see same_actions)."""
    unwritten = [n for n, _ in _omitted_defaults(cls) if n in written and n not in recorded] \
        if isinstance(recorded, dict) else []
    return bool(unwritten) and recorded == {k: v for k, v in written.items() if k not in unwritten}


_SCALARS = frozenset({str, int, float, bool, type(None)})
_PLAINS: dict[type, Callable[[Any], dict]] = {}


def _plain_getter(cls: type) -> Callable[[Any], dict]:
    """The fields dict of an instance of ``cls`` as its JSON round trip reads:
    scalars are taken as they are, anything else made plain; a Struct with
    ``omit_defaults`` leaves out the fields at their default, as it is written."""
    get = _PLAINS.get(cls)
    if get is None:
        names = _field_names(cls)
        omitted = _omitted_defaults(cls)

        def every_field(o: Any) -> dict:
            out = {}
            for n in names:
                v = getattr(o, n)
                out[n] = v if v.__class__ in _SCALARS else _plain(v)
            return out

        def written_fields(o: Any) -> dict:
            out = every_field(o)
            for n, default in omitted:
                if getattr(o, n) == default:
                    del out[n]
            return out

        get = _PLAINS[cls] = written_fields if omitted else every_field
    return get


_OMITTED: dict[type, tuple[tuple[str, Any], ...]] = {}


def _omitted_defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """(field, default) of each field msgspec leaves out at its default (a
    Struct with ``omit_defaults``: ``ReportRecv.reason``)."""
    omitted = _OMITTED.get(cls)
    if omitted is None:
        config = getattr(cls, "__struct_config__", None)
        omitted = _OMITTED[cls] = () if config is None or not config.omit_defaults else tuple(
            (a.name, a.default) for a in class_fields(cls) if a.default is not attrs.NOTHING)
    return omitted


def _plain(value: Any) -> Any:
    # The JSON round trip, without the string: what a loaded line compares equal to.
    cls = value.__class__
    if cls in _SCALARS:
        return value
    if cls is tuple or cls is list:
        return [v if v.__class__ in _SCALARS else _plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    return value


# ------------------------------------------------------------ line encoding
# msgspec writes every line in C from typed records: the line's keys in the
# format's order (the fields of ``_Line``), an event or action Struct as its
# fields in declared order, tuples as lists, sets sorted (``deterministic``),
# integers of any size.  It writes a non-finite float as null; a line whose
# event or actions may hold one is checked first (``_value``) and written by
# ``json`` (NaN, which the reader refuses: a log keeps saying what was
# recorded).  An attrs class is written through a Struct of its fields
# (``_mirror``): msgspec's own order for attrs classes is not the declared
# one, and ``deterministic`` would sort a dict's keys.


class _StimulusLine(msgspec.Struct, gc=False):
    """A stimuli-only line (gc=False: a line holds no cycle)."""

    v: int
    seq: int
    t: float
    machine: str
    event: str
    data: Any


class _Line(_StimulusLine, gc=False):
    """One log line with states and actions: a stimulus line's keys, then these."""

    state_before: str | None
    state_after: str | None
    actions: Any  # [(name, action value), ...]


_ENCODER = msgspec.json.Encoder(order="deterministic")


class _NotFinite(Exception):
    """Raised by a ``_value`` function: this line needs ``json``."""


# event or action class -> None (the object is written as it is: a Struct
# without a field that may hold a float), or a function from an instance to
# what is written, raising _NotFinite for a non-finite value.
_VALUES: dict[type, Any] = {}  # Callable[[Any], Any] | None; Any: read with an _UNSEEN default
_UNSEEN = object()


def _value(cls: type) -> Callable[[Any], Any] | None:
    """Make and keep ``_VALUES[cls]`` (its readers look it up first)."""
    checks = tuple((n, c) for n, c in ((n, _finite_check(n, options)) for n, options, _ in _schema(cls))
                   if c is not None)
    struct = issubclass(cls, msgspec.Struct)
    value: Callable[[Any], Any] | None = None
    if checks or not struct:
        names = _field_names(cls)
        mirror = None if struct else _mirror(cls)

        def value(o: Any) -> Any:
            for n, check in checks:
                if not check(getattr(o, n)):
                    raise _NotFinite
            return o if mirror is None else mirror(*[getattr(o, n) for n in names])

    _VALUES[cls] = value
    return value


_MIRRORS: dict[type, type] = {}


def _mirror(cls: type) -> type:
    """A Struct with the fields of ``cls`` in order, written as ``cls`` is."""
    mirror = _MIRRORS.get(cls)
    if mirror is None:
        mirror = _MIRRORS[cls] = msgspec.defstruct(cls.__name__, [(n, Any) for n in _field_names(cls)], gc=False)
    return mirror


def _written(obj: Any) -> Any:
    """What a line holds for an event or action, unchecked (``_line_json``'s)."""
    cls = obj.__class__
    if isinstance(obj, msgspec.Struct):
        return obj
    return _mirror(cls)(*(getattr(obj, name) for name in _field_names(cls)))


def _entries(actions: Iterable) -> list:
    """The line's actions as (name, value) pairs; raises _NotFinite."""
    values = _VALUES
    entries = []
    for a in actions:
        cls = a.__class__
        value = values.get(cls, _UNSEEN)
        if value is None:
            entries.append((cls.__name__, a))
        else:
            if value is _UNSEEN:
                value = _value(cls)
            entries.append((cls.__name__, a if value is None else value(a)))
    return entries


def _line(seq: int, event: Event, now: float, label: str, before: str | None, after: str | None,
          actions: Iterable | None) -> _Line | _StimulusLine:
    """The record of one line (``actions`` None: stimuli only); raises _NotFinite."""
    cls = event.__class__
    value = _VALUES.get(cls, _UNSEEN)
    if value is _UNSEEN:
        value = _value(cls)
    data = event if value is None else value(event)
    if actions is None:
        return _StimulusLine(LOG_VERSION, seq, now, label, cls.__name__, data)
    return _Line(LOG_VERSION, seq, now, label, cls.__name__, data, before, after, _entries(actions))


def _line_json(seq: int, event: Event, now: float, label: str, before: str | None, after: str | None,
               actions: Iterable | None) -> bytes:
    """The line ``_line`` refused, written by ``json`` (NaN and infinities as
    json writes them), the same keys in the same order."""
    name, data = event.__class__.__name__, _written(event)
    if actions is None:
        line: Any = _StimulusLine(LOG_VERSION, seq, now, label, name, data)
    else:
        entries = [(a.__class__.__name__, _written(a)) for a in actions]
        line = _Line(LOG_VERSION, seq, now, label, name, data, before, after, entries)
    plain = msgspec.to_builtins(line, order="deterministic")
    return json.dumps(plain, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def encode(seq: int, event: Event, now: float, label: str, before: str | None, after: str | None,
           actions: Iterable | None) -> str:
    """One log line (no newline).  ``actions`` None writes a stimuli-only line."""
    try:
        text = _ENCODER.encode(_line(seq, event, now, label, before, after, actions))
    except _NotFinite:
        text = _line_json(seq, event, now, label, before, after, actions)
    return text.decode("utf-8")


def header(config: PlaneConfig) -> str:
    return json.dumps({"v": LOG_VERSION, "config": attrs.asdict(config)}, separators=(",", ":"))


class EventLogWriter:
    """A ControlPlane recorder writing JSONL.

    ``plane.recorder = writer`` (or ``EventLogWriter.attach``): the plane's
    event-log observer, beside any others.  Each call numbers its stimulus
    and makes its line's record (``capture``, from the stimulus as the plane
    kept it; or a Step, as the plane hands a refused stimulus to every
    observer); every ``ENCODE_BATCH`` records are encoded together, and
    ``flush()`` encodes what is left and writes it all to the stream
    (automatically every ``flush_every`` records): what was not flushed is
    what a crash loses.  ``stimuli_only`` drops states and actions.
    """

    # Records encoded at a time: enough for one msgspec call to amortize,
    # few enough that what they hold dies before the collector runs and no
    # recorder call takes long.
    ENCODE_BATCH = 32

    def __init__(self, stream: TextIO, *, config: PlaneConfig | None = None, flush_every: int = 4096,
                 stimuli_only: bool = False):
        self.stream = stream
        self.flush_every = flush_every
        self.stimuli_only = stimuli_only
        self.seq = 0  # the last record numbered
        self._lines: list = []  # records not encoded yet
        self._encoded: list[bytes] = []  # encoded, not written yet
        self._unwritten = 0  # records in _encoded
        self._encode_at = 1
        self._next_encode()
        if stimuli_only:
            self.capture = self._capture_stimulus  # type: ignore[method-assign]
        if config is not None:
            stream.write(header(config) + "\n")

    @classmethod
    def attach(cls, plane, stream: TextIO, **kw) -> "EventLogWriter":
        writer = cls(stream, config=plane.config, **kw)
        plane.recorder = writer
        return writer

    def capture(self, stimulus: Stimulus, out: Sequence[Action] | None) -> None:
        """The plane's way in (see ControlPlane.recorder): the stimulus is
        numbered and kept as the plane handed it; its line's record is made
        with its batch's (``_record``), so the plane's call does no more
        than this append.  What it holds is never changed once handled (the
        events, the machine's action list, ``out``: the plane's copy)."""
        seq = self.seq = self.seq + 1
        lines = self._lines
        lines.append((seq, stimulus, out))
        if len(lines) >= self._encode_at:
            self._encode_due()

    @staticmethod
    def _record(seq: int, stimulus: Stimulus, out: Sequence[Action] | None) -> _Line:
        """A captured stimulus's line record: the line's actions in
        ``stimulus_actions``' order (own, timer, the cascade's effects), the
        timer's written without a call where its key is a string; raises
        _NotFinite."""
        event, now, kind, key, before, after, acts, old_deadline, deadline = stimulus
        cls = event.__class__
        value = _VALUES.get(cls, _UNSEEN)
        if value is _UNSEEN:
            value = _value(cls)
        data = event if value is None else value(event)
        entries = _entries(acts) if acts else []
        if deadline != old_deadline:
            if key.__class__ is not str:
                entries += _entries((timer_action(kind, key, old_deadline, deadline),))
            elif deadline is None:
                entries.append(("CancelTimer", CancelTimer(kind, key)))
            elif deadline - deadline == 0.0:  # finite (the plane's deadlines are)
                entries.append(("ArmTimer", ArmTimer(kind, key, deadline)))
            else:
                raise _NotFinite
        effects = cascade_effects(acts, out) if out else None
        if effects:
            entries += _entries(effects)
        return _Line(LOG_VERSION, seq, now, f"{kind}:{key}", cls.__name__, data, before, after, entries)

    def _capture_stimulus(self, stimulus: Stimulus, out: Sequence[Action] | None) -> None:
        """``capture`` of a stimuli-only writer."""
        self._add(stimulus[0], stimulus[1], f"{stimulus[2]}:{stimulus[3]}", None, None, None)

    def __call__(self, step: Step) -> None:
        """Any other producer's (an observer chaining this writer): the Step as a stimulus."""
        self._add(step.event, step.now, step.machine, step.state_before, step.state_after,
                  None if self.stimuli_only else step.actions)

    def _add(self, event: Event, now: float, label: str, before: str | None, after: str | None,
             actions: Sequence[Action] | None) -> None:
        seq = self.seq = self.seq + 1
        try:
            self._lines.append(_line(seq, event, now, label, before, after, actions))
        except _NotFinite:
            self._add_json(_line_json(seq, event, now, label, before, after, actions))
            return
        if len(self._lines) >= self._encode_at:
            self._encode_due()

    def _add_json(self, text: bytes) -> None:
        # After the records before it, in order (kept even when one of those cannot be written).
        try:
            self._encode()
        finally:
            self._encoded.append(text + b"\n")
            self._unwritten += 1
        self._encode_due()

    def _encode_due(self) -> None:
        self._encode()
        if self._unwritten >= self.flush_every:
            self.flush()
        else:
            self._next_encode()

    def _encode(self) -> None:
        """Encode what was recorded since the last time, in order: a captured
        stimulus (a tuple) gets its record here, one that msgspec cannot
        write as recorded its ``json`` line."""
        lines = self._lines
        if not lines:
            return
        self._lines = []
        records: list = []
        failed: Exception | None = None
        for item in lines:
            if item.__class__ is tuple:
                seq, stimulus, out = item
                try:
                    item = self._record(seq, stimulus, out)
                except _NotFinite:
                    error = self._encode_records(records)
                    failed, records = failed or error, []
                    event, now, kind, key, before, after = stimulus[:6]
                    self._encoded.append(_line_json(seq, event, now, f"{kind}:{key}", before, after,
                                                    stimulus_actions(stimulus, out)) + b"\n")
                    self._unwritten += 1
                    continue
                except Exception as exc:  # (a bug) that line only is lost, as when records were made at capture
                    failed = failed or exc
                    continue
            records.append(item)
        error = self._encode_records(records)
        failed = failed or error
        if failed is not None:
            raise failed

    def _encode_records(self, records: list) -> TypeError | None:
        """Encode ``records`` in one call, or line by line when one holds a
        value JSON cannot hold (the others are kept); returns that error."""
        if not records:
            return None
        try:
            self._encoded.append(_ENCODER.encode_lines(records))
            self._unwritten += len(records)
        except TypeError:
            try:
                self._encode_each(records)
            except TypeError as exc:
                return exc
        return None

    def _encode_each(self, lines: list) -> None:
        """Encode ``lines`` one by one, keeping every line that encodes; then
        raise for the first that does not (its stimulus is not in the log)."""
        failed = None
        for line in lines:
            try:
                self._encoded.append(_ENCODER.encode(line) + b"\n")
                self._unwritten += 1
            except TypeError as exc:
                failed = failed or TypeError(f"event log: seq {line.seq} ({line.event}, {line.machine}) not written: {exc}")
        if failed is not None:
            raise failed

    def _next_encode(self) -> None:
        # A batch never runs past the next automatic flush.
        self._encode_at = max(1, min(self.ENCODE_BATCH, self.flush_every - self._unwritten))

    def flush(self) -> None:
        self._encode()
        if self._encoded:
            text = b"".join(self._encoded).decode("utf-8")
            self._encoded, self._unwritten = [], 0
            self.stream.write(text)
        self._next_encode()
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
        self._text = io.StringIO()
        super().__init__(self._text, **kw)

    def lines(self) -> list[str]:
        self.flush()
        return self._text.getvalue().splitlines()


# ------------------------------------------------------------------ decoding
# Reading is total: any bytes give an EventLog or an EventLogError naming the
# line, never another exception.  Numbers are bounded while they are parsed
# (no NaN/Infinity, no int past 64 bits, no float overflowing to inf), JSON
# nesting past the interpreter's recursion limit is refused by the parser,
# and every field the machines will see is checked against its declared
# type before an event or action is built.


class EmptyLog(EventLogError):
    """A log without a single event line (an empty file, or a header alone)."""

    def __str__(self) -> str:
        return f"empty log: no event line in {self.line} line(s)"


class _BadNumber(ValueError):
    pass


_MAX_INT_DIGITS = 20  # 2**64 has 20 digits


def _parse_int(text: str) -> int:
    # Before int(): Python refuses (or is slow on) thousands of digits.
    if len(text) - text.startswith("-") > _MAX_INT_DIGITS:
        raise _BadNumber(f"integer of {len(text)} digits (at most 64 bits)")
    value = int(text)
    if not -(2**63) <= value < 2**64:
        raise _BadNumber(f"integer {text} is out of the 64-bit range")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"number {text[:40]} overflows to {value}")
    return value


def _parse_constant(name: str) -> Any:
    raise _BadNumber(f"{name} is not a number (non-finite values are refused)")


_DECODER = json.JSONDecoder(parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)


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


# What the elements of a ``tuple`` field are, by field name; any other tuple
# field holds hashable JSON (scalars, or lists of them: they become tuples).
_INDEX, _STR, _SAMPLE = "a non-negative int", "a string", "an [offset, rtt] pair of numbers"
_TUPLE_ELEMENTS = {
    "block_ids": _INDEX, "remote_block_ids": _INDEX, "local_block_ids": _INDEX, "failed_block_ids": _INDEX,
    "ranks": _INDEX, "remote_ranks": _INDEX, "request_ids": _STR, "samples": _SAMPLE,
}
_MAX_VALUE_DEPTH = 4  # lists in lists in a field: a (kind, key) requester is two deep
# Fields typed by an enum, by the type's name: a value must be one of its values.
_ENUM_VALUES: dict[str, frozenset[str]] = {"RecvFailure": frozenset(RecvFailure)}


def _is_number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _hashable_json(v: Any, depth: int = 0) -> bool:
    if v is None or isinstance(v, (str, int, float)):
        return True
    if isinstance(v, list) and depth < _MAX_VALUE_DEPTH:
        return all(_hashable_json(x, depth + 1) for x in v)
    return False


def _element_ok(kind: str | None, v: Any) -> bool:
    if kind is _INDEX:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if kind is _STR:
        return isinstance(v, str)
    if kind is _SAMPLE:
        return isinstance(v, list) and len(v) == 2 and all(_is_number(x) for x in v)
    return _hashable_json(v, 1)


def _type_options(attribute) -> tuple[str, ...]:
    # Annotations are strings here (``from __future__ import annotations``).
    t = attribute.type
    text = t if isinstance(t, str) else getattr(t, "__name__", repr(t))
    return tuple(part.strip().split("[")[0] for part in text.split("|"))


def _value_problem(name: str, options: tuple[str, ...], v: Any) -> str | None:
    """Why the JSON value ``v`` cannot be field ``name`` of the declared type, or None."""
    if v is None:
        return None if "None" in options else "must not be null"
    for opt in options:
        if opt == "str" and isinstance(v, str):
            return None
        if opt == "bool" and isinstance(v, bool):
            return None
        if opt == "int" and isinstance(v, int) and not isinstance(v, bool):
            return None
        if opt == "float" and _is_number(v):
            return None
        if opt == "tuple" and isinstance(v, list):
            kind = _TUPLE_ELEMENTS.get(name)
            bad = next((x for x in v if not _element_ok(kind, x)), _OK)
            if bad is _OK:
                return None
            return f"element {_short(bad)} is not {kind or 'a scalar or a list of them'}"
        if opt in _ENUM_VALUES:
            if v.__class__ is str and v in _ENUM_VALUES[opt]:
                return None
            continue
        if opt not in ("str", "bool", "int", "float", "tuple", "None") and _hashable_json(v):
            return None  # Any (timer keys) and types this reader has no rule for
    names = {"tuple": "a list", "None": "null", "str": "a string", "bool": "a bool", "int": "an integer",
             "float": "a number"}
    names.update({o: f"one of the {o} values" for o in _ENUM_VALUES})
    want = " or ".join(names.get(o, "a scalar or a list of them") for o in options)
    return f"must be {want}, got {_json_type(v)}"


_OK = object()


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a bool", type(None): "null"}.get(
        type(v), "a number")


def _short(v: Any) -> str:
    text = json.dumps(v) if _hashable_json(v) else f"<{_json_type(v)}>"
    return text if len(text) <= 40 else text[:37] + "..."


_SCHEMAS: dict[type, tuple[tuple[str, tuple[str, ...], bool], ...]] = {}


def _schema(cls: type) -> tuple[tuple[str, tuple[str, ...], bool], ...]:
    """(field name, declared type options, has a converter) for each field."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        schema = _SCHEMAS[cls] = tuple((a.name, _type_options(a), a.converter is not None)
                                       for a in class_fields(cls))
    return schema


def _all_indices(v: Any) -> bool:
    return v.__class__ is list and all(x.__class__ is int and x >= 0 for x in v)


def _all_strings(v: Any) -> bool:
    return v.__class__ is list and all(x.__class__ is str for x in v)


# Fast sufficient checks of a JSON value ``v`` for the common declared types:
# each accepts only values ``_value_problem`` accepts (exact JSON types, no
# subclasses).  A value one refuses sends the whole object through
# ``_build_reporting``, which decides and names the problem.
_FAST_CHECKS: dict[tuple[str, ...], Callable[[Any], bool]] = {
    ("str",): lambda v: v.__class__ is str,
    ("str", "None"): lambda v: v is None or v.__class__ is str,
    ("int",): lambda v: v.__class__ is int,
    ("bool",): lambda v: v.__class__ is bool,
    ("float",): lambda v: v.__class__ is float or v.__class__ is int,
    ("float", "None"): lambda v: v is None or v.__class__ is float or v.__class__ is int,
    ("Any",): lambda v: v.__class__ is str,  # timer keys: mostly string ids
    ("RecvFailure", "None"): lambda v: v is None or (v.__class__ is str and v in _ENUM_VALUES["RecvFailure"]),
}
_FAST_BUILDS: dict[type, Callable[[dict], dict | None]] = {}


def _never(v: Any) -> bool:
    return False  # no fast rule: the full check


def _fast_kwargs(cls: type) -> Callable[[dict], dict | None]:
    """A function from an object's JSON fields to the keyword arguments of
    ``cls``, or None where a value needs the full check (or a key is not a
    field): one fast check per field, from the schema."""
    fast = _FAST_BUILDS.get(cls)
    if fast is None:
        plan = []
        for name, options, converts in _schema(cls):
            check = _FAST_CHECKS.get(options)
            if check is None and options == ("tuple",):
                kind = _TUPLE_ELEMENTS.get(name)
                check = _all_indices if kind is _INDEX else _all_strings if kind is _STR else None
            plan.append((name, check or _never, converts))

        def fast(data: dict) -> dict | None:
            kw = {}
            for name, check, converts in plan:
                if name in data:
                    v = data[name]
                    if not check(v):
                        return None
                    # A converter restores its own tuples; elsewhere lists were tuples.
                    kw[name] = v if converts or v.__class__ is not list else _tuplify(v)
            return kw if len(kw) == len(data) else None

        _FAST_BUILDS[cls] = fast
    return fast


def build(registry: dict[str, type], name: str, data: Any, line: int, what: str) -> Any:
    cls = registry.get(name)
    if cls is None:
        raise UnknownEvent(line, f"unknown {what} {_short(name)}")
    if not isinstance(data, dict):
        raise MalformedLine(line, f"{what} data must be an object, got {_json_type(data)}")
    kwargs = (_FAST_BUILDS.get(cls) or _fast_kwargs(cls))(data)
    if kwargs is None:
        return _build_reporting(cls, name, data, line, what)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a missing field, a validator
        raise MalformedLine(line, f"bad {what} {name} data: {exc}") from None


def check(registry: dict[str, type], name: str, data: Any, line: int, what: str) -> None:
    """What ``build`` checks, without keeping the object (a recorded line's
    actions are only compared).  Where the fast field check passes and the
    class can refuse nothing else (no validators, no post-init, every field
    without a default given; its converters only turn lists into tuples),
    the object is not built."""
    cls = registry.get(name)
    if cls is not None and data.__class__ is dict:
        required = _REQUIRED.get(cls)
        if required is None:
            required = _REQUIRED[cls] = _required_fields(cls)
        if required is not _MUST_BUILD and len(data) >= len(required) and all(f in data for f in required):
            if (_FAST_BUILDS.get(cls) or _fast_kwargs(cls))(data) is not None:
                return
    build(registry, name, data, line, what)


# Per class: the fields without a default, or _MUST_BUILD where only
# building the object tells whether it can be built.
_MUST_BUILD: tuple[str, ...] = ("<build>",)
_REQUIRED: dict[type, tuple[str, ...]] = {}


def _required_fields(cls: type) -> tuple[str, ...]:
    fields = class_fields(cls)
    if any(a.validator is not None for a in fields) or runs_code_when_built(cls):
        return _MUST_BUILD
    return tuple(a.name for a in fields if a.default is attrs.NOTHING)


def _build_reporting(cls: type, name: str, data: dict, line: int, what: str) -> Any:
    """``build`` field by field, naming the first problem."""
    kwargs = {}
    for field, options, converts in _schema(cls):
        if field in data:
            v = data[field]
            problem = _value_problem(field, options, v)
            if problem is not None:
                raise MalformedLine(line, f"{what} {name}: field {field!r} {problem}")
            kwargs[field] = v if converts else _tuplify(v)
    extra = set(data) - set(kwargs)
    if extra:
        raise UnknownEvent(line, f"{what} {name} has no field(s) {sorted(extra)[:5]}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a missing field, a validator
        raise MalformedLine(line, f"bad {what} {name} data: {exc}") from None


def _iter_lines(source) -> Iterator[str | bytes]:
    if isinstance(source, (str, os.PathLike)):
        # Bytes: a line that is not UTF-8 is reported with its number, not
        # raised by the file object in the middle of iteration.
        with open(source, "rb") as f:
            yield from f
    else:
        yield from source


def torn_last_line(path: str | os.PathLike) -> int | None:
    """The number of a file's last line when it is torn (not JSON, or not
    UTF-8: what a writer killed in the middle of a line leaves), else None.
    Only the last non-blank line counts, and only after a whole one: a bad
    line anywhere else stays an error for the reader."""
    count = 0
    last_start = 0  # offset of the line after the last newline seen
    with open(path, "rb") as f:
        offset = 0
        for chunk in iter(lambda: f.read(1 << 20), b""):
            count += chunk.count(b"\n")
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                last_start = offset + nl + 1
            offset += len(chunk)
        f.seek(last_start)
        tail = f.read()
    number = count + 1  # the line after the last newline
    if not tail.strip():
        return None  # the file ends with a whole line (and blanks)
    if number < 2:
        return None
    try:
        _loads(tail, number)
    except MalformedLine as exc:
        return number if exc.message.startswith(("not JSON", "not UTF-8")) else None
    return None


def lines_before(path: str | os.PathLike, line: int) -> Iterator[bytes]:
    """The file's lines before line number ``line`` (bytes, as the reader takes them)."""
    with open(path, "rb") as f:
        for n, text in enumerate(f, start=1):
            if n >= line:
                return
            yield text


def parse_config(obj: Any, line: int) -> PlaneConfig:
    if not isinstance(obj, dict):
        raise MalformedLine(line, "config must be an object")
    fields = {a.name: a for a in attrs.fields(PlaneConfig)}
    for key, value in obj.items():
        if key in fields:
            problem = _value_problem(key, _type_options(fields[key]), value)
            if problem is not None:
                raise MalformedLine(line, f"bad config: {key!r} {problem}")
    if "engine_stale_after" not in obj and isinstance(obj.get("engine_ttl"), (int, float)):
        # A log from before the key: STALE came at engine_ttl then.
        obj = {**obj, "engine_stale_after": obj["engine_ttl"]}
    if "heartbeat_spread" not in obj:
        # A log from before the key: every batch went out one interval after the last.
        obj = {**obj, "heartbeat_spread": False}
    try:
        return PlaneConfig(**obj)
    except (TypeError, ValueError) as exc:
        raise MalformedLine(line, f"bad config: {exc}") from None


# orjson parses a line several times faster than ``json`` but bounds it
# differently (an integer past 64 bits becomes a float; some versions nest
# without limit): a line with a run of 19 digits or more, or with many
# brackets, or one orjson refuses, is parsed by ``json`` with the bounds
# above, which accepts or refuses it exactly as before, with its message.
_MAX_FAST_BRACKETS = 200  # far below any nesting json refuses (the recursion limit)
# Digits become "0", opening brackets "[", everything else a blank: one C
# pass, then two substring searches (a regular expression costs 5x more).
_SHAPE = bytes(0x30 if 0x30 <= i <= 0x39 else 0x5B if i in (0x5B, 0x7B) else 0x20 for i in range(256))
_LONG_RUN = b"0" * 19


def _orjson_agrees(raw: bytes) -> bool:
    shape = raw.translate(_SHAPE)
    return _LONG_RUN not in shape and shape.count(b"[") <= _MAX_FAST_BRACKETS


def _loads(text: str | bytes, line: int) -> Any:
    if isinstance(text, str):
        raw = text.encode("utf-8", "surrogatepass")
        if _orjson_agrees(raw):
            try:
                return orjson.loads(raw)
            except orjson.JSONDecodeError:
                pass
    elif isinstance(text, (bytes, bytearray)):
        if _orjson_agrees(text):
            try:
                return orjson.loads(text)
            except orjson.JSONDecodeError:
                pass
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedLine(line, f"not UTF-8: byte {text[exc.start]:#04x} at column {exc.start + 1}") from None
    else:
        raise MalformedLine(line, f"a log line must be text, got {type(text).__name__}")
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise MalformedLine(line, f"not JSON: {exc.msg} at column {exc.colno}") from None
    except _BadNumber as exc:
        raise MalformedLine(line, f"bad number: {exc}") from None
    except RecursionError:
        raise MalformedLine(line, "JSON nested too deep") from None


def parse_line(text: str | bytes, line: int) -> dict:
    obj = _loads(text, line)
    if not isinstance(obj, dict):
        raise MalformedLine(line, "a log line must be a JSON object")
    v = obj.get("v")
    if type(v) is not int or v != LOG_VERSION:  # type(): true == 1 and 1.0 == 1 in Python
        if type(v) is int:
            raise UnsupportedVersion(line, f"log version {v} (this reader understands {LOG_VERSION})")
        raise MalformedLine(line, f"missing or invalid version 'v': {_short(v)}")
    return obj


def _optional_str(obj: dict, key: str, line: int) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise MalformedLine(line, f"{key!r} must be a string or null, got {_json_type(value)}")
    return value


def _str_or_none(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _action_shapes(actions: list) -> bool:
    """Every action is ``[name, {fields}]``."""
    for a in actions:
        if not (isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], dict)):
            return False
    return True


class _LineChecker:
    """The checks of ``read_log`` line by line, with what they carry from one
    line to the next (the header, the last time and ``seq``)."""

    def __init__(self) -> None:
        self.config: PlaneConfig | None = None
        self.records = 0  # event lines so far
        self.lines = 0  # lines so far, blank ones included
        self.last_t = float("-inf")
        self.last_seq: int | None = None

    def record(self, n: int, text: Any) -> LogRecord | None:
        """Line ``n`` as a record; None for a blank line or the header."""
        self.lines = n
        if isinstance(text, (str, bytes, bytearray)) and (not text or text.isspace()):  # as strip(), no copy
            return None
        obj = parse_line(text, n)
        if "config" in obj and "event" not in obj:
            if self.records or self.config is not None:
                raise MalformedLine(n, "the config header must be the first line")
            self.config = parse_config(obj["config"], n)
            return None
        name = obj.get("event")
        if not isinstance(name, str):
            raise MalformedLine(n, f"missing or non-string 'event': {_short(name)}")
        t = obj.get("t")
        if not _is_number(t):
            raise MalformedLine(n, f"missing or non-numeric time 't': {_short(t)}")
        if t < self.last_t:
            raise MalformedLine(n, f"time goes backwards ({t} after {self.last_t})")
        self.last_t = t
        if "seq" in obj:
            seq = obj["seq"]
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                raise MalformedLine(n, f"'seq' must be a non-negative integer, got {_short(seq)}")
            if self.last_seq is not None and seq <= self.last_seq:
                raise MalformedLine(n, f"'seq' {seq} does not increase (after {self.last_seq})")
            self.last_seq = seq
        else:
            seq = n  # hand-written logs may omit it
        data = obj.get("data", {})
        event = build(LOG_EVENTS, name, data, n, "event")
        recorded = "state_after" in obj or "actions" in obj
        actions = obj.get("actions")
        if recorded:
            if not isinstance(actions, list) or not _action_shapes(actions):
                raise MalformedLine(n, "'actions' must be a list of [name, {fields}]")
            for a_name, a_data in actions:
                check(ACTION_TYPES, a_name, a_data, n, "action")
        machine, before, after = obj.get("machine"), obj.get("state_before"), obj.get("state_after")
        if not (_str_or_none(machine) and _str_or_none(before) and _str_or_none(after)):
            machine = _optional_str(obj, "machine", n)  # raises, naming the first bad one
            before, after = _optional_str(obj, "state_before", n), _optional_str(obj, "state_after", n)
        self.records += 1
        return LogRecord(n, seq, float(t), machine, event, data, recorded, before, after, actions)


def read_log(source) -> EventLog:
    """Parse a log from a path, an open file or an iterable of lines (str or bytes).

    Raises an ``EventLogError`` subclass naming the first bad line: bad
    bytes, JSON or numbers, a field of the wrong type, time going backwards,
    an explicit ``seq`` that does not increase; ``EmptyLog`` when there is
    no event line at all.
    """
    checker = _LineChecker()
    records: list[LogRecord] = []
    for n, text in enumerate(_iter_lines(source), start=1):
        rec = checker.record(n, text)
        if rec is not None:
            records.append(rec)
    if not records:
        raise EmptyLog(checker.lines, "no event line")
    return EventLog(checker.config, tuple(records))


class LogStream:
    """A log read as it is iterated, one record at a time, with the checks
    and errors of ``read_log``: what replay uses, so that a long log is
    neither held in memory nor parsed into objects the garbage collector
    keeps walking.  The header (``config``) and the first event line are
    read on construction (``EmptyLog`` there); a bad line raises when the
    iteration reaches it.  ``check_rest`` reads what is left, so that a
    caller who stops early still refuses a log ``read_log`` would refuse."""

    def __init__(self, source) -> None:
        self._checker = _LineChecker()
        self._lines = enumerate(_iter_lines(source), start=1)
        self._first = self._next()
        if self._first is None:
            raise EmptyLog(self._checker.lines, "no event line")

    @property
    def config(self) -> PlaneConfig | None:
        return self._checker.config

    def _next(self) -> LogRecord | None:
        record = self._checker.record
        for n, text in self._lines:
            rec = record(n, text)
            if rec is not None:
                return rec
        return None

    def __iter__(self) -> Iterator[LogRecord]:
        rec, self._first = self._first, None
        while rec is not None:
            yield rec
            rec = self._next()

    def check_rest(self) -> None:
        self._first = None
        while self._next() is not None:
            pass
