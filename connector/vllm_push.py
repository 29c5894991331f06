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

This module keeps the scheduler half's push books; it imports no vLLM.
"""
from __future__ import annotations

from typing import Any, Iterable


class PushPending:
    """P's leases whose push is not over, for vLLM's ``has_pending_push_work``
    (an idle engine does not step: without it, the end of a WRITE would reach
    vLLM, which frees the blocks, only with the next request)."""

    def __init__(self, *, enabled: bool):
        self.enabled = enabled
        self._leases: set[str] = set()

    def serve_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """What the split scheduler reads of a request that is not a remote
        prefill: whether it serves a remote decode, and how (the engine's
        mode, never the client's)."""
        return {"do_remote_decode": bool(params.get("do_remote_decode")), "push": self.enabled}

    def receive_params(self, registered: dict[str, Any]) -> dict[str, Any]:
        """D's accepted params with the engine's mode (``from_vllm`` refused
        the other one)."""
        return dict(registered, push=self.enabled)

    def granted(self, request_id: str) -> None:
        if self.enabled:
            self._leases.add(request_id)

    def sent(self, finished_sending: Iterable[str]) -> None:
        self._leases.difference_update(finished_sending)

    def pending(self) -> bool:
        return bool(self._leases)
