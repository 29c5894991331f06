"""The composition diagram: how the machines talk, drawn from the data.

One node per machine, labelled with the events that create it (the
heartbeat batches are a machine too).  Edges: every wire of ``composition``
(from each machine whose table emits its action, to its target machine or to
every requester), with the fields that are not copied by name, and every
``Spec.source`` (dashed).
"""
from __future__ import annotations

import textwrap
from typing import Iterator

import attrs

from .composition import (
    WIRES, ActionField, ConfigField, Const, EngineField, HeartbeatChain, Requesters, TargetField, Wire,
)
from .render_machine import DiagramText
from .spec import Spec
from .validate_composition import emitted



@attrs.frozen
class Edge:
    src: str
    dest: str
    label: str
    dashed: bool = False


def _field_notes(w: Wire) -> list[str]:
    target = w.target if isinstance(w.target, str) else "requester"
    notes = []
    for field, source in w.fields:
        if isinstance(source, ActionField) and source.name != field:
            notes.append(f"{field}={source.name}")
        elif isinstance(source, Const):
            notes.append(f"{field}={source.value!r}")
        elif isinstance(source, ConfigField):
            notes.append(f"{field}=config.{source.name}")
        elif isinstance(source, TargetField):
            notes.append(f"{field}={target}.{source.name}")
        elif isinstance(source, HeartbeatChain):
            notes.append(f"{field}=heartbeats.{source.which}")
        elif isinstance(source, EngineField):
            notes.append(f"{field}=remote_engine.{source.name}")
    return notes


def wire_label(w: Wire) -> str:
    label = f"{w.action.__name__} → {w.event.__name__}"
    if isinstance(w.target, Requesters):
        label += " (each requester)"
    if w.only_if_live:
        label += " (if live)"
    notes = _field_notes(w)
    return label + (": " + ", ".join(notes) if notes else "")


def edges(specs: dict[str, Spec], wires: tuple[Wire, ...] = WIRES) -> Iterator[Edge]:
    emits = {name: emitted(spec) for name, spec in specs.items()}
    for w in wires:
        if isinstance(w.target, Requesters):
            targets = [n for n in specs if w.target.acquired_by in emits[n]]
        else:
            targets = [w.target]
        for src in (n for n in specs if w.action in emits[n]):
            for dest in targets:
                yield Edge(src, dest, wire_label(w))
    for name, spec in specs.items():
        source = spec.source
        if source is not None:
            held = ", ".join(sorted(source.held))
            yield Edge(source.kind, name, f"source: held in {held}, else {source.ended.__name__}", dashed=True)


def _nodes(specs: dict[str, Spec], newline: str) -> dict[str, str]:
    """Node id -> label lines joined by ``newline``."""
    return {n: newline.join([n, "created by " + ", ".join(ev.__name__ for ev in spec.created_by)])
            for n, spec in specs.items()}


def render_composition_mermaid(specs: dict[str, Spec]) -> str:
    lines = ["---", "title: composition", "---", "flowchart TB"]
    for node, label in _nodes(specs, "<br/>").items():
        lines.append(f'  {node}["{label}"]')
    for e in edges(specs):
        arrow = "-.->" if e.dashed else "-->"
        lines.append(f'  {e.src} {arrow}|"{e.label}"| {e.dest}')
    return "\n".join(lines) + "\n"


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_composition_dot(specs: dict[str, Spec]) -> str:
    """DOT text (``app.offline.diagrams`` runs ``dot`` on it for the SVG)."""
    lines = ['digraph "composition" {',
             '  graph [rankdir=TB, label="composition", labelloc=t, fontname=Helvetica, nodesep=0.3, ranksep=1.2];',
             '  node [shape=box, style="rounded", fontname=Helvetica];',
             '  edge [fontname=Helvetica, fontsize=10];']
    for node, label in _nodes(specs, "\n").items():
        lines.append(f"  {_q(node)} [label={_q(label)}];")
    # One arrow per pair of machines, each wire a line of its label: parallel
    # arrows with long labels would make the drawing many times wider than tall.
    merged: dict[tuple[str, str, bool], list[str]] = {}
    for e in edges(specs):
        merged.setdefault((e.src, e.dest, e.dashed), []).append(_wrap(e.label))
    for (src, dest, dashed), labels in merged.items():
        style = ", style=dashed" if dashed else ""
        lines.append(f"  {_q(src)} -> {_q(dest)} [label={_q(chr(10).join(labels))}{style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _wrap(label: str, width: int = 32) -> str:
    """An edge label over a few short lines, so that edges stay narrow."""
    return "\n".join(textwrap.wrap(label, width))


def composition_text(specs: dict[str, Spec]) -> DiagramText:
    """The composition diagram's sources, for the diagrams writer."""
    return DiagramText(render_composition_mermaid(specs), render_composition_dot(specs))
