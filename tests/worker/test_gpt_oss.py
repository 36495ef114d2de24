"""gpt-oss (worker/models/gpt_oss.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

A tiny seeded float checkpoint with every gpt-oss trait made to matter: attention sinks
(random, one per query head; the tiny models' seeding draws them like any weight), an
8-token window on the first layer and full attention on the second (``layer_types``),
biases on q/k/v/o, YaRN RoPE (``truncate: false``, as gpt-oss ships it), 8 experts top-2
with a router bias and expert biases (stored stacked, gate/up interleaved), and a
``swiglu_limit`` of 1.0 so that the clamps bite. Head size 16: decodes and short chunks on
the compiled CPU kernel, long chunks on the torch path; the decode-graph test runs the
Triton kernel (its interpreter off CUDA) with the sinks.

Two scenarios: tests/worker/family_check.py's (prompts of up to 40 tokens and 32 generated,
past the window; chunked prefill on the window's edge, prefix-cache hits, preemption,
prompt logprobs) and tests/worker/moe_family_check.py's (alone and 16 at once, batch
invariance, per-expert token counts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import TinyModelSpec
from tests.worker import moe_family_check
from tests.worker.family_check import case as family_case
from tests.worker.family_check import check, register
from tests.worker.tp_harness import run_jobs
from tpserve.model_config import ModelConfig
from worker.kernels.triton_moe import grouped_experts_triton
from worker.layers import moe
from worker.loader import load_model
from worker.parallel_state import ParallelContext

pytestmark = pytest.mark.xdist_group("families")

WINDOW = 8
CONFIG = {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 190,
    "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": WINDOW,
    "swiglu_limit": 1.0, "tie_word_embeddings": False, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 24},
}
GPT_OSS = register(TinyModelSpec("gpt_oss", "gpt_oss", CONFIG, seed=31), WINDOW)
MOE_SPEC = TinyModelSpec("gpt_oss_moe", "gpt_oss", CONFIG, seed=32)


@pytest.fixture(scope="module")
def moe_case(tmp_path_factory: pytest.TempPathFactory) -> moe_family_check.FamilyCase:
    return moe_family_check.build_case(MOE_SPEC, tmp_path_factory.mktemp("gpt_oss"), moe_layers={0, 1}, top_k=2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_oss_matches_transformers(tp: int) -> None:
    check(GPT_OSS, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_oss_experts_match_transformers_alone_and_at_once(moe_case: moe_family_check.FamilyCase, tp: int) -> None:
    moe_family_check.check_family(moe_case, tp)


def test_the_checkpoint_exercises_what_it_should(moe_case: moe_family_check.FamilyCase) -> None:
    """Guards the test: windows alternate, YaRN is on, sinks and biases are large enough to matter."""
    config = ModelConfig.from_pretrained(family_case(GPT_OSS).jobs[0].model_dir)
    assert [config.layer_sliding_window(i) for i in range(2)] == [WINDOW, None]
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["truncate"] is False
    model = load_model(moe_case.model_dir, ModelConfig.from_pretrained(moe_case.model_dir), ParallelContext.single(),
                       torch.float32)
    layer = model.model.layers[0]
    assert layer.self_attn.attn.sinks.abs().max() > 0.3  # a sink of ~0 would hide a missing one
    assert layer.mlp.gate.bias.abs().max() > 0.1 and layer.mlp.experts.down_proj_bias.abs().max() > 0.1


def test_the_stacked_experts_load_as_transformers_computes_them(moe_case: moe_family_check.FamilyCase) -> None:
    """One expert of our rank-sharded layout against the checkpoint's interleaved, transposed tensors."""
    from safetensors.torch import load_file

    tensors = load_file(f"{moe_case.model_dir}/model.safetensors")
    config = ModelConfig.from_pretrained(moe_case.model_dir)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    prefix = "model.layers.1.mlp.experts."
    gate_up = x @ tensors[prefix + "gate_up_proj"][3] + tensors[prefix + "gate_up_proj_bias"][3]  # (5, 2I)
    gate, up = gate_up[:, ::2].clamp(max=1.0), gate_up[:, 1::2].clamp(-1.0, 1.0)
    expected = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ tensors[prefix + "down_proj"][3]
    expected = expected + tensors[prefix + "down_proj_bias"][3]
    total = torch.zeros_like(expected)
    for rank in range(2):  # the two ranks' partials sum to the expert (the down bias counted once)
        ctx = ParallelContext(tp_rank=rank, tp_size=2, device=torch.device("cpu"))
        experts = load_model(moe_case.model_dir, config, ctx, torch.float32).model.layers[1].mlp.experts
        ids, weights = torch.full((5, 1), 3), torch.ones(5, 1)
        total += experts(x, ids, weights)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_decode_graphs_run_the_triton_kernel_with_the_sinks(moe_case: moe_family_check.FamilyCase) -> None:
    """3 sequences decode 4 steps through graphs of 4 rows: the static path and the Triton paged kernel."""
    job = moe_family_check.at_once_job(moe_case, num_prompts=3, num_steps=5, graph_size=4)
    moe_family_check.check_job(moe_case, job, run_jobs([job], tp_size=1)[job.name])


def test_the_triton_experts_serve_the_model(moe_case: moe_family_check.FamilyCase,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's grouped kernel (Triton's interpreter here) with the biases and the clamped SwiGLU."""
    monkeypatch.setattr(moe, "grouped_experts", grouped_experts_triton)
    job = moe_family_check.at_once_job(moe_case, num_prompts=3, num_steps=4)
    moe_family_check.check_job(moe_case, job, run_jobs([job], tp_size=1)[job.name])


def test_int8_is_refused_for_the_experts(moe_case: moe_family_check.FamilyCase) -> None:
    with pytest.raises(ValueError, match="--quantization int8 is not supported for mixture-of-experts models"):
        load_model(moe_case.model_dir, ModelConfig.from_pretrained(moe_case.model_dir), ParallelContext.single(),
                   torch.float32, quantization="int8")


def test_a_missing_sink_is_named_as_the_checkpoint_names_it(moe_case: moe_family_check.FamilyCase,
                                                            tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{moe_case.model_dir}/model.safetensors")
    del tensors["model.layers.1.self_attn.sinks"], tensors["model.layers.0.mlp.router.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((Path(moe_case.model_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing weights: \['model.layers.0.mlp.router.bias', "
                                         r"'model.layers.1.self_attn.sinks'\]"):
        load_model(tmp_path, ModelConfig.from_pretrained(tmp_path), ParallelContext.single(), torch.float32)
