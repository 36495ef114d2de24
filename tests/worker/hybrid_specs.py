"""Tiny seeded hybrid checkpoints (state layers beside attention), shared by the worker and end-to-end tests.

* :data:`LFM2`: four layers, conv / attention alternating (``layer_types``), biased convolutions
  (``conv_bias``: in_proj, the taps and out_proj), kernel 3, GQA 4:2 with QK-norm, tied LM head;
* :data:`LFM2_IDXS`: the older config form (``full_attn_idxs``), three layers of which one attends,
  kernel 4, no bias, untied LM head.
"""

from __future__ import annotations

from tests.tiny_models import TinyModelSpec

LFM2 = TinyModelSpec("lfm2", "lfm2", {
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 190,
    "intermediate_size": 192, "block_multiple_of": 32, "conv_L_cache": 3, "conv_bias": True, "norm_eps": 1e-5,
    "layer_types": ["conv", "full_attention", "conv", "full_attention"],
}, seed=71)
LFM2_IDXS = TinyModelSpec("lfm2_idxs", "lfm2", {
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 190,
    "intermediate_size": 96, "block_multiple_of": 16, "conv_L_cache": 4, "full_attn_idxs": [2],
    "tie_word_embeddings": False,
}, seed=72)
