"""Definition-time validation refuses bad machines, naming state and event.

Each test mutates a real spec with attrs.evolve and checks that compiling it
fails with a message that names the state (and event) at fault.  The real
specs compile cleanly, so each message is caused by the mutation alone.
"""
from __future__ import annotations

import attrs
import pytest

from kvplane.statemachines import events as E
from kvplane.statemachines.base import TimerFired
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.machines import SPECS, decode_request, lease, push_write, remote_engine
from kvplane.statemachines.machine import compile_machine
from kvplane.statemachines.spec import (
    Ignore, MachineDefinitionError, ProtocolError, State, Transition, with_timer_ignores,
)
from kvplane.statemachines.table import error as error_rows
from kvplane.statemachines.table import ignore, on
from kvplane.statemachines.validate import validate


def errors_of(spec) -> list[str]:
    with pytest.raises(MachineDefinitionError) as info:
        compile_machine(spec)
    msg = str(info.value)
    assert msg.startswith(f"machine {spec.name!r} is invalid:")
    return [line.strip() for line in msg.splitlines()[1:]]


def replace_rows(spec, match, new=()):
    """Drop the rows for which ``match(row)`` holds, and append ``new``."""
    kept = tuple(r for r in spec.table if not match(r))
    assert len(kept) < len(spec.table), "mutation matched no row"
    return attrs.evolve(spec, table=kept + tuple(new))


def insert_beside(spec, src, event, new, *, after=False):
    """Insert ``new`` right before (or after) the rows of (src, event), so
    they stay adjacent to them."""
    at = [i for i, r in enumerate(spec.table) if r.src == src and r.event is event]
    assert at, "no row of the pair"
    i = at[-1] + 1 if after else at[0]
    return attrs.evolve(spec, table=spec.table[:i] + tuple(new) + spec.table[i:])


def replace_state(spec, name, **changes):
    states = tuple(attrs.evolve(s, **changes) if s.name == name else s for s in spec.states)
    return attrs.evolve(spec, states=states)


def is_row(kind, src, event, dest=None):
    def match(r):
        return (isinstance(r, kind) and r.src == src and r.event is event
                and (dest is None or getattr(r, "dest", None) == dest))
    return match


@pytest.mark.parametrize("name", sorted(SPECS))
def test_real_specs_validate(name):
    validate(with_timer_ignores(SPECS[name]))
    compile_machine(SPECS[name])


def test_undeclared_pair():
    spec = replace_rows(decode_request.SPEC, is_row(ProtocolError, "HEARTBEATING", E.StartLoad))
    assert errors_of(spec) == [
        "HEARTBEATING x StartLoad: undeclared (declare a transition, an Ignore with a reason, or a ProtocolError)"
    ]


def test_remote_waiting_state_without_deadline():
    spec = replace_state(decode_request.SPEC, "READING", deadline=None)
    errs = errors_of(spec)
    assert "READING: waits on a remote party but has no deadline" in errs
    # Without a deadline its TimerFired rows describe a timer that is never armed; nothing else is reported.
    assert all(e.startswith("READING") for e in errs), errs


def test_deadline_expiry_must_be_a_transition():
    spec = replace_rows(lease.SPEC, is_row(Transition, "PARTIALLY_READ", TimerFired),
                        ignore("PARTIALLY_READ", TimerFired, "pretend it cannot happen"))
    errs = errors_of(spec)
    assert "PARTIALLY_READ x TimerFired: state has a deadline, so its expiry must be a transition" in errs


def test_unreachable_state():
    orphan = State("ORPHAN", doc="nothing leads here")
    spec = attrs.evolve(lease.SPEC, states=lease.SPEC.states + (orphan,),
                        table=lease.SPEC.table + tuple(on("ORPHAN", list(lease.EVENTS[1:]), "RELEASED"))
                        + tuple(on("ORPHAN", E.LeaseGranted, "LEASED")))
    assert errors_of(spec) == ["ORPHAN: unreachable from PREFILLING"]


def test_state_that_cannot_reach_a_terminal_state():
    trap = State("TRAP")
    spec = replace_rows(attrs.evolve(lease.SPEC, states=lease.SPEC.states + (trap,)),
                        is_row(Transition, "PREFILLING", E.LeaseAbort),
                        on("PREFILLING", E.LeaseAbort, "TRAP") + on("TRAP", E.LeaseAbort, "TRAP")
                        + ignore("TRAP", [E.LeaseHeartbeat, E.ConsumerDone, TimerFired], "stuck")
                        + error_rows("TRAP", E.LeaseGranted, "blocks cannot be granted here"))
    # Refusing a grant would also strand its blocks (LeaseGranted has no refund).
    assert errors_of(spec) == [
        "TRAP x LeaseGranted: refusing LeaseGranted strands ['blocks']; give LeaseGranted a refund()",
        "TRAP: cannot reach a terminal state",
    ]


def test_resource_not_released_on_a_path():
    # The lease expiry forgets to free the blocks.
    spec = replace_rows(lease.SPEC, is_row(Transition, "LEASED", TimerFired), on("LEASED", TimerFired, "EXPIRED"))
    assert errors_of(spec) == [
        "LEASED -> EXPIRED on TimerFired: 'blocks' is held in LEASED or acquired here but neither released nor held in EXPIRED"
    ]


def test_release_of_something_not_held_double_report():
    # Reporting again when the request starts running: the recv would be reported twice.
    spec = replace_rows(decode_request.SPEC, is_row(Transition, "RECV_DONE", E.RequestRunning),
                        on("RECV_DONE", E.RequestRunning, "RUNNING", decode_request.report_done))
    assert errors_of(spec) == [
        "RECV_DONE -> RUNNING on RequestRunning: releases 'report', which is not held (double release or unawaited report)"
    ]


def test_double_release_within_one_transition():
    spec = replace_rows(lease.SPEC, is_row(Transition, "LEASED", E.LeaseAbort),
                        on("LEASED", E.LeaseAbort, "RELEASED", lease.free_aborted, lease.free_aborted))
    errs = errors_of(spec)
    assert len(errs) == 1 and errs[0].startswith("LEASED -> RELEASED on LeaseAbort:") and "'blocks'" in errs[0]
    assert "more than once" in errs[0]


def test_double_acquire_within_one_transition():
    spec = replace_rows(decode_request.SPEC, is_row(Transition, "NEW", E.NewRequest),
                        on("NEW", E.NewRequest, "HEARTBEATING", decode_request.start_heartbeat, decode_request.start_heartbeat,
                           do=decode_request._accept))
    errs = errors_of(spec)
    assert len(errs) == 1 and errs[0].startswith("NEW -> HEARTBEATING on NewRequest:") and "'heartbeat'" in errs[0]


def test_unawaited_notify_only_recv_cannot_report():
    # A notify-only recv (nobody awaits it) must never be reported.
    spec = replace_rows(decode_request.SPEC, is_row(Transition, "NOTIFYING", E.EngineReady),
                        on("NOTIFYING", E.EngineReady, "RELEASED", decode_request.send_notif, decode_request.stop_heartbeat,
                           decode_request.release_engine, decode_request.report_done))
    errs = errors_of(spec)
    assert errs == ["NOTIFYING -> RELEASED on EngineReady: releases 'report', which is not held "
                    "(double release or unawaited report)"]


def test_ignore_that_would_drop_resources():
    spec = replace_rows(lease.SPEC, is_row(Transition, "LEASED", E.LeaseGranted),
                        ignore("LEASED", E.LeaseGranted, "already leased"))
    assert errors_of(spec) == ["LEASED x LeaseGranted: ignoring LeaseGranted would drop resources ['blocks']"]


def test_terminal_state_holding_a_resource():
    spec = replace_state(lease.SPEC, "EXPIRED", holds={"blocks"})
    errs = errors_of(spec)
    assert "EXPIRED: terminal state holds ['blocks']; they would leak" in errs


def test_terminal_state_accepts_no_events():
    spec = attrs.evolve(lease.SPEC, table=lease.SPEC.table + tuple(ignore("RELEASED", E.LeaseHeartbeat, "late")))
    assert errors_of(spec) == ["RELEASED x LeaseHeartbeat: terminal state RELEASED accepts no events (the plane discards it)"]


def test_shadowing_unguarded_transition():
    spec = insert_beside(decode_request.SPEC, "HEARTBEATING", E.BlocksAllocated,
                         on("HEARTBEATING", E.BlocksAllocated, "NOTIFY_ONLY", do=decode_request._allocated))
    errs = errors_of(spec)
    assert errs == ["HEARTBEATING x BlocksAllocated: unguarded transition to NOTIFY_ONLY shadows the ones after it"]


def test_fail_closed_event_must_be_a_transition_everywhere():
    spec = replace_rows(push_write.SPEC, is_row(Transition, "CONNECTING", E.PushAbort),
                        ignore("CONNECTING", E.PushAbort, "let the deadline handle it"))
    assert errors_of(spec) == ["CONNECTING x PushAbort: the fail-closed event must be a transition in every state"]


def test_pair_declared_twice():
    spec = insert_beside(remote_engine.SPEC, "CONNECTED", E.EngineActivity,
                         ignore("CONNECTED", E.EngineActivity, "twice"), after=True)
    assert errors_of(spec) == ["CONNECTED x EngineActivity: declared more than once (Transition, Ignore)"]


def test_ignore_needs_a_reason():
    spec = replace_rows(lease.SPEC, is_row(Ignore, "PREFILLING", E.LeaseHeartbeat),
                        ignore("PREFILLING", E.LeaseHeartbeat, "  "))
    assert errors_of(spec) == ["PREFILLING x LeaseHeartbeat: Ignore needs a reason"]


def test_unknown_states_are_named():
    spec = attrs.evolve(lease.SPEC, table=lease.SPEC.table + tuple(on("GHOST", E.LeaseAbort, "RELEASED")))
    assert errors_of(spec) == ["GHOST x LeaseAbort: unknown source state 'GHOST'"]
    spec = replace_rows(lease.SPEC, is_row(Transition, "PREFILLING", E.LeaseAbort),
                        on("PREFILLING", E.LeaseAbort, "NOWHERE"))
    assert "PREFILLING x LeaseAbort: unknown destination state 'NOWHERE'" in errors_of(spec)


def test_every_error_is_reported_at_once():
    spec = replace_state(decode_request.SPEC, "READING", deadline=None)
    spec = replace_rows(spec, is_row(ProtocolError, "HEARTBEATING", E.StartLoad))
    errs = errors_of(spec)
    assert any(e.startswith("READING: waits on a remote party") for e in errs)
    assert any(e.startswith("HEARTBEATING x StartLoad: undeclared") for e in errs)


# ------------------------------------------------- a machine that uses another machine's resource
def test_source_end_must_end_the_machine_in_every_live_state():
    """A push that ignored the end of its lease would outlive the blocks it WRITEs from."""
    spec = replace_rows(push_write.SPEC, is_row(Transition, "WRITING", E.SourceEnded),
                        ignore("WRITING", E.SourceEnded, "let the WRITE finish"))
    assert errors_of(spec) == ["WRITING x SourceEnded: the end of the source must end the machine (a transition "
                               "to a terminal state) in every live state"]
    spec = replace_rows(push_write.SPEC, is_row(Transition, "CONNECTING", E.SourceEnded),
                        on("CONNECTING", E.SourceEnded, "CONNECTING"))
    assert "CONNECTING x SourceEnded: the end of the source must end the machine (a transition to a terminal " \
           "state) in every live state" in errors_of(spec)


def test_a_write_from_a_state_that_does_not_need_the_source_is_refused():
    """REGISTERED has no blocks yet (the lease may not exist): no WRITE from there."""
    spec = replace_rows(push_write.SPEC, is_row(Transition, "REGISTERED", E.PushReady),
                        on("REGISTERED", E.PushReady, "WRITING", push_write.acquire_engine, push_write.post_write,
                           do=push_write._ready))
    assert "REGISTERED -> WRITING on PushReady: builds PostWrite, which uses lease's resource, from a state " \
           "outside source.needs (the source may not hold it)" in errors_of(spec)


def test_source_needs_live_states():
    spec = attrs.evolve(push_write.SPEC, source=attrs.evolve(push_write.SOURCE, needs=("WRITING", "DONE")))
    assert "source.needs: 'DONE' is not a live state of the machine" in errors_of(spec)


def test_a_plane_refuses_a_source_that_is_not_one_of_its_machines():
    from kvplane.statemachines.machines import MACHINES
    from kvplane.statemachines.plane import ControlPlane
    from kvplane.statemachines.machine import compile_machine as build

    ghost = build(attrs.evolve(push_write.SPEC, source=attrs.evolve(push_write.SOURCE, kind="ghost")))
    with pytest.raises(MachineDefinitionError, match="push_write: source kind 'ghost' is not a machine"):
        ControlPlane(machines={**MACHINES, "push_write": ghost})
    terminal = build(attrs.evolve(push_write.SPEC, source=attrs.evolve(push_write.SOURCE, held=("EXPIRED",))))
    with pytest.raises(MachineDefinitionError, match="source state 'EXPIRED' is not a live state of lease"):
        ControlPlane(machines={**MACHINES, "push_write": terminal})


# ------------------------------------------------- guard groups and row order
def test_rows_of_one_pair_must_be_adjacent():
    # Two rows of LEASED x LeaseAbort, split by another pair's row: their
    # order is their priority, which a reader must see in one place.
    spec = replace_rows(lease.SPEC, is_row(Transition, "LEASED", E.LeaseAbort))
    guarded = on("LEASED", E.LeaseAbort, "RELEASED", lease.free_aborted, when=lease.renewable)
    fallback = on("LEASED", E.LeaseAbort, "RELEASED", lease.free_aborted)
    table = spec.table
    i = next(i for i, r in enumerate(table) if r.src == "LEASED" and r.event is TimerFired)
    spec = attrs.evolve(spec, table=table[:i] + tuple(guarded) + (table[i],) + tuple(fallback) + table[i + 1:])
    errs = errors_of(spec)
    assert len(errs) == 1 and errs[0].startswith("LEASED x LeaseAbort: its rows are not adjacent (table rows [")
    # The same rows together are a valid table.
    compile_machine(insert_beside(replace_rows(lease.SPEC, is_row(Transition, "LEASED", E.LeaseAbort)),
                                  "LEASED", TimerFired, guarded + fallback, after=True))


def test_a_guarded_group_must_end_unguarded_or_in_an_error():
    spec = replace_rows(lease.SPEC, is_row(Transition, "LEASED", E.LeaseAbort),
                        on("LEASED", E.LeaseAbort, "RELEASED", lease.free_aborted, when=lease.renewable))
    assert errors_of(spec) == [
        "LEASED x LeaseAbort: the guarded rows end with a guard ('renewable lease'); end them with an unguarded row "
        "or an error() row for when no guard holds"]


def test_an_error_row_closes_a_guarded_group_and_is_what_no_guard_means():
    from kvplane.statemachines.machine import ProtocolViolation
    from kvplane.statemachines.reference import ReferenceMachine

    spec = replace_rows(lease.SPEC, is_row(Transition, "LEASED", E.LeaseHeartbeat))
    spec = insert_beside(spec, "LEASED", E.ConsumerDone,
                         on("LEASED", E.LeaseHeartbeat, "LEASED", lease.refuse_foreign_sender, when=lease.foreign_sender)
                         + on("LEASED", E.LeaseHeartbeat, "LEASED", when=lease.renewable, do=lease._extend)
                         + error_rows("LEASED", E.LeaseHeartbeat, "a fixed-TTL hold takes no heartbeat"))
    cfg = PlaneConfig()
    for m in (compile_machine(spec), ReferenceMachine(spec)):
        hold = m.new("H")
        m.handle(hold, E.LeaseGranted(request_id="H", block_ids=(1,), renewable=False), cfg, 0.0)
        with pytest.raises(ProtocolViolation) as info:
            m.handle(hold, E.LeaseHeartbeat(request_id="H"), cfg, 1.0)
        assert info.value.reason == "a fixed-TTL hold takes no heartbeat" and hold.state == "LEASED"
        lease_ = m.new("L")
        m.handle(lease_, E.LeaseGranted(request_id="L", block_ids=(1,)), cfg, 0.0)
        expiry = lease_.expiry
        m.handle(lease_, E.LeaseHeartbeat(request_id="L"), cfg, expiry - 1.0)
        assert lease_.state == "LEASED" and lease_.expiry > expiry


def test_an_error_row_after_an_unguarded_one_is_unreachable():
    spec = insert_beside(lease.SPEC, "LEASED", E.LeaseHeartbeat,
                         error_rows("LEASED", E.LeaseHeartbeat, "never"), after=True)
    assert errors_of(spec) == [
        "LEASED x LeaseHeartbeat: the error row after the unguarded transition to LEASED is never reached"]


def test_an_error_row_may_only_close_transitions():
    spec = insert_beside(lease.SPEC, "PREFILLING", E.LeaseHeartbeat,
                         error_rows("PREFILLING", E.LeaseHeartbeat, "twice"), after=True)
    assert errors_of(spec) == ["PREFILLING x LeaseHeartbeat: declared more than once (Ignore, ProtocolError)"]

