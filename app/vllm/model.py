"""A tiny Llama model folder for the vLLM job: nothing can be downloaded here.

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


def write_tiny_model(folder: str | Path) -> Path:
    """Write (or overwrite) the model folder; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    _json(folder / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
                                             "bos_token": "t1", "eos_token": "t2", "model_max_length": 4096})
    _json(folder / "config.json", CONFIG)
    _json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    return folder


def _json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")
