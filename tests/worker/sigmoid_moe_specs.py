"""The tiny checkpoints of the sigmoid-routed MoE families, shared by their worker tests and the serving scenario.

GLM-4.5 MoE: 2 layers (``first_k_dense_replace=1``: layer 0 dense, layer 1 MoE), 8 routed experts in 4
groups of which 2 are kept, top-3 with a seeded ``e_score_correction_bias``, ``routed_scaling_factor``
2.5, one shared expert, partial RoPE (``head_dim`` 32, the default factor 0.5: 16 rotated dims),
per-head QK-norm and q/k/v biases.

MiniMax-M2: 2 MoE layers of 8 experts, top-2 by sigmoid score plus a seeded bias; full-width
QK-norm (at tp 4 the 2 key heads are replicated, each on 2 ranks); ``rotary_dim`` 16 of ``head_dim`` 32.

Ernie 4.5 MoE: 3 layers (``moe_layer_start_index=1``, ``moe_layer_interval=2``: layer 1 sparse),
8 experts, top-3 by softmax probability plus a seeded bias, one shared expert, interleaved RoPE,
the LM head tied to the embedding (Ernie's default).
"""

from __future__ import annotations

from tests.tiny_models import TinyModelSpec

GLM4_MOE = TinyModelSpec("glm4_moe", "glm4_moe", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 190,
    "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "use_qk_norm": True, "attention_bias": True, "tie_word_embeddings": False}, seed=41)

MINIMAX_M2 = TinyModelSpec("minimax_m2", "minimax_m2", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rotary_dim": 16, "vocab_size": 190,
    "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "tie_word_embeddings": False},
    seed=43)

ERNIE4_5_MOE = TinyModelSpec("ernie4_5_moe", "ernie4_5_moe", {
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 190,
    "moe_num_experts": 8, "moe_k": 3, "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
    "moe_layer_start_index": 1, "moe_layer_interval": 2, "use_bias": False}, seed=47)
