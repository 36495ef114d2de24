"""Gemma 3 text at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded ``gemma3_text`` checkpoint: six layers, five local (a 12-token window) to
one global; q/k norm with random weights; local RoPE base 10,000 and a global base of
1,000,000 with linear scaling (as Gemma 3 4B+ scales its global layers); the Gemma 2
traits it keeps (``(1 + w)`` norms, scaled embeddings, tanh-GELU, ``query_pre_attn_scalar``).
Degree 4 replicates its 2 KV heads. It runs the scenario of tests/worker/family_check.py
(prompts and generations past the window, chunked prefill on its edge, prefix-cache
hits, preemption, prompt logprobs).
"""

from __future__ import annotations

import json

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

WINDOW = 12
GEMMA3 = register(TinyModelSpec("gemma3", "gemma3_text", {
    "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 190,
    "sliding_window": WINDOW, "query_pre_attn_scalar": 24, "pad_token_id": 0,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
}, seed=31), WINDOW)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gemma3_matches_transformers(tp: int) -> None:
    check(GEMMA3, tp)


def test_gemma3_layers_and_ropes(tmp_path) -> None:
    """Guards the test and the defaults: 5 local : 1 global, two RoPEs; the same from an older config."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.gemma3 import Gemma3ForCausalLM
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(case(GEMMA3).jobs[0].model_dir)
    assert [config.layer_sliding_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    model = Gemma3ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=True)
    assert model.layer_types(config) == ("sliding_attention",) * 5 + ("full_attention",)
    assert model.ropes(config) == {"sliding_attention": (10000.0, None),
                                   "full_attention": (1000000.0, {"rope_type": "linear", "factor": 2.0})}
    # A Hub config of the first Gemma 3 releases: no layer_types, flat RoPE keys, rope_local_base_freq.
    raw = {**config.hf_config, "layer_types": None, "rope_parameters": None, "rope_theta": 1000000.0,
           "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
           "sliding_window_pattern": 6}
    older = ModelConfig.from_dict(json.loads(json.dumps({k: v for k, v in raw.items() if v is not None})))
    assert model.layer_types(older) == model.layer_types(config)
    assert model.ropes(older) == model.ropes(config)
