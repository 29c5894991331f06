"""A ``SequenceDiagram`` as Mermaid ``sequenceDiagram`` text, and a strict
check of the subset written here (no Mermaid parser is available here).

Labels carry log contents (request ids are arbitrary text within the wire
rules), so every character outside a small safe set is written as a Mermaid
entity code (``#59;`` for ``;``): a ``;`` would end the statement, a ``#``
start an entity, a ``%%`` a comment, a quote or ``<`` be taken as markup.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from .model import Arrow, Line, SequenceDiagram

INDENT = "    "
_SAFE = re.compile(r"[A-Za-z0-9 _.,+\-()\[\]/=*'@~|!?^$]")
# In a message text ``:`` is plain (only the first one separates the text).
_SAFE_TEXT = re.compile(r"[A-Za-z0-9 _.,+\-()\[\]/=*'@~|!?^$:]")
_ARROWS = {Line.SEND: "->>", Line.REPLY: "-->>", Line.FAILED: "-x"}


def escape(text: str, *, colon: bool = True) -> str:
    """``text`` with every unsafe character (and any control character) as ``#<code>;``."""
    safe = _SAFE_TEXT if colon else _SAFE
    return "".join(c if safe.fullmatch(c) else f"#{ord(c)};" for c in text)


def _when(t: float) -> str:
    return f"{t:.3f}s"


def render(d: SequenceDiagram, title: Sequence[str] = ()) -> str:
    """The diagram; ``title`` lines go first into the header comment."""
    lines = ["sequenceDiagram"]
    comment = [*title, f"kvplane sequence: {len(d.items)} item(s)"]
    for log in d.logs:
        where = f" from {log.source}" if log.source else ""
        comment.append(f"{log.side} log{where}: {len(log.records)} records")
        if log.torn_tail is not None:
            comment.append(f"{log.side} log: torn last line {log.torn_tail} left out (the writer was killed)")
    comment.append(f"clock: {d.clock.describe()}")
    comment.append(f"times: seconds since the first event drawn (P's clock {d.t0:.6f})")
    sel = d.selection
    if sel.request_ids:
        comment.append("requests: " + ", ".join(sel.request_ids))
    if sel.start is not None or sel.end is not None:
        comment.append(f"window: {sel.start if sel.start is not None else '-'} .. "
                       f"{sel.end if sel.end is not None else '-'} s")
    if d.left_out:
        comment.append(f"{d.left_out} event(s) left out past the first {sel.max_events} (--max-events)")
    lines += [f"{INDENT}%% {escape(c)}" for c in comment]
    for p in d.participants:
        lines.append(f"{INDENT}participant {p.id} as {escape(p.label, colon=False)}")
    for item in d.items:
        text = escape(f"{_when(item.t)} {item.text}")
        if isinstance(item, Arrow):
            lines.append(f"{INDENT}{item.src}{_ARROWS[item.line]}{item.dst}: {text}")
        else:
            lines.append(f"{INDENT}Note over {','.join(item.over)}: {text}")
    if d.left_out:
        ids = [p.id for p in d.participants]
        span = ids[0] if len(ids) == 1 else f"{ids[0]},{ids[-1]}"
        lines.append(f"{INDENT}Note over {span}: {escape(f'... {d.left_out} more event(s) left out')}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the check
class MermaidSyntaxError(ValueError):
    def __init__(self, line: int, message: str):
        self.line = line
        super().__init__(f"line {line}: {message}")


_ID = r"[A-Za-z][A-Za-z0-9_]*"
_ENTITY = r"#(?:[0-9]+|[a-z]+);"
_TEXT = rf"(?:{_SAFE_TEXT.pattern}|{_ENTITY})*"
_ALIAS = rf"(?:{_SAFE.pattern}|{_ENTITY})+"
_PARTICIPANT = re.compile(rf"participant ({_ID}) as ({_ALIAS})\Z")
_MESSAGE = re.compile(rf"({_ID})(->>|-->>|-x)({_ID}): ({_TEXT})\Z")
_NOTE = re.compile(rf"Note over ({_ID})(?:,({_ID}))?: ({_TEXT})\Z")
_COMMENT = re.compile(rf"%% {_TEXT}\Z")


def check(text: str) -> int:
    """Raise ``MermaidSyntaxError`` unless ``text`` is a ``sequenceDiagram``
    of only the forms ``render`` writes, every participant declared before
    use (and once), every label escaped; returns the number of statements."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines or lines[0] != "sequenceDiagram":
        raise MermaidSyntaxError(1, "the first line must be 'sequenceDiagram'")
    declared: set[str] = set()
    statements = 0
    for n, raw in enumerate(lines[1:], start=2):
        if not raw.startswith(INDENT) or raw[len(INDENT):].startswith(" "):
            raise MermaidSyntaxError(n, "statements are indented by four spaces")
        body = raw[len(INDENT):]
        if _COMMENT.match(body):
            continue
        statements += 1
        m = _PARTICIPANT.match(body)
        if m:
            if m.group(1) in declared:
                raise MermaidSyntaxError(n, f"participant {m.group(1)} declared twice")
            declared.add(m.group(1))
            continue
        m = _MESSAGE.match(body)
        used: tuple[str, ...]
        if m:
            used = (m.group(1), m.group(3))
        else:
            m = _NOTE.match(body)
            if not m:
                raise MermaidSyntaxError(n, f"not a statement of the emitted subset (or an unescaped label): "
                                            f"{body[:60]!r}")
            used = tuple(x for x in (m.group(1), m.group(2)) if x)
        for pid in used:
            if pid not in declared:
                raise MermaidSyntaxError(n, f"participant {pid} used before it is declared")
    return statements
