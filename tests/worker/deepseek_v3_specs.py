"""The tiny DeepSeek V3 checkpoints (multi-head latent attention), shared by the worker tests and the serving tests.

2 layers, 4 heads, latent rank 32, decoupled RoPE of 8 dimensions, ``qk_nope_head_dim`` 16,
``v_head_dim`` 12 (``num_key_value_heads`` is not read by latent attention; set to the heads):

* ``dsv3_q_lora``: a low-rank query (``q_lora_rank`` 24: ``q_a_proj``, ``q_a_layernorm``,
  ``q_b_proj``), interleaved RoPE (``rope_interleave``, DeepseekV3Config's default); every layer dense;
* ``dsv3_q_proj``: a full-rank ``q_proj``, ``rope_interleave`` off, ``attention_bias``; dense;
* ``dsv3_yarn``: YaRN (factor 4 over 24 positions) with ``mscale`` 0.7 and ``mscale_all_dim``
  1.0: ``cos, sin`` scaled by their ratio and the softmax scale by ``mscale_all_dim``'s square; dense;
* ``dsv3_moe``: layer 0 dense, layer 1 a DeepSeek MoE block: 8 routed experts in 4 groups of which
  2 are kept, top-3 with the seeded correction bias, ``routed_scaling_factor`` 2.5, one shared expert;
* ``glm4_moe_lite`` (GLM-4.7-Flash, ``Glm4MoeLiteForCausalLM``: the same attention): 3 layers of
  ``mlp_layer_types`` sparse, dense, sparse; 8 experts in 2 groups of which 1 is kept, top-2.
"""

from __future__ import annotations

from tests.tiny_models import TinyModelSpec

MLA = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
       "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "first_k_dense_replace": 2}
Q_LORA = TinyModelSpec("dsv3_q_lora", "deepseek_v3", {**MLA, "q_lora_rank": 24, "vocab_size": 190}, seed=41)
Q_PROJ = TinyModelSpec("dsv3_q_proj", "deepseek_v3", {
    **MLA, "q_lora_rank": None, "rope_interleave": False, "attention_bias": True, "vocab_size": 170,
    "rope_theta": 1000.0}, seed=42)
YARN = TinyModelSpec("dsv3_yarn", "deepseek_v3", {
    **MLA, "q_lora_rank": 24, "vocab_size": 180,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 24, "mscale": 0.7, "mscale_all_dim": 1.0}}, seed=43)
MOE_CONFIG = {**MLA, "q_lora_rank": 24, "vocab_size": 160, "first_k_dense_replace": 1, "n_routed_experts": 8,
              "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
              "moe_intermediate_size": 32, "routed_scaling_factor": 2.5, "norm_topk_prob": True}
MOE = TinyModelSpec("dsv3_moe", "deepseek_v3", MOE_CONFIG, seed=45)
GLM4_MOE_LITE = TinyModelSpec("glm4_moe_lite", "glm4_moe_lite", {
    **MLA, "num_hidden_layers": 3, "q_lora_rank": 24, "vocab_size": 150, "mlp_layer_types": ["sparse", "dense", "sparse"],
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "moe_intermediate_size": 32}, seed=47)
