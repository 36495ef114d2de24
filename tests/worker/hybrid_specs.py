"""Tiny seeded hybrid checkpoints (state layers beside attention), shared by the worker and end-to-end tests.

* :data:`LFM2`: four layers, conv / attention alternating (``layer_types``), biased convolutions
  (``conv_bias``: in_proj, the taps and out_proj), kernel 3, GQA 4:2 with QK-norm, tied LM head;
* :data:`LFM2_IDXS`: the older config form (``full_attn_idxs``), three layers of which one attends,
  kernel 4, no bias, untied LM head;
* :data:`QWEN3_NEXT_SPEC`, :data:`QWEN3_5_SPEC`, :data:`QWEN3_5_MOE_SPEC` (Gated DeltaNet + gated attention):
  four layers, ``layer_types`` linear, linear, linear, full (``full_attention_interval`` 4, as the released
  models). DeltaNet: 2 key heads of 16 serving 4 value heads of 8 (two per key head, so the grouped layout and
  the head repeat both matter; one key head per rank at tp 2), kernel 4. Attention: 4 query heads over 2 KV
  heads of 16, RoPE on a quarter of each head (the families' default). Qwen3-Next: 8 experts, top-2
  renormalised, a shared expert, layer 2 dense (``mlp_only_layers``); Qwen3.5-MoE: every layer sparse. The
  zero-centred norms' weights are drawn around 0 (each scales by about 1). 160 positions, so that prompts
  span more than one 64-row DeltaNet chunk.
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

_HYBRID = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 190, "max_position_embeddings": 160, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
           "linear_conv_kernel_dim": 4, "tie_word_embeddings": False}
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}

QWEN3_NEXT_SPEC = TinyModelSpec("qwen3_next", "qwen3_next", {**_HYBRID, **_MOE, "norm_topk_prob": True,
                                                             "mlp_only_layers": [2]}, seed=44,
                               zero_centred_norms=True)
QWEN3_5_SPEC = TinyModelSpec("qwen3_5", "qwen3_5_text", _HYBRID, seed=45, zero_centred_norms=True)
QWEN3_5_MOE_SPEC = TinyModelSpec("qwen3_5_moe", "qwen3_5_moe_text", {**_HYBRID, **_MOE}, seed=46,
                                 zero_centred_norms=True)
GATED_DELTA_NET_SPECS = (QWEN3_NEXT_SPEC, QWEN3_5_SPEC, QWEN3_5_MOE_SPEC)
