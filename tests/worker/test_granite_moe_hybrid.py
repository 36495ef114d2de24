"""Granite 4 hybrid (worker/models/granite_moe_hybrid.py) against ``transformers``, without the runner.

Tiny seeded checkpoints (tests/worker/hybrid_specs.py): Mamba-2 layers (chunk size 8, one B/C group,
replicated at tp 2) beside a NoPE attention layer, MoE with a shared MLP, Granite's four multipliers
away from 1; and a dense variant with RoPE, four groups (split at tp 2), projection biases and tied
embeddings. The harness (tests/worker/hybrid_harness.py) allocates the KV blocks and the state slots,
builds each step's metadata and runs 32 greedy tokens per prompt (prompts of 9-24 tokens): each
prompt alone, and 16 at once with every prompt prefilled in two chunks (state carried) beside the
others' decodes. Every run gives ``transformers``' greedy tokens with logprobs within 1e-4 (float32).
The MoE checkpoint also runs the runner's family scenario (tests/worker/family_check.py) at tp 1 and 2.
"""

from __future__ import annotations

import pytest

from tests.worker.family_check import check, register
from tests.worker.hybrid_harness import Schedule, generate
from tests.worker.hybrid_specs import (GRANITE_HYBRID_DENSE, GRANITE_HYBRID_MOE, MAX_TOKENS, check_against_transformers,
                                       prompts, save_hybrid_model)
from tpserve.model_config import ModelConfig

pytestmark = pytest.mark.xdist_group("families")

FAMILY = register(GRANITE_HYBRID_MOE, None)  # the runner's scenario (tests/worker/family_check.py)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_hybrid_model(GRANITE_HYBRID_MOE, tmp_path_factory.mktemp("granite4_moe"))


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_hybrid_model(GRANITE_HYBRID_DENSE, tmp_path_factory.mktemp("granite4_dense"))


def test_config_reads_the_layer_types(moe_dir):
    config = ModelConfig.from_pretrained(moe_dir)
    assert config.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    hub = ModelConfig.from_dict({**config.hf_config, "layer_types": ["mamba", "attention", "mamba", "mamba"]})
    assert hub.layer_types == config.layer_types  # the Hub's names (transformers' legacy remap)


def test_each_prompt_alone_tp1(moe_dir):
    batch = prompts(8, seed=1)
    check_against_transformers(moe_dir, batch, generate(moe_dir, Schedule(batch, MAX_TOKENS, together=False)))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_sixteen_at_once_with_chunked_prefill(moe_dir, tp_size):
    batch = prompts(16, seed=2)
    results = generate(moe_dir, Schedule(batch, MAX_TOKENS, first_chunk=5), tp_size=tp_size)
    check_against_transformers(moe_dir, batch, results)


def test_expert_parallel_tp2(moe_dir):
    """``--enable-expert-parallel``: each of the two ranks holds two whole experts; the same tokens."""
    import torch

    from worker.layers.moe import FusedMoE
    from worker.loader import load_model
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(moe_dir)
    shard = load_model(moe_dir, config, ParallelContext(1, 2, torch.device("cpu"), enable_expert_parallel=True),
                       torch.float32)
    experts = [m for m in shard.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 4 and all(m.gate_up_proj.shape == (2, 64, 64) and m.first_expert == 2 for m in experts)
    batch = prompts(16, seed=6)
    results = generate(moe_dir, Schedule(batch, MAX_TOKENS, first_chunk=5), tp_size=2, expert_parallel=True)
    check_against_transformers(moe_dir, batch, results)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_dense_rope_variant(dense_dir, tp_size):
    batch = prompts(6, seed=3)
    check_against_transformers(dense_dir, batch, generate(dense_dir, Schedule(batch, MAX_TOKENS, first_chunk=11),
                                                          tp_size=tp_size))


@pytest.mark.parametrize("tp", [1, 2])
def test_granite_moe_hybrid_through_the_runner(tp: int) -> None:
    """tests/worker/family_check.py's scenario through ModelRunner and the state cache: alone and 16 at once,
    chunked prefill, prefix hits restored from state checkpoints, preemption, prompt logprobs."""
    check(FAMILY, tp)
