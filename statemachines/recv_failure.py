"""Why a recv was reported failed: the reason ``ReportRecv(ok=False)`` carries.

Each row of ``decode_request`` that reports a recv failed names its
reason (``decode_request.report_failed``); the worker ranks pass it on in
their reports (``connector.records.WorkerReport.fail_reasons``) and the
scheduler half keeps the first per request.  The values are the words
reports, summaries and event logs print (a member compares equal to its
value).
"""
from __future__ import annotations

from enum import StrEnum


class RecvFailure(StrEnum):
    DECLINED = "declined by the expiry gate"
    OTHER_INCARNATION = "the holder restarted (another incarnation)"
    TRANSFER_FAILED = "transfer failed"
    ABORTED = "aborted"
    TRANSFER_DEADLINE = "transfer deadline (timeout or the remote blocks' validity)"
    HANDSHAKE_TIMEOUT = "handshake did not complete in time"
    PUSH_TIMEOUT = "push did not arrive in time"
    RECV_TIMEOUT = "recv timed out"
    HANDSHAKE_FAILED = "handshake failed"
    ENGINE_LOST = "engine lost"
    # Not a machine's: the worker's last line (a new request's set-up raised) ...
    INTERNAL_ERROR = "internal error on its params"
    # ... and what a report without a reason (an older rank's) is taken as.
    UNEXPLAINED = "failed"
