"""What a machine's state diagram shows, decided once for every renderer.

From a Spec and a PlaneConfig: one box per state (what it holds, its timer
with the default value), one edge per (source, destination, guard,
actions, effect) with its events merged, long action lists numbered into
a legend, a self-loop's effect in words (its docstring), and a timers
legend saying how each deadline field is set.  A large machine is split
into parts a screen can show: the fail-closed (abort) paths apart from the
rest.  ``render_machine`` turns this into Mermaid and DOT text.
"""
from __future__ import annotations

import attrs

from .composition import WIRES, ConfigField, Wire
from .diagram_timers import FieldSetter, Setting, StateTimer, event_name, field_setters, state_timers
from .spec import Spec, transitions_of

# Action lists longer than this go to the legend as a number.
INLINE_ACTIONS = 1
# Machines with more edges than this are drawn in parts.
SPLIT_ABOVE = 30


@attrs.frozen
class StateBox:
    name: str
    holds: tuple[str, ...]
    timer: StateTimer | None
    initial: bool
    terminal: bool
    doc: str

    def lines(self) -> list[str]:
        """The text under the state's name."""
        out = []
        if self.holds:
            out.append("holds " + ", ".join(self.holds))
        if self.timer is not None:
            out.append(self.timer.describe())
        return out


@attrs.frozen
class DiagramEdge:
    src: str
    dest: str
    events: tuple[str, ...]
    guard: str
    actions: tuple[str, ...]
    # A self-loop's effect in words (its docstring's first line).
    effect: str = ""

    def trigger(self) -> str:
        label = " or ".join(self.events)
        return f"{label} [{self.guard}]" if self.guard else label


@attrs.frozen
class DiagramPart:
    """One drawing: its file stem, title, states and edges."""

    stem: str
    title: str
    states: tuple[str, ...]
    edges: tuple[DiagramEdge, ...]
    shows_initial: bool
    # Top to bottom; a fan-in (every live state to one) left to right.
    rankdir: str = "TB"


@attrs.frozen
class MachineDiagram:
    name: str
    states: dict[str, StateBox]
    parts: tuple[DiagramPart, ...]
    # Action list -> legend number.
    action_legend: dict[tuple[str, ...], int]
    setters: tuple[FieldSetter, ...]
    # Config values other machines' wires put into this machine's events.
    wired_settings: tuple[str, ...] = ()

    def actions_text(self, edge: DiagramEdge) -> str:
        if not edge.actions:
            return ""
        if edge.actions in self.action_legend:
            return f"A{self.action_legend[edge.actions]}"
        return ", ".join(edge.actions)

    def legend_for(self, part: DiagramPart) -> list[tuple[str, str]]:
        used = sorted({self.action_legend[e.actions] for e in part.edges if e.actions in self.action_legend})
        by_number = {n: acts for acts, n in self.action_legend.items()}
        return [(f"A{n}", ", ".join(by_number[n])) for n in used]

    def timers_for(self, part: DiagramPart) -> list[str]:
        timers = [self.states[s].timer for s in part.states]
        read = {f for timer in timers if timer is not None for f in timer.fields}
        own = [s.describe() + (f" — {s.doc}" if s.doc else "") for s in self.setters if s.field in read]
        return own + list(self.wired_settings) if part.shows_initial else own


def _one_line(doc: str | None) -> str:
    return " ".join(doc.split()).rstrip(".") if doc else ""


def _edges(spec: Spec) -> list[tuple[DiagramEdge, type]]:
    """Transitions merged over events, in table order, each with its first event type."""
    merged: dict[tuple, list] = {}
    for t in transitions_of(spec):
        effect = _one_line(t.effect.__doc__) if t.effect is not None and t.src == t.dest else ""
        key = (t.src, t.dest, t.guard_doc, tuple(a.name for a in t.actions), effect)
        if key in merged:
            if event_name(t.event) not in merged[key][0]:
                merged[key][0].append(event_name(t.event))
        else:
            merged[key] = [[event_name(t.event)], t.event]
    return [(DiagramEdge(src, dest, tuple(events), guard, actions, effect), first)
            for (src, dest, guard, actions, effect), (events, first) in merged.items()]


def _part(stem: str, title: str, spec: Spec, edges: list[DiagramEdge], all_states: bool,
          rankdir: str = "TB") -> DiagramPart:
    touched = {e.src for e in edges} | {e.dest for e in edges}
    names = tuple(s.name for s in spec.states if all_states or s.name in touched)
    return DiagramPart(stem, title, names, tuple(edges), spec.initial in names, rankdir)


def machine_diagram(spec: Spec, config, wires: tuple[Wire, ...] = WIRES) -> MachineDiagram:
    timers = state_timers(spec, config)
    states = {
        s.name: StateBox(s.name, tuple(sorted(s.holds)), timers.get(s.name), s.name == spec.initial, s.terminal,
                         s.doc)
        for s in spec.states
    }
    edges = _edges(spec)
    plain = [e for e, _ in edges]
    parts: tuple[DiagramPart, ...]
    if len(plain) > SPLIT_ABOVE and spec.fail_closed_event is not None:
        abort = spec.fail_closed_event
        rest = [e for e, first in edges if first is not abort]
        aborts = [e for e, first in edges if first is abort]
        parts = (
            _part(spec.name, f"{spec.name} without {abort.__name__} (drawn in {spec.name}-abort)", spec, rest, False),
            _part(f"{spec.name}-abort", f"{spec.name}, {abort.__name__} from every live state", spec, aborts, False,
                  "LR"),
        )
    else:
        parts = (_part(spec.name, spec.name, spec, plain, True),)
    legend: dict[tuple[str, ...], int] = {}
    for e in plain:
        if len(e.actions) > INLINE_ACTIONS and e.actions not in legend:
            legend[e.actions] = len(legend) + 1
    return MachineDiagram(spec.name, states, parts, legend, tuple(field_setters(spec, config)),
                          _wired_settings(spec, config, wires))


def _wired_settings(spec: Spec, config, wires: tuple[Wire, ...]) -> tuple[str, ...]:
    """E.g. a decoder's turn-2 hold: LeaseGranted from GrantHold has
    duration = decoder_kv_blocks_ttl 480 s."""
    out = []
    for w in wires:
        if w.target != spec.name:
            continue
        for field, source in w.fields:
            if isinstance(source, ConfigField):
                out.append(f"{w.event.__name__} from {w.action.__name__} has {field} = "
                           f"{Setting(source.name, float(getattr(config, source.name)))}")
    return tuple(out)
