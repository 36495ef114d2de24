"""The two random-weight float32 checkpoints issue 44's benchmarks serve: a Qwen3.5-shaped hybrid and a dense twin.

Both are built offline with ``transformers`` (tests/tiny_models.py's seeded weights), with the
stories260k tokenizer (vocabulary 512) beside them because ``tpserve serve`` loads one; the
benchmarks send token ids, so the vocabulary only sizes the embedding and LM head.

* **hybrid** (``Qwen3_5ForCausalLM``): 8 layers, ``layer_types`` linear x3, full (the released
  models' 3 : 1). Gated DeltaNet: 4 key heads of 64 serving 8 value heads of 64, kernel 4 (the
  released models' 2 value heads per key head and 128-wide heads, halved). Gated attention:
  8 query heads over 2 KV heads of 64.
* **dense** (``Qwen3ForCausalLM``): the same hidden size (512), layers (8), MLP width (1536),
  vocabulary and KV heads (2 of 64) in every layer; 14 query heads instead of 8, which brings its
  parameter count to the hybrid's (27.80M against 27.61M, +0.7 %): a DeltaNet layer's projections
  are wider than an attention layer's, and matching them with query heads keeps the MLP, the
  part both share, identical.

Why this size (hidden 512, about 110 MB of float32 weights): a decode step is then dominated by
reading weights and state / KV, not by Python per layer, yet a 2,000-token prefill still takes
seconds, not minutes, on the 2-core host.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.tiny_models import TinyModelSpec, build_hf_model

_SHARED = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "vocab_size": 512,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "head_dim": 64,
           "num_key_value_heads": 2}

HYBRID = TinyModelSpec("qwen3_5_hybrid", "qwen3_5_text", {
    **_SHARED, "num_attention_heads": 8, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4}, seed=440,
    zero_centred_norms=True)
DENSE = TinyModelSpec("qwen3_dense", "qwen3", {**_SHARED, "num_attention_heads": 14}, seed=441)

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"


def shapes(spec: TinyModelSpec, model) -> dict:
    """What the JSON records of a checkpoint: its architecture, config fields and parameter count."""
    return {"architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "layer_types": getattr(model.config, "layer_types", None), **spec.config}


def save(spec: TinyModelSpec, directory: Path, tokenizer_dir: Path = TOKENIZER_DIR) -> dict:
    """Write ``spec``'s checkpoint and the tokenizer into ``directory``; return :func:`shapes`."""
    model = build_hf_model(spec)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return shapes(spec, model)
