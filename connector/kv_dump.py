"""Save the KV of a finished request's tokens: the input of the vLLM job's
KV check (``app/vllm/kv_check.py``).

vLLM's CPU KV cache is one tensor per layer shaped
``[num_blocks, 2 (K, V), block_size, kv_heads * head_dim]``; the file holds
``[layers, 2, num_tokens, kv_heads * head_dim]`` of the request's first
``num_tokens`` tokens (``torch.save``), with where the tokens read from the
remote begin.  A hybrid model's dump (``DumpKV.groups``) holds one such
tensor per KV cache group, of the group's blocks in every registered region
(the groups overlay one allocation), with the block ids (0: vLLM's null
block, a cleaned-up sliding-window block).  An MLA model's cache reaches the
connector as ``[num_blocks, 1, block_size, latent]`` (vLLM's
``allocate_kv_cache`` views every layer as ``[blocks, heads, tokens, width]``;
MLA's one "head" is the per-token latent, 576 wide for DeepSeek's, K and V
not split), so its dump is ``[layers, 1, num_tokens, latent]``.
"""
from __future__ import annotations

import os
import re
from typing import Any, Sequence

import attrs

DUMP_KEY = "kvplane_dump_kv"  # kv_transfer_params key: save this request's KV under the given tag
# A tag comes from a client: a plain name, never a path (no separator, no
# leading dot), so a dump lands in kv_dump_dir and nowhere else.
TAG_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# What dump_path accepts: a tag plus the suffix the recv dump adds.
_FILE_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,159}")


def tag_problem(tag: Any) -> str | None:
    """Why ``tag`` (a client's kvplane_dump_kv) is no dump tag, or None."""
    if not isinstance(tag, str):
        return f"a dump tag must be a string, got {type(tag).__name__}"
    if TAG_PATTERN.fullmatch(tag) is None:
        return f"a dump tag must match {TAG_PATTERN.pattern} (a plain name, not a path)"
    return None


@attrs.frozen
class DumpKV:
    """Save the KV of a finished request's first ``num_tokens`` tokens under
    ``tag``.  ``holds_blocks``: the request's blocks are held for the dump
    (report it finished sending once saved); False when something else
    holds them (P's lease).  ``first_read_token``: where the tokens D read
    from P begin (before it: D's own prefix cache); ``read_ok``: whether the
    read succeeded (None: not a remote request, or not known)."""

    request_id: str
    tag: str
    block_ids: tuple[int, ...] = attrs.field(converter=lambda ids: tuple(int(b) for b in ids))
    num_tokens: int
    holds_blocks: bool = True
    first_read_token: int = 0
    read_ok: bool | None = None
    # "finish": when the request finished (the blocks of its first num_tokens
    # tokens); "recv": when D's recv completed, before D wrote anything into the
    # blocks (every block given: the ones the read filled).
    when: str = "finish"
    # A hybrid model: the block list of each KV cache group (block_ids unused).
    groups: tuple[tuple[int, ...], ...] = attrs.field(
        default=(), converter=lambda gs: tuple(tuple(int(b) for b in g) for g in gs))


def dump_path(directory: str, tag: str, rank: int) -> str:
    """The dump file of ``tag`` in ``directory``; ValueError for a tag that
    is not a plain name (checked again here: a path never escapes)."""
    if not isinstance(tag, str) or _FILE_TAG.fullmatch(tag) is None:
        raise ValueError(f"dump tag {tag!r:.80} is not a plain name")
    return os.path.join(directory, f"{tag}.rank{rank}.pt")


def dump_kv(layers: Sequence[Any], dump: DumpKV, path: str, engine_id: str | None = None) -> None:
    """Write ``{"kv": [layers, heads, whole blocks' rows, width], "num_tokens",
    "first_read_token", "read_ok", "block_tokens", "when", "engine_id"}`` to
    ``path`` (``engine_id``: the engine core that saved it; with DP, which
    one served the request)
    (atomically: a reader never sees half a file).  ValueError when the
    blocks cannot hold the tokens."""
    import torch

    if not layers:
        raise ValueError("no KV cache registered")
    first = layers[0]
    if first.dim() != 4:
        raise ValueError(f"KV cache layer shaped {tuple(first.shape)}, not [blocks, heads, block_size, width]")
    num_tokens = dump.num_tokens
    block_tokens = first.shape[2]

    def blocks_kv(block_ids: tuple[int, ...]) -> tuple[Any, list[int]]:
        need = len(block_ids) if dump.when == "recv" else -(-num_tokens // block_tokens)
        if need <= 0 or need > len(block_ids):
            raise ValueError(f"{num_tokens} tokens need {need} blocks, got {len(block_ids)}")
        ids = list(block_ids[:need])
        # Whole blocks: the block interior is the attention backend's, not token-major.
        return torch.stack([t[ids].transpose(0, 1).reshape(first.shape[1], need * block_tokens, -1)
                            for t in layers]).clone(), ids

    out, _ = blocks_kv(dump.groups[0] if dump.groups else dump.block_ids)
    saved = {"kv": out, "num_tokens": num_tokens, "first_read_token": dump.first_read_token,
             "read_ok": dump.read_ok, "block_tokens": block_tokens, "when": dump.when,
             "engine_id": engine_id}
    if dump.groups:
        saved["groups"] = [dict(zip(("kv", "block_ids"), blocks_kv(g))) for g in dump.groups]
    tmp = path + ".tmp"
    torch.save(saved, tmp)
    os.replace(tmp, path)
