"""The tiny seeded checkpoints of the mixture-of-experts families (tests/tiny_models.py), shared by
their own tests (tests/worker/test_mixtral.py, test_qwen3_moe.py, test_qwen2_moe.py), the
expert-parallel tests (tests/worker/test_expert_parallel.py) and the end-to-end ones.

Mixtral: 8 experts, top-2, every layer sparse; 4 attention heads over 2 KV heads. Qwen3-MoE:
layer 1 dense (``mlp_only_layers``), 8 experts, top-2 renormalised, QK-norm with ``head_dim`` 32.
Qwen2-MoE: 8 experts, top-4 not renormalised, a shared expert, layer 0 dense (``decoder_sparse_step`` 2).
"""

from __future__ import annotations

from tests.tiny_models import TinyModelSpec

MIXTRAL_SPEC = TinyModelSpec("mixtral", "mixtral", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 150, "intermediate_size": 64,
    "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False}, seed=21)

QWEN3_MOE_SPEC = TinyModelSpec("qwen3_moe", "qwen3_moe", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 180,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "mlp_only_layers": [1], "tie_word_embeddings": False}, seed=22)

#: Qwen3-MoE sized for 4- and 8-bit experts at tp 2 (tests/worker/test_moe_int4.py, test_moe_w8.py): every rank's
#: input size a multiple of 32 and of its group (head_dim 16: o_proj's input 64; experts 64 wide; the dense
#: layer 1's MLP 256 wide, group 128).
QWEN3_MOE_INT4 = TinyModelSpec("qwen3_moe_int4", "qwen3_moe", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 180,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "mlp_only_layers": [1], "tie_word_embeddings": False}, seed=24)

QWEN2_MOE_SPEC = TinyModelSpec("qwen2_moe", "qwen2_moe", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 170, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 4, "norm_topk_prob": False,
    "decoder_sparse_step": 2, "tie_word_embeddings": False}, seed=23)
