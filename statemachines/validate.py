"""Definition-time validation: a machine that fails here is never built.

Checks, each reported with the state (and event) at fault:
- every (non-terminal state, event) pair is declared exactly once: guarded
  transitions, an ignore with a reason, or a protocol error; terminal
  instances are discarded by the plane, so they accept nothing;
- the rows of one pair are adjacent in the table (their order is their
  priority, so it must read as one list), and a group of guarded transitions
  ends in an unguarded one or in an explicit error for when no guard holds;
- a state that waits on a remote party has a deadline, and a state with a
  deadline handles TimerFired with a transition;
- every state is reachable from the initial one and can reach a terminal one;
- resources balance on every transition:
    held(dest) == held(src) + acquired - released, released <= held(src) + acquired
  and no transition releases or acquires one resource twice, and terminal
  states hold nothing.  By induction every path to a terminal
  state releases everything any state on it acquired, and nothing is
  released twice;
- an ignored event never carries resources (ignoring it would drop them);
- a machine that uses another machine's resource (``Spec.source``) ends on
  ``source.ended`` from every live state, and builds an action that uses
  the resource only from a state that needs it, where the plane guarantees
  the source holds it (``validate_sources`` checks the other side).
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque

from .base import Event, TimerFired
from .spec import Ignore, MachineDefinitionError, ProtocolError, Source, Spec, Transition


def _name(cls: type) -> str:
    return cls.__name__


def validate(spec: Spec) -> None:
    errors: list[str] = []
    err = errors.append
    states = {s.name: s for s in spec.states}
    if len(states) != len(spec.states):
        err("duplicate state names")
    if spec.initial not in states:
        err(f"initial state {spec.initial!r} is not declared")
    alphabet = set(spec.events)

    entries: dict[tuple[str, type], list] = defaultdict(list)
    rows_at: dict[tuple[str, type], list[int]] = defaultdict(list)
    for i, e in enumerate(spec.table):
        rows_at[(e.src, e.event)].append(i)
        where = f"{e.src} x {_name(e.event)}"
        if e.src not in states:
            err(f"{where}: unknown source state {e.src!r}")
            continue
        if e.event not in alphabet:
            err(f"{where}: event {_name(e.event)} is not in the machine's events")
        if isinstance(e, Transition) and e.dest not in states:
            err(f"{where}: unknown destination state {e.dest!r}")
            continue
        if states[e.src].terminal:
            err(f"{where}: terminal state {e.src} accepts no events (the plane discards it)")
        entries[(e.src, e.event)].append(e)

    # Completeness and well-formed entries.
    for s in spec.states:
        if s.terminal:
            continue
        for ev in spec.events:
            got = entries.get((s.name, ev), [])
            where = f"{s.name} x {_name(ev)}"
            if not got:
                err(f"{where}: undeclared (declare a transition, an Ignore with a reason, or a ProtocolError)")
                continue
            at = rows_at[(s.name, ev)]
            if at[-1] - at[0] != len(at) - 1:
                err(f"{where}: its rows are not adjacent (table rows {at}); their order is their priority, "
                    f"keep them together")
            # A group: transitions, tried in order, optionally closed by the
            # error for when no guard holds.  Otherwise one Ignore or error.
            closing = got[-1] if len(got) > 1 and isinstance(got[-1], ProtocolError) else None
            body = got[:-1] if closing is not None else got
            grouped = all(isinstance(x, Transition) for x in body)
            if not grouped and len(got) > 1:
                err(f"{where}: declared more than once ({', '.join(type(x).__name__ for x in got)})")
                continue
            if grouped:
                for t in body[:-1]:
                    if t.guard is None:
                        err(f"{where}: unguarded transition to {t.dest} shadows the ones after it")
                last = body[-1]
                if closing is None and last.guard is not None:
                    err(f"{where}: the guarded rows end with a guard ({last.guard_doc!r}); end them with an "
                        f"unguarded row or an error() row for when no guard holds")
                if closing is not None and last.guard is None:
                    err(f"{where}: the error row after the unguarded transition to {last.dest} is never reached")
            only = closing if closing is not None else None if grouped else got[0]
            if only is not None:
                if not only.reason.strip():
                    err(f"{where}: {type(only).__name__} needs a reason")
                if isinstance(only, Ignore) and (ev.acquires or ev.releases):
                    err(f"{where}: ignoring {_name(ev)} would drop resources {sorted(ev.acquires | ev.releases)}")
                if isinstance(only, ProtocolError) and ev.acquires and ev.refund is Event.refund:
                    err(f"{where}: refusing {_name(ev)} strands {sorted(ev.acquires)}; give {_name(ev)} a refund()")

    # Deadlines.
    for s in spec.states:
        if s.terminal:
            if s.deadline is not None:
                err(f"{s.name}: terminal state has a deadline")
            if s.holds:
                err(f"{s.name}: terminal state holds {sorted(s.holds)}; they would leak")
            continue
        if s.waits_on_remote and s.deadline is None:
            err(f"{s.name}: waits on a remote party but has no deadline")
        timer = entries.get((s.name, TimerFired), [])
        if s.deadline is not None and not all(isinstance(t, Transition) for t in timer):
            err(f"{s.name} x TimerFired: state has a deadline, so its expiry must be a transition")
    if spec.initial in states and states[spec.initial].holds:
        err(f"{spec.initial}: the initial state cannot hold resources")

    # Resource accounting on every transition.
    for t in spec.table:
        if not isinstance(t, Transition) or t.src not in states or t.dest not in states:
            continue
        where = f"{t.src} -> {t.dest} on {_name(t.event)}"
        held_src, held_dst = states[t.src].holds, states[t.dest].holds
        acquired = set(t.event.acquires) | set(t.acquires)
        released = set(t.event.releases)
        # Sets would hide a resource released (or acquired) twice by one transition.
        release_counts = Counter(t.event.releases)
        acquire_counts = Counter(acquired)
        # Released, then acquired again by a later action (a reference given
        # back and taken anew): held after the transition.
        reacquired: set = set()
        for a in t.actions:
            reacquired |= a.acquires & released
            acquired |= a.acquires
            released |= a.releases
            release_counts.update(a.releases)
            acquire_counts.update(a.acquires)
        for r, n in sorted(release_counts.items()):
            if n > 1:
                err(f"{where}: releases {r!r} more than once (double release)")
        for r, n in sorted(acquire_counts.items()):
            if n > 1:
                err(f"{where}: acquires {r!r} more than once (the second would leak)")
        available = held_src | acquired
        for r in sorted(released - available):
            err(f"{where}: releases {r!r}, which is not held (double release or unawaited report)")
        expected = (available - released) | reacquired
        for r in sorted(expected - held_dst):
            err(f"{where}: {r!r} is held in {t.src} or acquired here but neither released nor held in {t.dest}")
        for r in sorted(held_dst - expected):
            err(f"{where}: {t.dest} holds {r!r}, which this transition neither had nor acquired")

    # Reachability, both ways.
    graph: dict[str, set[str]] = defaultdict(set)
    for t in spec.table:
        if isinstance(t, Transition):
            graph[t.src].add(t.dest)
    if spec.initial in states:
        seen = _closure(spec.initial, graph)
        for s in spec.states:
            if s.name not in seen:
                err(f"{s.name}: unreachable from {spec.initial}")
    reverse: dict[str, set[str]] = defaultdict(set)
    for src, dests in graph.items():
        for d in dests:
            reverse[d].add(src)
    can_finish: set[str] = set()
    for s in spec.states:
        if s.terminal:
            can_finish |= _closure(s.name, reverse)
    if not any(s.terminal for s in spec.states):
        err("machine has no terminal state")
    for s in spec.states:
        if s.name not in can_finish:
            err(f"{s.name}: cannot reach a terminal state")

    if spec.fail_closed_event is not None:
        fc = spec.fail_closed_event
        if fc not in alphabet:
            err(f"fail_closed_event {_name(fc)} is not in the machine's events")
        for s in spec.states:
            got = entries.get((s.name, fc), [])
            if not s.terminal and s.name != spec.initial and not all(isinstance(t, Transition) for t in got):
                err(f"{s.name} x {_name(fc)}: the fail-closed event must be a transition in every state")

    if spec.source is not None:
        _check_source(spec, spec.source, states, entries, err)

    if errors:
        raise MachineDefinitionError(f"machine {spec.name!r} is invalid:\n  " + "\n  ".join(errors))


def _check_source(spec: Spec, src: Source, states: dict, entries: dict, err) -> None:
    ended = src.ended
    if ended not in spec.events:
        err(f"source.ended {_name(ended)} is not in the machine's events")
    for name in sorted(src.needs):
        if name not in states or states[name].terminal:
            err(f"source.needs: {name!r} is not a live state of the machine")
    for s in spec.states:
        if s.terminal or s.name == spec.initial:
            continue
        got = entries.get((s.name, ended), [])
        if not got or not all(isinstance(t, Transition) and states.get(t.dest) is not None
                               and states[t.dest].terminal for t in got):
            err(f"{s.name} x {_name(ended)}: the end of the source must end the machine (a transition to a "
                f"terminal state) in every live state")
    for t in spec.table:
        if isinstance(t, Transition):
            for a in t.actions:
                if any(issubclass(a.action, u) for u in src.uses) and t.src not in src.needs:
                    err(f"{t.src} -> {t.dest} on {_name(t.event)}: builds {_name(a.action)}, which uses "
                        f"{src.kind}'s resource, from a state outside source.needs (the source may not hold it)")


def validate_sources(specs: dict[str, Spec]) -> None:
    """The composition side of ``Spec.source``: the source kind exists, its
    held states are its states, and none of them is terminal (the plane sees
    a source leave them only on a transition)."""
    errors = []
    for name, spec in specs.items():
        src = spec.source
        if src is None:
            continue
        other = specs.get(src.kind)
        if other is None:
            errors.append(f"{name}: source kind {src.kind!r} is not a machine of this plane")
            continue
        known = {s.name: s for s in other.states}
        for h in sorted(src.held):
            if h not in known or known[h].terminal:
                errors.append(f"{name}: source state {h!r} is not a live state of {src.kind}")
    if errors:
        raise MachineDefinitionError("machine sources are invalid:\n  " + "\n  ".join(errors))


def _closure(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen = {start}
    todo = deque([start])
    while todo:
        for nxt in graph.get(todo.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen
