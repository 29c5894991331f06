"""Stand-ins for what the vLLM connector reads of vLLM's objects (no vLLM needed)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import attrs

from kvplane.connector.secret import write_secret_file


def deployment_secret(folder) -> str:
    """A deployment secret file in ``folder``, made once: every engine of a
    test that reads it is one deployment (kvplane_secret_file)."""
    path = Path(folder) / "kvplane.secret"
    if not path.exists():
        write_secret_file(path)
    return str(path)


def run_until(cond: Callable[[], bool], *engines: Any, timeout: float = 30.0) -> None:
    """Step ``engines`` (anything with ``step()``) until ``cond()``; fail the test past ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        for e in engines:
            e.step()
        time.sleep(0.002)


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
    # The prompt's token ids (what P's params vouch for and D checks).
    prompt_token_ids: list | None = attrs.Factory(lambda self: list(range(7, 7 + self.num_prompt_tokens)),
                                                  takes_self=True)

    @property
    def all_token_ids(self) -> list | None:
        return self.prompt_token_ids
