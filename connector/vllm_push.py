"""Push mode in kvplane's vLLM connector (vLLM 0.32.0's NixlPushConnector flow).

Selected by the connector class, as vLLM selects ``NixlPushConnector``:
``"kv_connector": "KVPlanePushConnector"`` (``kv_connector_module_path``
``kvplane.connector.vllm``), on P and D alike.  The proxy protocol is the
pull one (P first with ``do_remote_decode``, then D with P's params); what
changes is who moves the bytes:

- P's ``request_finished`` leases the blocks as in pull mode and readies a
  push for them; its params say ``transfer_mode: push`` (signed, like every
  field D acts on).
- D, given push params, allocates its blocks and registers them with P
  (``PUSH_REG`` over NIXL with the deadline at which it gives up), then
  waits; P's ``push_write`` machine WRITEs its leased blocks into D's once
  both the registration and its prefill are there, the WRITE refreshes D's
  liveness (``engine_ttl``), and its completion notification makes D report
  the recv finished; no push by D's deadline: the recv fails and vLLM
  recomputes (``kv_load_failure_policy``).
- P admits a ``PUSH_REG`` only from the engine it names, for a lease it
  holds (an unguessable name handed out in signed params), and WRITEs only
  to a side channel that proves the deployment's CURVE key (the driver).

Params of the other mode are refused on either side (computed locally):
a push P and a pull D, or the reverse, do not pair.  Push runs at TP 1 and
without ``bidirectional_kv_xfer`` (NixlPushConnector refuses that too).

Whether P still has push work (vLLM's ``has_pending_push_work``: an idle
engine does not step, and without it the end of a WRITE would reach vLLM,
which frees the blocks, only with the next request) is read from the
``engine_request`` machines (``ConnectorScheduler.pushes_pending``): no
set of its own.  This module says what the scheduler half registers of a
request in push mode; it imports no vLLM.
"""
from __future__ import annotations

from typing import Any


def serve_params(params: dict[str, Any], *, push: bool) -> dict[str, Any]:
    """What the split scheduler reads of a request that is not a remote
    prefill: whether it serves a remote decode, and how (the engine's mode
    ``push``, never the client's)."""
    return {"do_remote_decode": bool(params.get("do_remote_decode")), "push": push}


def receive_params(registered: dict[str, Any], *, push: bool) -> dict[str, Any]:
    """D's accepted params with the engine's mode (``from_vllm`` refused
    the other one)."""
    return dict(registered, push=push)
