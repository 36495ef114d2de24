"""The two checkpoints of issue 44's benchmarks (benchmarks/hybrid_checkpoints.py) are the comparison they claim.

The benchmarks' ratios mean something only if the hybrid is Qwen3.5-shaped (3 DeltaNet layers to 1
attention layer) and the dense model matches it in size, width, depth, MLP and KV heads. Built on
the meta device: no weights, well under a second.
"""

from __future__ import annotations

import torch

from benchmarks.hybrid_checkpoints import DENSE, HYBRID


def _meta_model(spec):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(spec.model_type, **spec.config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_hybrid_is_qwen3_5_shaped_and_dense_matches_its_size():
    hybrid, dense = _meta_model(HYBRID), _meta_model(DENSE)
    assert type(hybrid).__name__ == "Qwen3_5ForCausalLM" and type(dense).__name__ == "Qwen3ForCausalLM"
    assert hybrid.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    for field in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_key_value_heads",
                  "head_dim"):
        assert getattr(hybrid.config, field) == getattr(dense.config, field), field
    hybrid_params = sum(p.numel() for p in hybrid.parameters())
    dense_params = sum(p.numel() for p in dense.parameters())
    assert abs(dense_params / hybrid_params - 1) < 0.01, (hybrid_params, dense_params)
