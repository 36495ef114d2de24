"""Nemotron-H (worker/models/nemotron_h.py) against ``transformers``, without the runner.

A tiny seeded checkpoint (tests/worker/hybrid_specs.py) with every block kind, ``M*-ME``: Mamba-2
(chunk size 8, four B/C groups, split at tp 2), attention without positional encoding, a relu^2 MLP,
and a MoE block (biased sigmoid router, relu^2 experts and shared expert, ``routed_scaling_factor``
1.5). Through tests/worker/hybrid_harness.py: 32 greedy tokens per prompt of 9-24 tokens, each prompt
alone, and 16 at once with two-chunk prefills beside the others' decodes, at tp 1 and 2: ``transformers``'
greedy tokens and logprobs within 1e-4 (float32). And the runner's family scenario
(tests/worker/family_check.py) at tp 1 and 2.
"""

from __future__ import annotations

import json

import pytest

from tests.worker.family_check import check, register
from tests.worker.hybrid_harness import Schedule, generate
from tests.worker.hybrid_specs import (
    MAX_TOKENS,
    NEMOTRON_H,
    NEMOTRON_H_MLP_BIAS,
    check_against_transformers,
    prompts,
    save_hybrid_model,
)
from tpserve.model_config import ModelConfig

pytestmark = pytest.mark.xdist_group("families")

FAMILY = register(NEMOTRON_H, None)  # the runner's scenario (tests/worker/family_check.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hybrid_model(NEMOTRON_H, tmp_path_factory.mktemp("nemotron_h"))


def test_config_reads_the_block_pattern(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    assert "num_hidden_layers" not in raw  # transformers 5 derives it from layers_block_type
    config = ModelConfig.from_dict(raw)
    kinds = ("linear_attention", "full_attention", "mlp", "linear_attention", "moe")
    assert config.num_hidden_layers == 5 and config.layer_types == kinds
    assert config.state_layer_indices == (0, 3) and config.num_attention_layers == 1  # MLP, MoE: no KV
    hub = {key: value for key, value in raw.items() if key != "layers_block_type"}
    hub.update(hybrid_override_pattern="M*-ME", num_hidden_layers=5)  # the Hub's spelling
    assert ModelConfig.from_dict(hub).layer_types == kinds
    with pytest.raises(ValueError, match="hybrid_override_pattern='M\\*-MX' must be"):
        ModelConfig.from_dict({**hub, "hybrid_override_pattern": "M*-MX"})


def test_each_prompt_alone_tp1(model_dir):
    batch = prompts(8, seed=4)
    check_against_transformers(model_dir, batch, generate(model_dir, Schedule(batch, MAX_TOKENS, together=False)))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_sixteen_at_once_with_chunked_prefill(model_dir, tp_size):
    batch = prompts(16, seed=5)
    results = generate(model_dir, Schedule(batch, MAX_TOKENS, first_chunk=7), tp_size=tp_size)
    check_against_transformers(model_dir, batch, results)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_mlp_bias_with_the_shared_experts_bias_added_once(tmp_path, tp_size):
    """``mlp_bias``: the shared expert's ``down_proj`` bias is added after the MoE block's one all-reduce
    (it was dropped: tokens left transformers' at the 4th-9th step). Logprobs within 2e-4: at tp 1, 17 of
    10,070 differ by 1.0-1.65e-4, the same whichever order the bias is added in (float32 rounding through the
    biased blocks; without the fix they differ by up to 0.25 and the tokens diverge)."""
    model_dir = save_hybrid_model(NEMOTRON_H_MLP_BIAS, tmp_path)
    batch = prompts(8, seed=6)
    check_against_transformers(model_dir, batch, generate(model_dir, Schedule(batch, MAX_TOKENS, first_chunk=7),
                                                          tp_size=tp_size), atol=2e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_nemotron_h_through_the_runner(tp: int) -> None:
    """tests/worker/family_check.py's scenario through ModelRunner and the state cache: alone and 16 at once,
    chunked prefill, prefix hits restored from state checkpoints, preemption, prompt logprobs."""
    check(FAMILY, tp)
