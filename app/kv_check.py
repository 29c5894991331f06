"""The vLLM job's KV check: the KV that moved is the right KV.

The connector saves (``connector.kv_dump``) for each disaggregated request
P's KV of the prompt when P finished it (its blocks still under the lease),
D's KV of the prompt when D finished it, with where D's read began (before:
blocks from D's own prefix cache) and whether the read succeeded, and,
after the stream, D's KV of the same prompt computed on D from scratch
(its own ``cache_salt``, so no cached block serves it).

The check, per request: every whole block D read (from the first read
token up to the block holding the last prompt token) is byte for byte
P's block and byte for byte D's own recompute.  Whole blocks, because the
CPU backend's block interior is not token-major (a head's K and V rows,
tiled for the kernel): the block with the last prompt token is left out,
as D writes into it itself (vLLM recomputes the last token of a loaded
prompt, then decodes into the same block).

It cannot pass with wrong or stale KV: a block read after P freed it holds
what P wrote there next (or the same bytes, if nothing yet: then the read
was harmless), a block read from the wrong place another prompt's KV; both
differ from P's dump taken while the lease held the block, and from D's
recompute.  A request whose read was declined (kvplane's expiry gate) read
nothing: D recomputed it; its blocks are still compared with the recompute.
Measured on a normal run: P's KV and D's recompute are byte-identical for
every prompt (the CPU kernels give the same bytes for the same prompt
whatever the batch), so the check needs no tolerance.
"""
from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class KvVerdict:
    tag: str
    ok: bool
    read_tokens: int  # tokens of the whole blocks D read from P, compared
    declined: bool  # kvplane declined the read (D recomputed)
    why: str = ""


def _load(path: Path) -> dict | None:
    import torch

    if not path.exists():
        return None
    return torch.load(path)


def verdict(tag: str, d: dict | None, p: dict | None, local: dict | None) -> KvVerdict:
    if d is None:
        return KvVerdict(tag=tag, ok=False, read_tokens=0, declined=False, why="no dump of D's KV")
    dk = d["kv"]
    declined = d.get("read_ok") is False
    block = int(d.get("block_tokens", 128))
    n = dk.shape[2]
    first_block = int(d.get("first_read_token", 0)) // block
    end = ((n - 1) // block) * block  # up to the block with the last prompt token
    start = first_block * block
    span = slice(start, max(start, end))
    tokens = max(0, end - start)
    problems = []
    for name, other in (("P's KV", None if declined else p), ("D's recompute", local)):
        if other is None:
            if name == "P's KV" and not declined:
                problems.append("no dump of P's KV")
            elif name == "D's recompute":
                problems.append("no dump of D's recompute")
            continue
        ok_ = other["kv"]
        if ok_.shape != dk.shape:
            problems.append(f"shape differs from {name}: {tuple(dk.shape)} vs {tuple(ok_.shape)}")
            continue
        if tokens and not bool((dk[:, :, span] == ok_[:, :, span]).all()):
            bad = sum(1 for b in range(start, end, block)
                      if not bool((dk[:, :, b:b + block] == ok_[:, :, b:b + block]).all()))
            problems.append(f"{bad} of {tokens // block} blocks read differ from {name}")
    return KvVerdict(tag=tag, ok=not problems, read_tokens=0 if declined else tokens, declined=declined,
                     why="; ".join(problems))


def check_all(dump_dir: Path, tags: list[str], rank: int = 0) -> list[KvVerdict]:
    return [verdict(t, _load(dump_dir / f"{t}.rank{rank}.pt"), _load(dump_dir / f"{t}.p.rank{rank}.pt"),
                    _load(dump_dir / f"{t}.local.rank{rank}.pt")) for t in tags]
