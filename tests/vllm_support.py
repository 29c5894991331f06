"""Stand-ins for what the vLLM connector reads of vLLM's objects (no vLLM needed)."""
from __future__ import annotations

import attrs


@attrs.define
class Status:
    name: str


@attrs.define
class Req:
    """The attributes of vLLM's Request the connector reads."""

    request_id: str
    kv_transfer_params: dict | None
    num_prompt_tokens: int = 300
    num_computed_tokens: int = 300
    status: Status = attrs.Factory(lambda: Status("FINISHED_LENGTH_CAPPED"))
