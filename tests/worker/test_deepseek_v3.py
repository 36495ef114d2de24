"""DeepSeek V3 (multi-head latent attention) at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

Tiny seeded ``deepseek_v3`` checkpoints of 2 layers, 4 heads, latent rank 32, decoupled RoPE of
8 dimensions; the first three dense (``first_k_dense_replace`` = layers):

* ``dsv3_q_lora``: a low-rank query (``q_lora_rank`` 24: ``q_a_proj``, ``q_a_layernorm``,
  ``q_b_proj``), interleaved RoPE (``rope_interleave``, DeepseekV3Config's default);
* ``dsv3_q_proj``: a full-rank ``q_proj``, ``rope_interleave`` off, ``attention_bias``;
* ``dsv3_yarn``: YaRN (factor 4 over 24 positions) with ``mscale`` 0.7 and ``mscale_all_dim``
  1.0: ``cos, sin`` scaled by their ratio and the softmax scale by ``mscale_all_dim``'s square;
* ``dsv3_moe``: layer 1 a DeepSeek MoE block (sigmoid routing with a correction bias, expert
  groups, a shared expert; worker/layers/moe_routing.py) after a dense layer 0.

Each runs the scenario of tests/worker/family_check.py: greedy tokens and logits within 1e-4,
alone and 16 at once, prompt logprobs, chunked prefill split inside a block (chunks of 6
tokens, blocks of 4), prefix-cache hits (whole cached latent blocks, the rest prefilled) and
preemption with recompute. Prefill runs the expanded form, decode the absorbed one
(worker/layers/mla_attention.py), so the same tokens from both is part of the check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import check, register
from tests.worker.moe_family_check import build_case, check_family

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

_MLA = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "first_k_dense_replace": 2}
#: Chunks of 6 tokens over blocks of 4: every other chunk boundary falls inside a block.
CHUNK = 6
Q_LORA = register(TinyModelSpec("dsv3_q_lora", "deepseek_v3", {**_MLA, "q_lora_rank": 24, "vocab_size": 190},
                                seed=41), CHUNK)
Q_PROJ = register(TinyModelSpec("dsv3_q_proj", "deepseek_v3", {
    **_MLA, "q_lora_rank": None, "rope_interleave": False, "attention_bias": True, "vocab_size": 170,
    "rope_theta": 1000.0}, seed=42), CHUNK)
YARN = register(TinyModelSpec("dsv3_yarn", "deepseek_v3", {
    **_MLA, "q_lora_rank": 24, "vocab_size": 180,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 24, "mscale": 0.7, "mscale_all_dim": 1.0}}, seed=43),
    CHUNK)
#: Layer 0 dense, layer 1 DeepSeek MoE: 8 routed experts in 4 groups of which 2 are kept, top-3 with the
#: seeded correction bias (drawn like every parameter), routed_scaling_factor 2.5, one shared expert.
MOE_CONFIG = {**_MLA, "q_lora_rank": 24, "vocab_size": 160, "first_k_dense_replace": 1, "n_routed_experts": 8,
              "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
              "moe_intermediate_size": 32, "routed_scaling_factor": 2.5, "norm_topk_prob": True}
MOE = register(TinyModelSpec("dsv3_moe", "deepseek_v3", MOE_CONFIG, seed=45), CHUNK)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", [Q_LORA, Q_PROJ, YARN, MOE])
def test_deepseek_v3_matches_transformers(name: str, tp: int) -> None:
    check(name, tp)


def test_deepseek_v3_moe_routes_alike_alone_and_in_a_batch(tmp_path: Path) -> None:
    """tests/worker/moe_family_check.py on ``dsv3_moe`` (tp 1): tokens and logits as ``transformers``', a prompt's
    logits alone and among 16 within 1e-5, and layer 1's expert counts = its tokens x 3 (none from layer 0)."""
    case = build_case(TinyModelSpec("dsv3_moe_counts", "deepseek_v3", MOE_CONFIG, seed=46), tmp_path, moe_layers={1},
                      top_k=3)
    check_family(case, 1)
