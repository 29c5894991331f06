"""The composition diagram: how the machines talk, drawn from the data.

One node per machine, labelled with the events that create it (the
heartbeat batches are a machine too).  Edges: every wire of ``composition`` (from
each machine whose table emits its action, to its target machine or to
every requester), with the fields that are not copied by name; the
actions the plane executes itself; every ``Spec.source`` (dashed).
"""
from __future__ import annotations

from typing import Iterator

import attrs

from .composition import (
    PLANE_EXECUTED, WIRES, ActionField, ConfigField, Const, HeartbeatChain, Requesters, TargetField, Wire,
)
from .spec import Spec
from .validate_composition import emitted

HEARTBEATS = "heartbeats"


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
    for name in specs:
        own = sorted(a.__name__ for a in emits[name] & PLANE_EXECUTED)
        if own:
            yield Edge(name, HEARTBEATS, " / ".join(own))
    for name, spec in specs.items():
        source = spec.source
        if source is not None:
            held = ", ".join(sorted(source.held))
            yield Edge(source.kind, name, f"source: held in {held}; else {source.ended.__name__}", dashed=True)


def _nodes(specs: dict[str, Spec], newline: str) -> dict[str, str]:
    """Node id -> label lines joined by ``newline``."""
    nodes = {n: newline.join([n, "created by " + ", ".join(ev.__name__ for ev in spec.created_by)])
             for n, spec in specs.items()}
    if PLANE_EXECUTED:  # actions the plane runs by hand (none today)
        nodes[HEARTBEATS] = "plane"
    return nodes


def render_composition_mermaid(specs: dict[str, Spec]) -> str:
    lines = ["---", "title: composition", "---", "flowchart LR"]
    for node, label in _nodes(specs, "<br/>").items():
        lines.append(f'  {node}["{label}"]')
    for e in edges(specs):
        arrow = "-.->" if e.dashed else "-->"
        lines.append(f'  {e.src} {arrow}|"{e.label}"| {e.dest}')
    return "\n".join(lines) + "\n"


def render_composition_dot(specs: dict[str, Spec]):
    """A graphviz.Digraph (``.pipe(format='svg')`` needs the ``dot`` binary)."""
    import graphviz

    g = graphviz.Digraph("composition", graph_attr={"rankdir": "LR", "label": "composition"},
                         node_attr={"shape": "box", "fontname": "Helvetica"},
                         edge_attr={"fontname": "Helvetica", "fontsize": "10"})
    for node, label in _nodes(specs, "\n").items():
        g.node(node, label, **({"shape": "ellipse"} if node == HEARTBEATS else {}))
    for e in edges(specs):
        g.edge(e.src, e.dest, label=e.label, **({"style": "dashed"} if e.dashed else {}))
    return g


def composition_files(specs: dict[str, Spec], svg: bool) -> dict[str, bytes]:
    """The composition diagram's files, for the diagrams writer."""
    files = {"composition.mmd": render_composition_mermaid(specs).encode()}
    if svg:
        files["composition.svg"] = render_composition_dot(specs).pipe(format="svg")
    return files
