"""P-side truncation: the trailing prompt tokens P leaves to D.

A drafter that reads ahead of the target model (multi-module MTP: each
module reads one token further than the one before) would, on P, write KV
of tokens the target has not verified into its own layers' cache; D never
rebuilds those entries (its first decode rejects nothing, so nothing is
recomputed). NixlConnector 0.32.0 therefore has P stop short of the last
``backoff`` prompt tokens and D load only the tokens before them and compute
the rest itself: backoff = ``num_prefill_lookahead_tokens - 1`` (vLLM's
config: ``num_speculative_tokens`` for multi-module MTP, so 0 without
speculative decoding and for Eagle's one-token lookahead).  Mamba's and
bounded-replay sliding windows' one-token backoff does not arise here:
kvplane refuses Mamba state groups (``kv_groups``).

Both sides derive the backoff from their own config; D accepts params only
for exactly the tokens its backoff leaves (``tokens_to_read``), so P and D
that disagree never read past what P computed: D computes the prompt.
"""
from __future__ import annotations

from typing import Any


def prefill_backoff(vllm_config: Any) -> int:
    """Trailing prompt tokens P does not compute (``vllm_config``: vLLM's
    ``VllmConfig``; its ``num_prefill_lookahead_tokens`` is the one place
    vLLM states a drafter's lookahead)."""
    lookahead = getattr(vllm_config, "num_prefill_lookahead_tokens", 0)
    if isinstance(lookahead, bool) or not isinstance(lookahead, int):
        return 0
    return max(0, lookahead - 1)


def tokens_to_read(num_prompt_tokens: int, backoff: int) -> int:
    """The prompt tokens D reads from P: all but the last ``backoff`` (the
    whole prompt when it is not longer than that: P computed it all)."""
    return num_prompt_tokens - backoff if backoff and num_prompt_tokens > backoff else num_prompt_tokens


def truncate_for_prefill(request: Any, backoff: int, block_size: int) -> bool:
    """Drop ``request``'s last ``backoff`` prompt tokens (vLLM's ``Request``,
    a prefill for a remote decode, just added) so P computes only what D
    reads; whether it did (``block_size``: tokens per KV block).  A prompt not longer than the backoff is left
    whole (D reads it all), as is one that skips the prefix cache (D reads
    nothing for it) and one given as embeddings (no token ids to sign: D,
    which refuses unsigned params, computes it)."""
    if backoff <= 0 or request.num_prompt_tokens <= backoff or getattr(request, "skip_reading_prefix_cache", False):
        return False
    prompt = getattr(request, "prompt_token_ids", None)
    if not isinstance(prompt, list):
        return False
    keep = request.num_prompt_tokens - backoff
    del prompt[keep:]
    # The request's own token list (a copy of the prompt, outputs appended): vLLM's all_token_ids views it.
    del request._all_token_ids[keep:]
    request.num_prompt_tokens = keep
    # A block's hash is of the tokens it holds: a block the cut left part-full has none until it fills again
    # (vLLM hashes on from the last hash). ``block_size``, the KV block's, is a multiple of the hash block's:
    # this keeps no more hashes than whole hash blocks remain.
    hashes = getattr(request, "block_hashes", None)
    if isinstance(hashes, list) and block_size > 0:
        del hashes[keep // block_size:]
    # P only prefills for D: its one sampled token ends the request.
    request.max_tokens = 1
    return True
