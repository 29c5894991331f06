"""A machine's state diagram as Mermaid ``stateDiagram-v2`` and DOT text.

Both are drawn from ``diagram_model``: top to bottom, the initial state
marked (not in an error colour), terminal states with a double border,
timers with their default values, numbered action lists and the timers
legend beside the drawing.  Text only: ``app.offline.diagrams`` writes the files
and runs ``dot`` for the SVG.
"""
from __future__ import annotations

import html
import textwrap

import attrs

from .config import PlaneConfig
from .diagram_model import DiagramEdge, DiagramPart, MachineDiagram, machine_diagram
from .spec import Spec

INITIAL_FILL = "#dbeafe"
TERMINAL_FILL = "#e5e7eb"
# Edge labels wrap at this many characters: a long label widens every rank it crosses.
EDGE_LABEL_WIDTH = 36


@attrs.frozen
class DiagramText:
    """One drawing's sources: Mermaid and DOT."""

    mermaid: str
    dot: str


def mermaid_safe(text: str) -> str:
    """Text Mermaid reads literally in a label or note: no statement
    separators, comment or entity starters, braces or angle brackets."""
    for bad, good in ((";", ","), ("#", "no. "), ("%", " pct"), ("{", "("), ("}", ")"), ("<", "‹"),
                      (">", "›"), (":", " =")):
        text = text.replace(bad, good)
    return text


SELF_LOOP = "↻ "


def _arrows(part: DiagramPart) -> list[DiagramEdge]:
    return [e for e in part.edges if e.src != e.dest]


def _box_lines(d: MachineDiagram, part: DiagramPart, name: str) -> list[str]:
    """What the state holds, its timer, and its self-loops (drawn inside the
    box, as UML internal transitions, so that they take no width)."""
    loops = [SELF_LOOP + _edge_text(d, e) for e in part.edges if e.src == e.dest == name]
    return d.states[name].lines() + loops


def _edge_text(d: MachineDiagram, e: DiagramEdge) -> str:
    acts = d.actions_text(e)
    label = e.trigger() + (f" / {acts}" if acts else "")
    return label + (f" · do {e.effect}" if e.effect else "")


def to_mermaid(d: MachineDiagram, part: DiagramPart) -> str:
    lines = ["---", f"title: {mermaid_safe(part.title)}", "---", "stateDiagram-v2", f"  direction {part.rankdir}",
             f"  classDef initial fill:{INITIAL_FILL}", f"  classDef terminal fill:{TERMINAL_FILL}"]
    for name in part.states:
        lines.append(f'  state "{name}" as {name}')
        lines.extend(f"  {name} : {mermaid_safe(line)}" for line in _box_lines(d, part, name))
    if part.shows_initial:
        lines.append(f"  [*] --> {_initial(d)}")
    for e in _arrows(part):
        lines.append(f"  {e.src} --> {e.dest} : {mermaid_safe(_edge_text(d, e))}")
    for name in part.states:
        if d.states[name].terminal:
            lines.append(f"  {name} --> [*]")
    actions, timers = d.legend_for(part), d.timers_for(part)
    notes = (["actions"] + [f"{k} = {v}" for k, v in actions] if actions else []) + \
        (["timers"] + timers if timers else [])
    if notes:
        anchor = _initial(d) if part.shows_initial else part.states[0]
        lines.append(f"  note right of {anchor}")
        lines.extend(f"    {mermaid_safe(n)}" for n in notes)
        lines.append("  end note")
    for name in part.states:
        box = d.states[name]
        if box.initial:
            lines.append(f"  class {name} initial")
        elif box.terminal:
            lines.append(f"  class {name} terminal")
    return "\n".join(lines) + "\n"


def _initial(d: MachineDiagram) -> str:
    return next(b.name for b in d.states.values() if b.initial)


def _q(text: str) -> str:
    """A DOT double-quoted string (a newline becomes DOT's centred line break)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _state_label(d: MachineDiagram, part: DiagramPart, name: str) -> str:
    rows = [f"<b>{html.escape(name)}</b>"]
    rows += [f'<font point-size="9">{html.escape(x)}</font>' for x in d.states[name].lines()]
    loops = _box_lines(d, part, name)[len(d.states[name].lines()):]
    head = "<br/>".join(rows) + ("<br/>" if loops else "")
    # A long self-loop wraps, its continuation indented under the arrow.
    wrapped = [line for x in loops for line in textwrap.wrap(x, 64, subsequent_indent="    ")]
    return "<" + head + "".join(f'<font point-size="9">{_indented(x)}</font><br align="left"/>'
                                for x in wrapped) + ">"


def _indented(line: str) -> str:
    """HTML text whose leading spaces survive (graphviz drops plain ones)."""
    body = line.lstrip(" ")
    return "&#160;" * (len(line) - len(body)) + html.escape(body)


def _wrapped(text: str, width: int = 72) -> str:
    return '<br align="left"/>'.join(html.escape(x) for x in textwrap.wrap(text, width)) + '<br align="left"/>'


def _legend_label(d: MachineDiagram, part: DiagramPart) -> str | None:
    rows = []
    actions = d.legend_for(part)
    if actions:
        rows.append("<b>actions</b>")
        rows += [_wrapped(f"{k}  {v}") for k, v in actions]
    timers = d.timers_for(part)
    if timers:
        rows.append("<b>timers</b>")
        rows += [_wrapped(t) for t in timers]
    if not rows:
        return None
    cells = "".join(f'<tr><td align="left" balign="left">{r}</td></tr>' for r in rows)
    return f'<<table border="0" cellborder="0" cellspacing="1" cellpadding="2">{cells}</table>>'


def to_dot(d: MachineDiagram, part: DiagramPart) -> str:
    lines = [
        f"digraph {_q(part.stem)} {{",
        (f"  graph [rankdir={part.rankdir}, labelloc=t, fontname=Helvetica, fontsize=14, nodesep=0.3, "
         f"ranksep=0.75, label={_q(part.title)}];"),
        "  node [shape=box, style=\"rounded,filled\", fillcolor=white, fontname=Helvetica, fontsize=11];",
        "  edge [fontname=Helvetica, fontsize=9];",
    ]
    if part.shows_initial:
        lines.append('  "__start" [shape=point, width=0.15, label=""];')
        lines.append(f'  "__start" -> {_q(_initial(d))};')
    for name in part.states:
        box = d.states[name]
        extra = ""
        if box.initial:
            extra = f', fillcolor="{INITIAL_FILL}"'
        elif box.terminal:
            extra = f', fillcolor="{TERMINAL_FILL}", peripheries=2'
        tip = f", tooltip={_q(box.doc)}" if box.doc else ""
        lines.append(f"  {_q(name)} [label={_state_label(d, part, name)}{extra}{tip}];")
    for e in _arrows(part):
        tip = ", ".join(e.actions) if e.actions else e.trigger()
        label = "\n".join(textwrap.wrap(_edge_text(d, e), EDGE_LABEL_WIDTH))
        lines.append(f"  {_q(e.src)} -> {_q(e.dest)} [label={_q(label)}, tooltip={_q(tip)}];")
    legend = _legend_label(d, part)
    if legend is not None:
        lines.append(f'  "__legend" [shape=note, fillcolor="#fffbeb", label={legend}];')
        lines.append('  { rank=sink; "__legend"; }')
    lines.append("}")
    return "\n".join(lines) + "\n"


def machine_texts(spec: Spec, config: PlaneConfig | None = None) -> dict[str, DiagramText]:
    """File stem -> the drawing's sources, for every part of the machine."""
    d = machine_diagram(spec, PlaneConfig() if config is None else config)
    return {p.stem: DiagramText(to_mermaid(d, p), to_dot(d, p)) for p in d.parts}
