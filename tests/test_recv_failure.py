"""Why a recv failed: a typed reason each ``decode_request`` row names on its
``ReportRecv(ok=False)``, carried from the rank's plane to the scheduler
side (``records.WorkerReport.fail_reasons``) and through the event log."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import attrs
import pytest

from loopback_support import Clock, run
from split_support import engine_pair

from kvplane.connector.records import RecvFailure, WorkerReport
from kvplane.statemachines import actions as A
from kvplane.statemachines import events as E
from kvplane.statemachines.base import TimerFired
from kvplane.statemachines.eventlog import MalformedLine, MemoryLog, same_actions
from kvplane.statemachines.machines import decode_request as DR
from kvplane.statemachines.plane import ControlPlane
from kvplane.statemachines.replay import replay
from kvplane.statemachines.spec import MachineDefinitionError, Transition


def test_a_report_carries_typed_reasons_and_refuses_unknown_ones():
    report = WorkerReport(rank=0, failed_recving={"a"}, fail_reasons=[("a", "transfer failed")])
    assert report.fail_reasons == (("a", RecvFailure.TRANSFER_FAILED),)
    copy = pickle.loads(pickle.dumps(report))
    assert copy == report and type(copy.fail_reasons[0][1]) is RecvFailure
    with pytest.raises(ValueError):
        WorkerReport(rank=0, failed_recving={"a"}, fail_reasons=[("a", "it broke")])


def _reports(src: str, event: type) -> list[A.ReportRecv]:
    """What the reports of the rows (src, event) build, on a probe request."""
    probe = DR.DecodeRequest(key="r1", state=src, block_ids=(1, 2))
    return [entry.build(probe, None, None, 0.0) for row in DR.TABLE
            if isinstance(row, Transition) and row.src == src and row.event is event
            for entry in row.actions if entry.action is A.ReportRecv]


@pytest.mark.parametrize("src,event,reason", [
    ("HANDSHAKING", "EngineReady", {RecvFailure.DECLINED, RecvFailure.OTHER_INCARNATION}),
    ("HANDSHAKING", "EngineLost", {RecvFailure.HANDSHAKE_FAILED}),
    ("HANDSHAKING", "TimerFired", {RecvFailure.HANDSHAKE_TIMEOUT}),
    ("READING", "ReadFailed", {RecvFailure.TRANSFER_FAILED}),
    ("READING", "TimerFired", {RecvFailure.TRANSFER_DEADLINE}),
    ("READING", "EngineLost", {RecvFailure.ENGINE_LOST}),
    ("AWAITING_PUSH", "TimerFired", {RecvFailure.PUSH_TIMEOUT}),
    ("AWAITING_PUSH", "EngineLost", {RecvFailure.ENGINE_LOST}),
    ("WAITING_FOR_REMOTE_KVS", "TimerFired", {RecvFailure.RECV_TIMEOUT}),
    ("FULL_PREFIX_HIT", "TimerFired", {RecvFailure.RECV_TIMEOUT}),
    ("READING", "Abort", {RecvFailure.ABORTED}),
    ("AWAITING_PUSH", "Abort", {RecvFailure.ABORTED}),
    ("WAITING_FOR_REMOTE_KVS", "Abort", {RecvFailure.ABORTED}),
])
def test_each_failing_row_names_its_reason(src, event, reason):
    cls = TimerFired if event == "TimerFired" else next(e for e in DR.EVENTS if e.__name__ == event)
    failed = [a for a in _reports(src, cls) if not a.ok]
    assert failed and {a.reason for a in failed} == reason
    assert all(a.failed_block_ids == (1, 2) for a in failed)


def test_every_report_in_the_table_names_a_reason_exactly_when_it_failed():
    reports = [entry.build(DR.DecodeRequest(key="r", state="NEW"), None, None, 0.0)
               for row in DR.TABLE if isinstance(row, Transition)
               for entry in row.actions if entry.action is A.ReportRecv]
    assert reports and all((a.reason is None) == a.ok for a in reports)


def test_a_failed_report_without_a_reason_is_refused_at_definition():
    @DR.emits(A.ReportRecv)
    def report_failed_silently(r, ev, cfg, now):
        return A.ReportRecv(r.key, ok=False, failed_block_ids=r.block_ids)

    table = tuple(attrs.evolve(row, actions=tuple(report_failed_silently if a is DR.report_transfer_failed else a
                                                  for a in row.actions))
                  if isinstance(row, Transition) else row for row in DR.TABLE)
    with pytest.raises(MachineDefinitionError, match="READING x ReadFailed: report_failed_silently"):
        DR.check_reports_name_a_reason(table)


def test_the_reason_reaches_the_scheduler_typed():
    clock = Clock()
    fabric, p, d = engine_pair(1, 1, clock, kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=10.0,
                               handshake_timeout=2.0)
    try:
        fabric.fail_transfers(initiator="D/tp0")
        p.sched.on_new_request("r1", {"do_remote_decode": True})
        _, params = p.sched.request_finished("r1", (1, 2))
        d.sched.on_new_request("d1", params)
        d.sched.update_state_after_alloc("d1", (5, 6), 32)
        assert run(clock, (d, p), 3, until=lambda: "d1" in d.failed)
        assert d.reasons["d1"] is RecvFailure.TRANSFER_FAILED
    finally:
        p.close()
        d.close()


# ---------------------------------------------------------------- event log
# A D plane's log of one READ done, one failed and one aborted while awaited,
# recorded by main at 4503841 (before ReportRecv named a reason) with
# _record_session below.
OLD = Path(__file__).parent / "logs" / "recv_failed_before_reason.jsonl"


def _record_session() -> list[str]:
    p = ControlPlane()
    log = MemoryLog(config=p.config)
    p.recorder = log
    for rid in ("ok", "bad", "gone"):
        p.handle(E.NewRequest(request_id=rid, engine_id="e", remote_request_id=f"x-{rid}"), 1.0)
        p.handle(E.BlocksAllocated(request_id=rid, block_ids=[3, 4], num_remote_tokens=20), 1.0)
    p.handle(E.StartLoad(request_id="ok"), 1.0)
    p.handle(E.StartLoad(request_id="bad"), 1.0)
    p.handle(E.HandshakeOk(engine_id="e", samples=[(0.2, 0.01)]), 1.5)
    p.handle(E.ReadDone(request_id="ok"), 2.0)
    p.handle(E.ReadFailed(request_id="bad"), 2.0)
    p.handle(E.Abort(request_id="gone"), 2.5)
    for rid, t in (("ok", 3.0), ("bad", 4.0)):
        p.handle(E.RequestRunning(request_id=rid), t)
        p.handle(E.RequestFinished(request_id=rid), t + 1.0)
    p.fire_due(200.0)
    return log.lines()


def test_a_log_recorded_before_the_reason_replays_exactly():
    r = replay(str(OLD))
    assert r.divergence is None and r.ok and r.held == []


def test_the_reason_is_written_only_on_a_failed_report():
    new, old = _record_session(), OLD.read_text().splitlines()
    reasons = [json.loads(x) for x in new if '"reason":' in x]
    assert [(line["machine"], [a[1]["reason"] for a in line["actions"] if a[0] == "ReportRecv"]) for line in reasons] == [
        ("decode_request:bad", ["transfer failed"]), ("decode_request:gone", ["aborted"])]
    # Otherwise the lines are the old ones, the successful report's included.
    assert [x.replace(',"reason":"transfer failed"', "").replace(',"reason":"aborted"', "") for x in new] == old
    assert replay(new).ok


def test_a_tampered_reason_diverges_and_an_unknown_one_is_refused():
    new = _record_session()
    (i,) = [n for n, x in enumerate(new) if '"reason":"aborted"' in x]
    tampered = new[:i] + [new[i].replace('"reason":"aborted"', '"reason":"transfer failed"')] + new[i + 1:]
    r = replay(tampered)
    assert r.divergence is not None and r.divergence.what == "actions" and r.divergence.seq == json.loads(new[i])["seq"]
    with pytest.raises(MalformedLine, match="reason"):
        replay(new[:i] + [new[i].replace('"reason":"aborted"', '"reason":"it broke"')] + new[i + 1:])


def test_same_actions_skips_only_an_unwritten_reason():
    failed = A.ReportRecv("r", False, (1,), RecvFailure.ABORTED)
    assert same_actions([["ReportRecv", {"request_id": "r", "ok": False, "failed_block_ids": [1]}]], [failed])
    assert not same_actions([["ReportRecv", {"request_id": "r", "ok": False, "failed_block_ids": [2]}]], [failed])
    assert not same_actions([["ReportRecv", {"request_id": "r", "ok": False, "failed_block_ids": [1],
                                             "reason": "transfer failed"}]], [failed])
    done = A.ReportRecv("r", True, ())
    assert not same_actions([["ReportRecv", {"request_id": "r", "ok": True, "failed_block_ids": [],
                                             "reason": "aborted"}]], [done])
