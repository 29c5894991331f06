"""The engine-side request machine (``machines/engine_request``): every row
of its table through ``Machine.handle``, the engine's obligations counted
from what it emits and accepts on every path, the validator catching a
table that drops one, and the vLLM call orders it answers."""
from __future__ import annotations

import attrs
import pytest

from kvplane.statemachines import engine_calls as C
from kvplane.statemachines.base import ArmTimer, CancelTimer, TimerFired
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.machine import IGNORED, ProtocolViolation, compile_machine
from kvplane.statemachines.machines import engine_request as ER
from kvplane.statemachines.spec import Ignore, MachineDefinitionError, ProtocolError, Transition

CFG = PlaneConfig()
MACHINE = compile_machine(ER.SPEC)
S = ER.EngineState
RID = "r1"

# One event per guard that makes it true (and every guard before it in its
# group false); the unguarded rows get the event of the pair's last case.
# The consumer declines a read of fewer than 16 tokens (PLAIN's EngineMatched
# reads 24; the guard's 8).
BY_GUARD = {
    ER.consumer: C.EngineNewRequest(request_id=RID, remote_prefill=True, recompute_below=16),
    ER.below_recompute_threshold: C.EngineMatched(request_id=RID, num_prompt_tokens=40, num_computed_tokens=32),
    ER.producer: C.EngineNewRequest(request_id=RID, remote_decode=True),
    ER.external_tokens: C.EngineAllocated(request_id=RID, block_ids=(4, 5, 6), num_external_tokens=40),
    ER.leased: C.EngineFinished(request_id=RID, normal=True, block_ids=(1, 2, 3)),
    ER.hold_for_next_turn: C.EngineFinished(request_id=RID, normal=True, block_ids=(4, 5, 6),
                                            hold_for_next_turn=True),
    ER.recv_ok: C.RecvFinished(request_id=RID, ok=True),
    ER.serves: C.EngineFinished(request_id=RID, normal=True, block_ids=(4, 5, 6), serve_remote_decode=True),
}
PLAIN = {
    C.EngineNewRequest: C.EngineNewRequest(request_id=RID),
    C.EngineMatched: C.EngineMatched(request_id=RID, num_prompt_tokens=40, num_computed_tokens=16),
    C.EngineAllocated: C.EngineAllocated(request_id=RID, num_external_tokens=0),
    C.EngineScheduled: C.EngineScheduled(request_id=RID),
    C.EnginePreempted: C.EnginePreempted(request_id=RID),
    C.EngineFinished: C.EngineFinished(request_id=RID, normal=False, block_ids=(4, 5, 6)),
    C.RecvFinished: C.RecvFinished(request_id=RID, ok=False),
    C.SendingFinished: C.SendingFinished(request_id=RID),
    C.EngineLeaseAbort: C.EngineLeaseAbort(request_id=RID),
}

# How to reach each state with the engine's calls ("timer": its deadline fires).
PATHS = {
    S.NEW: [],
    S.QUEUED: [BY_GUARD[ER.consumer]],
    S.AWAITING_RECV: [BY_GUARD[ER.consumer], BY_GUARD[ER.external_tokens]],
    S.LOCAL: [BY_GUARD[ER.consumer], PLAIN[C.EngineAllocated]],
    S.PREFILLING: [BY_GUARD[ER.producer]],
}
PATHS[S.OVERDUE] = PATHS[S.AWAITING_RECV] + ["timer"]
PATHS[S.ABORTING] = PATHS[S.AWAITING_RECV] + [PLAIN[C.EngineFinished]]
PATHS[S.RECV_DONE] = PATHS[S.AWAITING_RECV] + [BY_GUARD[ER.recv_ok]]
PATHS[S.RECV_FAILED] = PATHS[S.AWAITING_RECV] + [PLAIN[C.RecvFinished]]
PATHS[S.RUNNING] = PATHS[S.RECV_DONE] + [PLAIN[C.EngineScheduled]]
PATHS[S.HELD] = PATHS[S.RUNNING] + [BY_GUARD[ER.hold_for_next_turn]]
PATHS[S.FREEING] = PATHS[S.HELD] + ["timer"]
PATHS[S.LEASED] = PATHS[S.PREFILLING] + [BY_GUARD[ER.leased]]


class Drive:
    def __init__(self):
        self.inst = MACHINE.new(RID)
        self.now = 100.0

    def __call__(self, event, dt: float = 1.0):
        if event == "timer":
            assert self.inst.deadline is not None, f"{self.inst.state} has no deadline"
            self.now = self.inst.deadline
            event = TimerFired(ER.SPEC.name, RID, self.now)
        else:
            self.now += dt
        return MACHINE.handle(self.inst, event, CFG, self.now)


def at(state) -> Drive:
    drive = Drive()
    for event in PATHS[state]:
        out = drive(event)
        assert out is not IGNORED
    assert drive.inst.state == state
    return drive


def test_every_live_state_has_a_path():
    assert set(PATHS) == {s for s in S if s != S.ENDED}


def _event_for(row: Transition):
    if row.event is TimerFired:
        return "timer"
    return BY_GUARD[row.guard] if row.guard is not None else PLAIN[row.event]


def _entries():
    spec = ER.SPEC
    for i, row in enumerate(spec.table):
        yield pytest.param(row, id=f"{i}-{row.src}-{row.event.__name__}-{type(row).__name__}")


@pytest.mark.parametrize("row", list(_entries()))
def test_every_row_does_what_the_table_says(row):
    drive = at(row.src)
    before = attrs.evolve(drive.inst)
    if isinstance(row, Ignore):
        assert drive(PLAIN[row.event]) is IGNORED
        assert drive.inst == before
        return
    if isinstance(row, ProtocolError):
        event = PLAIN[row.event]
        if (row.src, row.event) == (S.NEW, C.EngineNewRequest):
            event = PLAIN[C.EngineNewRequest]  # neither role: the group's closing error
        with pytest.raises(ProtocolViolation):
            drive(event)
        assert drive.inst == before
        return
    out = list(drive(_event_for(row)))
    assert drive.inst.state == row.dest
    timers = [a for a in out if isinstance(a, (ArmTimer, CancelTimer))]
    assert [type(a) for a in out[:len(out) - len(timers)]] == [e.action for e in row.actions]
    if MACHINE.states[row.dest].deadline is not None:
        assert drive.inst.deadline is not None and drive.inst.deadline > drive.now
    else:
        assert drive.inst.deadline is None


def test_no_state_holds_on_to_a_timer_it_does_not_need():
    for state in PATHS:
        drive = at(state)
        assert (drive.inst.deadline is not None) == (MACHINE.states[state].deadline is not None), state


# ------------------------------------------------------------ obligations

@attrs.define
class Ledger:
    """The engine's obligations, counted from what the machine emitted and
    which reports it accepted (not from the table's resource declarations)."""

    rank_requests: int = 0  # started on the ranks, not ended
    awaited: int = 0  # recvs the engine awaits, not reported
    delayed: int = 0  # delay-free answers without their finished_sending
    leases: int = 0
    finishes_unanswered: int = 0

    def take(self, event, actions) -> None:
        if isinstance(event, C.EngineFinished):
            self.finishes_unanswered += 1
        if isinstance(event, C.RecvFinished):
            self.awaited -= 1
        if isinstance(event, C.SendingFinished):
            self.delayed -= 1
            self.leases -= 1
        for a in actions:
            if isinstance(a, C.SendNewRemote):
                self.rank_requests += 1
            elif isinstance(a, (C.SendNotifyOnly, C.SendFinish, C.SendAbort)):
                self.rank_requests -= 1
            elif isinstance(a, C.SendLoad):
                self.awaited += 1
            elif isinstance(a, C.AnswerDelayFree):
                self.delayed += 1
                self.finishes_unanswered -= 1
            elif isinstance(a, C.AnswerFinished):
                self.finishes_unanswered -= 1
            elif isinstance(a, C.GrantLease):
                self.leases += 1

    def nothing_owed(self) -> bool:
        return attrs.astuple(self) == (0, 0, 0, 0, 0)

    def never_negative(self) -> bool:
        return min(attrs.astuple(self)) >= 0


STIMULI = [*BY_GUARD.values(), *PLAIN.values(), "timer"]


def test_every_path_ends_owing_nothing_and_never_over_reports():
    """Every sequence of the engine's calls and the workers' reports (up to
    9 of them, each guard's case and the plain one, timers included) the
    machine accepts: nothing is reported twice or unawaited (the counts never
    go negative) and every path that ends has ended every obligation."""
    ended = 0
    frontier = [(Drive(), Ledger())]
    for _depth in range(9):
        nxt = []
        for drive, ledger in frontier:
            for stimulus in STIMULI:
                if stimulus == "timer" and drive.inst.deadline is None:
                    continue
                d2, l2 = Drive(), attrs.evolve(ledger)
                d2.inst, d2.now = attrs.evolve(drive.inst), drive.now
                try:
                    out = d2(stimulus)
                except ProtocolViolation:
                    continue
                if out is IGNORED:
                    continue
                event = None if stimulus == "timer" else stimulus
                l2.take(event, out)
                assert l2.never_negative(), (drive.inst.state, stimulus, l2)
                if d2.inst.state == S.ENDED:
                    assert l2.nothing_owed(), (stimulus, l2)
                    ended += 1
                else:
                    nxt.append((d2, l2))
        # States repeat: keep one representative per (state, ledger).
        seen = {}
        for d2, l2 in nxt:
            seen.setdefault((d2.inst.state, attrs.astuple(l2)), (d2, l2))
        frontier = list(seen.values())
    assert ended > 20


def _without(table, src, event, replacement=()):
    rows = [r for r in table if (r.src, r.event) != (src, event)]
    at = next(i for i, r in enumerate(table) if (r.src, r.event) == (src, event))
    return tuple(rows[:at]) + tuple(replacement) + tuple(rows[at:])


@pytest.mark.parametrize("src,event,replacement,complaint", [
    # An abort before allocation that does not tell the ranks (P would wait for its lease).
    (S.QUEUED, C.EngineFinished, [Transition(S.QUEUED, C.EngineFinished, S.ENDED)], "rank_request"),
    # A report after the recv was reported, taken as harmless.
    (S.RUNNING, C.RecvFinished, [Ignore(S.RUNNING, C.RecvFinished, "late")], "drop resources"),
    # An awaited recv the engine forgets when the request is aborted.
    (S.AWAITING_RECV, C.EngineFinished, [Transition(S.AWAITING_RECV, C.EngineFinished, S.ENDED)], "recv_report"),
    # P's blocks freed with no finished_sending (the delay-free answer left open).
    (S.LEASED, C.SendingFinished, [], "undeclared"),
])
def test_the_validator_catches_a_table_that_drops_an_obligation(src, event, replacement, complaint):
    broken = attrs.evolve(ER.SPEC, table=_without(ER.SPEC.table, src, event, replacement))
    with pytest.raises(MachineDefinitionError, match=complaint):
        compile_machine(broken)


# ------------------------------------------------------------ vLLM's call orders

def run(calls):
    drive = Drive()
    out = []
    for call in calls:
        got = drive(call)
        out += [a for a in got if not isinstance(a, (ArmTimer, CancelTimer))]
    return drive, out


def test_d_lifecycle_as_vllm_calls_it():
    drive, out = run([
        C.EngineNewRequest(request_id=RID, remote_prefill=True),
        C.EngineMatched(request_id=RID, num_prompt_tokens=40, num_computed_tokens=0),
        C.EngineAllocated(request_id=RID, block_ids=(1, 2, 3), num_external_tokens=40),
        C.RecvFinished(request_id=RID, ok=True),
        C.EngineAllocated(request_id=RID),  # scheduled after the recv: allocated again, 0 tokens
        C.EngineScheduled(request_id=RID),
        C.EngineScheduled(request_id=RID),
        C.EngineFinished(request_id=RID, normal=True, block_ids=(1, 2, 3)),
    ])
    assert out == [C.SendNewRemote(RID), C.AnswerMatched(RID, 40, True), C.SendLoad(RID, (1, 2, 3), 40),
                   C.TellRecvFinished(RID, True), C.SendRunning(RID), C.SendFinish(RID, (1, 2, 3)),
                   C.AnswerFinished(RID)]
    assert drive.inst.state == S.ENDED


def test_p_lifecycle_as_vllm_calls_it():
    drive, out = run([
        C.EngineNewRequest(request_id=RID, remote_decode=True),
        C.EngineMatched(request_id=RID, num_prompt_tokens=40, num_computed_tokens=0),
        C.EngineAllocated(request_id=RID, block_ids=(1, 2, 3)),
        C.EngineScheduled(request_id=RID),
        C.EngineFinished(request_id=RID, normal=True, block_ids=(1, 2, 3)),
    ])
    assert out == [C.AnswerMatched(RID, 0, False), C.GrantLease(RID, (1, 2, 3)), C.AnswerDelayFree(RID, (1, 2, 3))]
    assert drive.inst.state == S.LEASED
    with pytest.raises(ProtocolViolation):
        drive(C.RecvFinished(request_id=RID))  # P awaits no recv
    assert C.TellSendingFinished(RID) in drive(C.SendingFinished(request_id=RID))  # get_finished names it
    assert drive.inst.state == S.ENDED


def test_aborted_before_allocation_tells_p_and_awaits_nothing():
    drive, out = run([C.EngineNewRequest(request_id=RID, remote_prefill=True),
                      C.EngineFinished(request_id=RID, normal=False)])
    assert out == [C.SendNewRemote(RID), C.SendNotifyOnly(RID), C.AnswerFinished(RID)]
    assert drive.inst.state == S.ENDED


def test_aborted_while_awaited_waits_for_the_one_report():
    drive, out = run(PATHS[S.AWAITING_RECV] + [C.EngineFinished(request_id=RID, normal=False)])
    assert out[-2:] == [C.SendAbort(RID), C.AnswerFinished(RID)] and drive.inst.state == S.ABORTING
    # The engine keeps the blocks until get_finished names the recv (failed).
    assert C.TellRecvFinished(RID, False) in drive(C.RecvFinished(request_id=RID, ok=False))
    assert drive.inst.state == S.ENDED


def test_a_second_report_is_refused():
    drive = at(S.RECV_DONE)
    with pytest.raises(ProtocolViolation, match="does not await"):
        drive(C.RecvFinished(request_id=RID))


def test_a_recv_the_ranks_never_report_is_aborted_there_then_flagged():
    drive = at(S.AWAITING_RECV)
    assert drive.inst.deadline == pytest.approx(drive.now + CFG.recv_timeout + ER.GRACE_S)
    assert [a for a in drive("timer") if isinstance(a, C.SendAbort)] == [C.SendAbort(RID)]
    assert drive.inst.state == S.OVERDUE
    flagged = [a for a in drive("timer") if isinstance(a, C.FlagOverdue)]
    assert flagged == [C.FlagOverdue(RID, "recv report")] and drive.inst.state == S.OVERDUE
    drive(C.RecvFinished(request_id=RID, ok=False))
    assert drive.inst.state == S.LOCAL  # the engine computes it alone; the ranks hold nothing


def test_a_lease_kept_by_heartbeats_is_only_watched():
    drive = at(S.LEASED)
    for _ in range(3):
        out = drive("timer")
        assert [a for a in out if isinstance(a, C.FlagOverdue)] == [C.FlagOverdue(RID, "finished_sending")]
        assert not [a for a in out if isinstance(a, C.SendLeaseAbort)] and drive.inst.state == S.LEASED


def test_preempted_after_its_recv_it_loads_nothing_again():
    drive, out = run(PATHS[S.RUNNING] + [
        C.EnginePreempted(request_id=RID),
        C.EngineMatched(request_id=RID, num_prompt_tokens=40, num_computed_tokens=0),
        C.EngineAllocated(request_id=RID, num_external_tokens=0),
        C.EngineScheduled(request_id=RID)])
    assert out[-1] == C.AnswerMatched(RID, 0, False) and drive.inst.state == S.RUNNING
    assert len([a for a in out if isinstance(a, C.SendLoad)]) == 1


def test_the_alphabet_is_the_engine_calls_and_the_reports():
    calls = {C.EngineNewRequest, C.EngineMatched, C.EngineAllocated, C.EngineScheduled, C.EnginePreempted,
             C.EngineFinished, C.EngineLeaseAbort}
    assert set(ER.SPEC.events) == calls | {C.RecvFinished, C.SendingFinished, TimerFired}
    assert all(e.machine == "engine_request" for e in calls | {C.RecvFinished, C.SendingFinished})
    assert ER.SPEC.created_by == (C.EngineNewRequest,)
