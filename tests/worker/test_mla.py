"""Multi-head latent attention (worker/layers/mla.py, mla_attention.py): its two forms, its cache, its paths.

* the absorbed form (decode) equals the expanded form (prefill) to 1e-5 in float32;
* the KV cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token per layer, the same
  on every tensor-parallel rank: the pool's bytes per token read from the allocated tensors;
* the decode path of a CUDA rank's metadata (context lengths, no mask) gives ``transformers``'
  logits; decode graphs stay off for latent attention;
* ``--quantization`` is refused with one line; layers from ``first_k_dense_replace`` on are MoE;
  the multi-token-prediction layers' tensors of a DeepSeek V3 checkpoint are skipped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TinyModelSpec, load_hf_model, save_tiny_model
from tpserve.model_config import ModelConfig
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.layers.mla_attention import absorbed_attention, expanded_attention
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

LAYERS, HEADS, RANK, ROPE, NOPE, V = 3, 4, 32, 16, 16, 12
SPEC = TinyModelSpec("mla_unit", "deepseek_v3", {
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "vocab_size": 150,
    "kv_lora_rank": RANK, "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE, "v_head_dim": V, "q_lora_rank": 24,
    "first_k_dense_replace": LAYERS}, seed=44)
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(SPEC, tmp_path_factory.mktemp("mla_unit"))


def test_absorbed_decode_equals_expanded_attention() -> None:
    """Three sequences of 37, 20 and 5 tokens, each last query over its own (padded) context."""
    gen = torch.Generator().manual_seed(0)
    lengths, width = (37, 20, 5), 40
    kv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=gen) / RANK**0.5
    latents = torch.randn(len(lengths), width, RANK, generator=gen)
    k_pe = torch.randn(len(lengths), width, ROPE, generator=gen)
    q_nope = torch.randn(len(lengths), 1, HEADS, NOPE, generator=gen)
    q_pe = torch.randn(len(lengths), 1, HEADS, ROPE, generator=gen)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).unsqueeze(1)  # (S, 1, C)
    scale = 0.17
    absorbed = absorbed_attention(q_nope, q_pe, latents, k_pe, kv_b, mask, scale)  # (S, 1, H, V)
    assert absorbed.shape == (3, 1, HEADS, V)
    for s, n in enumerate(lengths):
        expanded = expanded_attention(q_nope[s], q_pe[s], latents[s, :n], k_pe[s, :n], kv_b,
                                      torch.ones(1, n, dtype=torch.bool), scale)  # (1, H, V)
        torch.testing.assert_close(absorbed[s], expanded, atol=1e-5, rtol=1e-5)
    # Not trivially equal: the padding past each context would change the answer if it were read.
    unmasked = absorbed_attention(q_nope, q_pe, latents, k_pe, kv_b, torch.ones_like(mask), scale)
    assert (unmasked[2] - absorbed[2]).abs().max() > 1e-2


def test_expanded_causal_chunk_equals_absorbed_rows() -> None:
    """A prompt's causal expanded attention, row by row, is the absorbed form over each prefix."""
    gen = torch.Generator().manual_seed(1)
    n = 9
    kv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=gen) / RANK**0.5
    latents, k_pe = torch.randn(n, RANK, generator=gen), torch.randn(n, ROPE, generator=gen)
    q_nope, q_pe = torch.randn(n, HEADS, NOPE, generator=gen), torch.randn(n, HEADS, ROPE, generator=gen)
    expanded = expanded_attention(q_nope, q_pe, latents, k_pe, kv_b, None, 0.2)  # (n, H, V)
    causal = torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0)  # (1, n, n)
    absorbed = absorbed_attention(q_nope[None], q_pe[None], latents[None], k_pe[None], kv_b, causal, 0.2)
    torch.testing.assert_close(absorbed[0], expanded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_latent_cache_size_per_token_is_what_the_config_implies(checkpoint: Path, tp: int) -> None:
    config = ModelConfig.from_pretrained(checkpoint)
    assert config.kv_cache_spec(tp).kind == "latent"
    # Not split by heads: every rank holds the whole latent and RoPE key.
    assert config.kv_cache_bytes_per_token(tp, 4) == LAYERS * (RANK + ROPE) * 4
    per_head = dataclasses.replace(config, architecture="LlamaForCausalLM")  # the same model, per-head caching
    assert per_head.kv_cache_bytes_per_token(tp, 4) == 2 * LAYERS * (HEADS // tp) * ROPE * 4


def test_the_pool_holds_the_latent_layout(checkpoint: Path) -> None:
    """The allocated pool, read back: bytes per token = layers x (kv_lora_rank + qk_rope_head_dim) x 4."""
    runner = ModelRunner(checkpoint, ParallelContext.single("cpu"), torch.float32, block_size=BLOCK_SIZE)
    num_blocks = 10
    runner.init_kv_cache(num_blocks)
    assert [tuple(t.shape) for t in runner.kv_caches[0]] == [(num_blocks, BLOCK_SIZE, 1, RANK),
                                                             (num_blocks, BLOCK_SIZE, 1, ROPE)]
    pool_bytes = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
    assert pool_bytes // (num_blocks * BLOCK_SIZE) == LAYERS * (RANK + ROPE) * 4
    assert runner.kv_layout.bytes_per_block == BLOCK_SIZE * LAYERS * (RANK + ROPE) * 4
    assert runner.num_blocks_for_memory(1 << 20) == (1 << 20) // (BLOCK_SIZE * LAYERS * (RANK + ROPE) * 4)
    # qk_rope_head_dim 16 is a head size the compiled paged kernel takes; it reads per-head caches, not latents.
    assert runner._paged_kernel is False


def test_cuda_decode_metadata_matches_transformers_and_graphs_stay_off(checkpoint: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA rank's step metadata (the Triton builder's: context lengths, no mask), which MLA reads with its
    own torch ops, on the CPU; decode graphs are not captured for latent attention (their static block
    tables would make every row read max_model_len tokens of latents every step)."""
    import worker.model_runner as model_runner

    monkeypatch.setattr(model_runner, "triton_attention_available", lambda device, block_size: True)
    runner = ModelRunner(checkpoint, ParallelContext.single("cpu"), torch.float32, block_size=BLOCK_SIZE)
    runner.init_kv_cache(40, cuda_graph_sizes=(1, 2, 4), capture=False)
    assert runner.cuda_graph_sizes == () and runner._builder.triton_decode
    prompts = {0: [5, 9, 13, 7, 21, 3, 40], 1: [11, 12], 2: [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 41]}
    tables = {0: [3, 17], 1: [8], 2: [1, 25, 6]}
    tokens = {s: list(p) for s, p in prompts.items()}
    logits: dict[int, list[torch.Tensor]] = {s: [] for s in prompts}
    greedy = SamplingParams(temperature=0.0)
    chunks = [ScheduledChunk(s, tuple(p), 0, tuple(tables[s])) for s, p in prompts.items()]
    plan = StepPlan(0, tuple(NewSequence(s, greedy) for s in prompts), tuple(chunks))
    for step in range(1, 7):
        result = runner.execute(plan)
        for chunk, token, row in zip(plan.scheduled, result.sampled_token_ids, runner.last_logits, strict=True):
            tokens[chunk.seq_id].append(token)
            logits[chunk.seq_id].append(row.clone())
        chunks = []
        for s in prompts:
            position = len(tokens[s]) - 1
            new_block = (40 - 4 * s - step,) if position % BLOCK_SIZE == 0 else ()
            tables[s] += new_block
            chunks.append(ScheduledChunk(s, (tokens[s][-1],), position, new_block))
        plan = StepPlan(step, (), tuple(chunks))
    hf = load_hf_model(checkpoint)
    for s, prompt in prompts.items():
        with torch.no_grad():
            expected = hf(torch.tensor([tokens[s][:-1]])).logits[0]  # (L, V)
        for i, row in enumerate(logits[s]):
            torch.testing.assert_close(row, expected[len(prompt) - 1 + i], atol=1e-4, rtol=1e-4)


def test_layers_from_first_k_dense_replace_on_are_moe(checkpoint: Path) -> None:
    from worker.layers.moe import SparseMoeBlock
    from worker.models.deepseek_v3 import DeepseekV3ForCausalLM
    from worker.models.llama import LlamaMLP

    raw = json.loads((checkpoint / "config.json").read_text())
    config = ModelConfig.from_dict({**raw, "first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 2,
                                    "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16})
    model = DeepseekV3ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=False)
    assert [type(layer.mlp) for layer in model.model.layers] == [LlamaMLP, SparseMoeBlock, SparseMoeBlock]
    assert model.weight_map("model.layers.1.mlp.experts.5.down_proj.weight") == (
        "model.layers.1.mlp.experts.down_proj", (5, "down"))
    assert model.weight_map("model.layers.1.mlp.shared_experts.up_proj.weight") == (
        "model.layers.1.mlp.shared_experts.gate_up_proj.weight", 1)


def test_multi_token_prediction_layers_are_not_read(checkpoint: Path) -> None:
    from worker.models.deepseek_v3 import DeepseekV3ForCausalLM

    config = ModelConfig.from_pretrained(checkpoint)
    model = DeepseekV3ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=False)
    assert model.weight_map(f"model.layers.{LAYERS}.eh_proj.weight") is None
    assert model.weight_map(f"model.layers.{LAYERS}.self_attn.kv_b_proj.weight") is None
    assert model.weight_map("model.layers.1.self_attn.q_a_proj.weight") == ("model.layers.1.self_attn.q_a_proj.weight",
                                                                           None)
    assert model.weight_map("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", 1)


def test_mla_forward_on_meta_stays_on_the_device_without_host_sync(checkpoint: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLA model's prefill, later chunk and decode rows on ``meta`` in bfloat16 (tests/worker/device_guard.py):
    no host sync and no tensor off the device, so a CUDA decode step stays capturable."""
    import worker.model_runner as model_runner
    from tests.worker.device_guard import DeviceGuard

    runner = ModelRunner(checkpoint, ParallelContext.single("meta"), torch.bfloat16, BLOCK_SIZE)
    guard = DeviceGuard()
    forward = runner.model.forward

    def guarded(*args, **kwargs):
        with guard:
            return forward(*args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", guarded)
    monkeypatch.setattr(model_runner, "sample_tensors", lambda logits, tensors: torch.zeros(logits.shape[0],
                                                                                           dtype=torch.int64))
    runner.init_kv_cache(num_blocks=16)
    greedy = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(0, (NewSequence(0, greedy), NewSequence(1, greedy)), (
        ScheduledChunk(0, (5, 6, 7, 8, 9), 0, (3, 1)), ScheduledChunk(1, (10, 11, 12), 0, (2,), sample=False))))
    runner.execute(StepPlan(1, scheduled=(ScheduledChunk(0, (42,), 5), ScheduledChunk(1, (15, 16, 17), 3, (4,)))))
    assert guard.violations == []
    assert guard.num_ops > 100


def test_glm4_moe_lite_reads_its_layer_pattern(checkpoint: Path) -> None:
    """GLM-4.7-Flash: ``mlp_layer_types`` picks the MoE layers (default: all but the first); a bad one is named."""
    from worker.layers.moe import SparseMoeBlock
    from worker.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
    from worker.models.llama import LlamaMLP

    raw = {**json.loads((checkpoint / "config.json").read_text()), "architectures": ["Glm4MoeLiteForCausalLM"],
           "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 1, "topk_group": 1}
    raw.pop("first_k_dense_replace")
    ctx = ParallelContext.single("meta")
    for types, expected in ((None, [LlamaMLP, SparseMoeBlock, SparseMoeBlock]),
                            (["sparse", "dense", "dense"], [SparseMoeBlock, LlamaMLP, LlamaMLP])):
        config = ModelConfig.from_dict({**raw, "mlp_layer_types": types})
        assert config.kv_cache_spec(2).kind == "latent"
        model = Glm4MoeLiteForCausalLM(config, ctx, torch.float32, tie_word_embeddings=False)
        assert [type(layer.mlp) for layer in model.model.layers] == expected
    with pytest.raises(ValueError, match=r"^config.json mlp_layer_types=\['dense', 'moe'\] must list 'dense' or "
                                         r"'sparse' for each of the 3 layers$"):
        Glm4MoeLiteForCausalLM(ModelConfig.from_dict({**raw, "mlp_layer_types": ["dense", "moe"]}), ctx,
                               torch.float32, tie_word_embeddings=False)
