"""A tiny Llama model folder for the vLLM job: nothing can be downloaded here.

``--model tiny`` (the default): 2 full-attention layers, one KV cache group.
``--model hybrid``: 4 layers alternating sliding-window attention (window
``SLIDING_WINDOW`` tokens) and full attention: vLLM's hybrid KV cache
manager gives it two KV cache groups (``SlidingWindowSpec``,
``FullAttentionSpec``) drawing from one block pool, their layers' KV
tensors aliased pairwise.

vLLM runs it with ``--load-format dummy``: the weights are drawn from the
engine's seed, so P and D (same seed) compute the same model.  The
tokenizer is a word-level one over the tokens ``t0 .. t1023``; the job
sends prompts as token ids, so it only has to load.
"""
from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1024
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "hidden_act": "silu",
}

MODELS = ("tiny", "hybrid")
SLIDING_WINDOW = 64  # tokens: less than a block, so a sliding group sends 2 blocks (vLLM's clip)
HYBRID_CONFIG = dict(CONFIG, num_hidden_layers=4, sliding_window=SLIDING_WINDOW,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])


def model_config(model: str) -> dict:
    """The config.json of ``--model`` ``model`` (one of MODELS)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    return HYBRID_CONFIG if model == "hybrid" else CONFIG


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
