"""``kv_transfer_params``: what one side hands the other through the proxy.

Same spirit as vLLM's NixlConnector params (remote engine id, host, port,
block ids, request id), plus the lease facts kvplane needs: how many
consumers P planned and, for a decoder's held blocks, their expiry in the
holder's clock.
"""
from __future__ import annotations

from typing import Any

import attrs


class BadTransferParams(ValueError):
    """kv_transfer_params missing a field or with a wrong type; names the field."""


@attrs.frozen(kw_only=True)
class RemoteKV:
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: tuple = attrs.field(converter=tuple)
    remote_ranks: tuple = attrs.field(converter=tuple, default=(0,))
    expected_consumers: int = 1
    remote_expiry: float | None = None
    # True for P's lease (our heartbeats extend it), False for a decoder's hold.
    remote_renewable: bool = False

    @property
    def side_channel(self) -> str:
        return f"tcp://{self.remote_host}:{self.remote_port}"

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["remote_block_ids"] = list(self.remote_block_ids)
        d["remote_ranks"] = list(self.remote_ranks)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "RemoteKV":
        if not isinstance(d, dict):
            raise BadTransferParams(f"kv_transfer_params must be a dict, got {type(d).__name__}")
        typed = {
            "remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_request_id": str,
            "remote_block_ids": (list, tuple),
        }
        for name, typ in typed.items():
            if name not in d:
                raise BadTransferParams(f"kv_transfer_params: missing {name!r}")
            if not isinstance(d[name], typ) or isinstance(d[name], bool):
                raise BadTransferParams(f"kv_transfer_params: {name!r} has type {type(d[name]).__name__}")
        if not all(isinstance(b, int) and b >= 0 for b in d["remote_block_ids"]):
            raise BadTransferParams("kv_transfer_params: 'remote_block_ids' must be non-negative ints")
        consumers = d.get("expected_consumers", 1)
        if not isinstance(consumers, int) or consumers < 1:
            raise BadTransferParams(f"kv_transfer_params: 'expected_consumers' must be an int >= 1, got {consumers!r}")
        expiry = d.get("remote_expiry")
        if expiry is not None and (not isinstance(expiry, (int, float)) or isinstance(expiry, bool)):
            raise BadTransferParams(f"kv_transfer_params: 'remote_expiry' must be a number, got {expiry!r}")
        renewable = d.get("remote_renewable", False)
        if not isinstance(renewable, bool):
            raise BadTransferParams(f"kv_transfer_params: 'remote_renewable' must be a bool, got {renewable!r}")
        return cls(
            remote_engine_id=d["remote_engine_id"], remote_host=d["remote_host"], remote_port=d["remote_port"],
            remote_request_id=d["remote_request_id"], remote_block_ids=d["remote_block_ids"],
            remote_ranks=d.get("remote_ranks", (0,)), expected_consumers=consumers,
            remote_expiry=None if expiry is None else float(expiry), remote_renewable=renewable,
        )
