"""Why a recv failed, as a typed reason from the rank's plane to the
scheduler side (``records.RecvFailure``)."""
from __future__ import annotations

import pickle

import pytest

from loopback_support import Clock, run
from split_support import engine_pair

from kvplane.connector.records import RecvFailure, WorkerReport
from kvplane.connector.worker import recv_failure_reason


def test_a_report_carries_typed_reasons_and_refuses_unknown_ones():
    report = WorkerReport(rank=0, failed_recving={"a"}, fail_reasons=[("a", "transfer failed")])
    assert report.fail_reasons == (("a", RecvFailure.TRANSFER_FAILED),)
    copy = pickle.loads(pickle.dumps(report))
    assert copy == report and type(copy.fail_reasons[0][1]) is RecvFailure
    with pytest.raises(ValueError):
        WorkerReport(rank=0, failed_recving={"a"}, fail_reasons=[("a", "it broke")])


@pytest.mark.parametrize("event,label,before,reason", [
    ("StartLoad", "decode_request:d1", "WAITING_FOR_REMOTE_KVS", RecvFailure.DECLINED),
    ("ReadFailed", "decode_request:d1", "READING", RecvFailure.TRANSFER_FAILED),
    ("Abort", "decode_request:d1", "READING", RecvFailure.ABORTED),
    ("TimerFired", "decode_request:d1", "READING", RecvFailure.TRANSFER_DEADLINE),
    ("TimerFired", "decode_request:d1", "HANDSHAKING", RecvFailure.HANDSHAKE_TIMEOUT),
    ("TimerFired", "decode_request:d1", "AWAITING_PUSH", RecvFailure.PUSH_TIMEOUT),
    ("TimerFired", "decode_request:d1", "WAITING_FOR_REMOTE_KVS", RecvFailure.RECV_TIMEOUT),
    ("HandshakeOk", "remote_engine:P", "HANDSHAKING", RecvFailure.DECLINED),
    ("HandshakeFailed", "remote_engine:P", "HANDSHAKING", RecvFailure.HANDSHAKE_FAILED),
    ("PeerDisconnected", "remote_engine:P", "CONNECTED", RecvFailure.ENGINE_LOST),
    ("LeaseAbort", "lease:x", "LEASED", RecvFailure.UNEXPLAINED),
])
def test_each_stimulus_names_its_reason(event, label, before, reason):
    assert recv_failure_reason(event, label, before) is reason


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
        assert d.sched.fail_reasons["d1"] is RecvFailure.TRANSFER_FAILED
        assert not [k for k in d.workers[0].counters if k.startswith("unexplained")]
    finally:
        p.close()
        d.close()
