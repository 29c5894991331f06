"""``kv_transfer_params`` in vLLM's shape, both ways.

A vLLM proxy passes P's response params to D unchanged, so kvplane's
params carry every key NixlConnector's do (``do_remote_prefill``,
``do_remote_decode``, ``remote_block_ids`` as one list per KV cache group,
``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``tp_size``, ``pp_size``, ``remote_num_tokens``,
``remote_blocks_expiry_time``, ...) with their meaning, plus kvplane's
extra keys (``remote_expiry``, ``remote_renewable``, ``expected_consumers``,
``remote_rank_ports``) that a proxy carries along without looking.
"""
from __future__ import annotations

from typing import Any

from .params import BadTransferParams

TRANSFER_MODE = "pull"
# NixlConnector's ``transfer_mode`` values: pull (D READs), push (P WRITEs).
TRANSFER_MODES = ("pull", "push")


def to_vllm(params: dict[str, Any], *, num_tokens: int, transfer_mode: str = TRANSFER_MODE,
            groups: tuple[tuple[int, ...], ...] | None = None) -> dict[str, Any]:
    """ConnectorScheduler's params (flat block ids) -> what vLLM returns in
    the request output.  ``groups``: a hybrid model's block lists, one per
    KV cache group (clipped: ``kv_groups``), which the flat list interleaves."""
    out = dict(params)
    # A decoder's hold (not renewable) in NixlConnector's keys: the next turn
    # goes to P with do_remote_decode (P reads this prefix, then serves).
    hold = params.get("remote_renewable") is False
    out["do_remote_prefill"] = not hold
    out["do_remote_decode"] = hold
    out["remote_block_ids"] = [list(g) for g in groups] if groups is not None else [list(params["remote_block_ids"])]
    out["dcp_size"] = 1
    out["pp_size"] = params.get("pp_size", 1)  # P's stages (NixlConnector's key: D reads each stage's layers)
    out["remote_num_tokens"] = num_tokens
    # NixlConnector states an expiry only for a decoder's hold (a lease is
    # renewed by heartbeats); so does kvplane, in the holder's clock.
    out["remote_blocks_expiry_time"] = None if params.get("remote_renewable") else params.get("remote_expiry")
    out["transfer_mode"] = transfer_mode
    return out


def from_vllm(params: dict[str, Any], *, transfer_mode: str = TRANSFER_MODE, groups: int = 1) -> dict[str, Any]:
    """Params a proxy handed D -> what ConnectorScheduler validates.  With
    one KV cache group (``groups``, this engine's) ``remote_block_ids`` is
    that group's flat list; with several it stays one list per group (the
    caller checks and flattens them: ``kv_groups``).  Shape errors raise
    BadTransferParams naming the key; values are checked by RemoteKV.
    ``transfer_mode``: this engine's (its connector class's); params of the
    other mode are refused (recomputed), as the engines would not pair."""
    if not isinstance(params, dict):
        raise BadTransferParams(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    out = dict(params)
    blocks: Any = params.get("remote_block_ids")
    nested = isinstance(blocks, (list, tuple)) and bool(blocks) and all(isinstance(g, (list, tuple)) for g in blocks)
    if groups > 1:
        if not nested or len(blocks) != groups:
            raise BadTransferParams(
                f"kv_transfer_params: 'remote_block_ids': {len(blocks) if nested else 'not'} per-group lists; "
                f"this engine's model has {groups} KV cache groups")
        out["remote_block_ids"] = [list(g) for g in blocks]
    elif nested:
        non_empty = [g for g in blocks if len(g)]
        if len(non_empty) > 1:
            raise BadTransferParams(
                f"kv_transfer_params: 'remote_block_ids': {len(non_empty)} KV cache groups with blocks; "
                "this engine's model has one")
        out["remote_block_ids"] = list(non_empty[0]) if non_empty else []
    size = params.get("dcp_size", 1)
    if size not in (1, None):
        raise BadTransferParams(f"kv_transfer_params: 'dcp_size': {size!r}; kvplane supports 1")
    mode = params.get("transfer_mode", TRANSFER_MODE)
    if mode is None:
        mode = TRANSFER_MODE
    if mode != transfer_mode:
        raise BadTransferParams(f"kv_transfer_params: 'transfer_mode': {mode!r}; this engine's kvplane connector "
                                f"is {transfer_mode} mode")
    if "remote_expiry" not in params and params.get("remote_blocks_expiry_time") is not None:
        out["remote_expiry"] = params["remote_blocks_expiry_time"]
    return out
