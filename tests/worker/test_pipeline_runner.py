"""ModelRunner with pipeline stages, (tp, pp) = (1, 2), (2, 2), (1, 4), against Hugging Face ``transformers``.

Tiny checkpoints with more layers than the shared tiny set (stages need a layer
each): a tied-embedding GQA Llama of 5 layers (uneven: 3 + 2 at pp 2, 1 + 1 + 2 + 1 at
pp 4; with tied embeddings the last stage holds the embedding matrix for its head),
an untied Qwen2 (q/k/v bias), a tied Granite (multipliers on the first and last
stages), a Llama 4 (layers built by global index), an OLMo 3 and an EXAONE 4 (windows, RoPE per layer type,
a NoPE layer, post-norms: each stage's layers as the model's), a DeepSeek V3 (multi-head latent attention,
each stage caching its layers' latents; two MoE layers), and gpt-oss, GLM-4.5, MiniMax-M2, ERNIE 4.5,
Command R, StarCoder2, SmolLM3 and OLMo 2, each of 4 layers. Each runs tests/worker/scenarios.py's
standard scenario (prefills of several lengths, a prompt prefilled in two chunks,
new prefills beside running decodes, a seeded sampled sequence preempted and
re-sent, freed blocks reused): every sampled row's logits equal ``transformers``'
(float32, 1e-4) and every token the reference's. The Llama also runs 32 greedy
tokens for each of 8 prompts alone and 16 sequences at once, with prompt
log-probabilities (the last stage scores the prompt). stories260k reproduces every
line of its greedy goldens at (2, 2).

Only the last stage's tensor-parallel rank 0 may report tokens, logits or prompt
log-probabilities (tests/worker/pp_harness.py checks every other rank's are empty).
All layouts run in one spawn of 4 processes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.paths import STORIES_DIR, load_goldens, requires_stories
from tests.tiny_models import TINY_MAX_POSITIONS, TinyModelSpec, load_hf_model, save_tiny_model
from tests.worker.pp_harness import run_pipeline_layouts
from tests.worker.sigmoid_moe_specs import ERNIE4_5_MOE, GLM4_MOE, MINIMAX_M2
from tests.worker.scenarios import SeqSpec, build_plans, hf_reference, standard_specs
from tests.worker.tp_goldens import (
    BLOCK_SIZE,
    GREEDY_BLOCKS,
    GREEDY_PROMPTS,
    GREEDY_SCORED,
    GREEDY_TOKENS,
    NUM_BLOCKS,
    Case,
    _check_case,
    _greedy_reference,
)
from tests.worker.tp_harness import Job
from tpserve.pipeline_split import stage_layer_counts

LAYOUTS = ((1, 2), (2, 2), (1, 4))
_DIMS = {"hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": TINY_MAX_POSITIONS,
         "num_attention_heads": 4, "num_key_value_heads": 2}
PP_MODELS = (
    TinyModelSpec("pp_llama_tied_5_layers", "llama",
                  {**_DIMS, "num_hidden_layers": 5, "vocab_size": 130, "tie_word_embeddings": True}, seed=11),
    TinyModelSpec("pp_qwen2_untied_4_layers", "qwen2",
                  {**_DIMS, "num_hidden_layers": 4, "vocab_size": 200, "tie_word_embeddings": False}, seed=12),
    # Granite scales the first stage's embedding and the last stage's logits; tied, so the last
    # stage holds the embedding matrix for its head without applying the multiplier there.
    TinyModelSpec("pp_granite_tied_4_layers", "granite",
                  {**_DIMS, "num_hidden_layers": 4, "vocab_size": 150, "tie_word_embeddings": True,
                   "embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
                   "logits_scaling": 2.5}, seed=13),
    # Llama 4: a stage builds its layers by their global index (chunked RoPE layers 0-2, NoPE 3; MoE 1, 3).
    TinyModelSpec("pp_llama4_4_layers", "llama4_text",
                  {**_DIMS, "num_hidden_layers": 4, "vocab_size": 160, "intermediate_size": 64,
                   "intermediate_size_mlp": 128, "num_local_experts": 4, "interleave_moe_layer_step": 2,
                   "attention_chunk_size": 8, "floor_scale": 4, "attn_scale": 0.5, "tie_word_embeddings": False},
                  seed=14),
    # Post-norms and the full-width QK norm (an all-reduce within each stage), 3 sliding : 1 full layers with
    # a RoPE per layer type: each stage's layers take their own types' windows and RoPEs.
    TinyModelSpec("pp_olmo3_4_layers", "olmo3",
                  {**_DIMS, "num_hidden_layers": 4, "vocab_size": 190, "sliding_window": 6,
                   "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 500000.0}}}, seed=13),
    # EXAONE 4: local layers with RoPE and a window, the last layer global without RoPE (NoPE).
    TinyModelSpec("pp_exaone4_4_layers", "exaone4",
                  {**_DIMS, "num_hidden_layers": 4, "vocab_size": 190, "sliding_window": 6,
                   "sliding_window_pattern": 4}, seed=14),
    # Multi-head latent attention: each stage caches its layers' latents; layers 2-3 a DeepSeek MoE.
    TinyModelSpec("pp_deepseek_v3_4_layers", "deepseek_v3",
                  {**_DIMS, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 170, "q_lora_rank": 24,
                   "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12,
                   "first_k_dense_replace": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                   "topk_group": 1, "moe_intermediate_size": 32}, seed=13),
    # The other 2025-26 families, 4 layers each: a stage holds its layers' sinks and stacked experts
    # (gpt-oss), sigmoid routing with dense first layers and shared experts (GLM-4.5, ERNIE 4.5), the
    # full-width QK norm (MiniMax-M2, OLMo 2), a parallel residual with interleaved RoPE (Command R),
    # LayerNorm with biases (StarCoder2), NoPE layers (SmolLM3).
    TinyModelSpec("pp_gpt_oss_4_layers", "gpt_oss",
                  {**_DIMS, "num_hidden_layers": 4, "head_dim": 16, "vocab_size": 190, "intermediate_size": 32,
                   "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6, "swiglu_limit": 1.0,
                   "tie_word_embeddings": False, "pad_token_id": 0}, seed=15),
    *(TinyModelSpec(f"pp_{spec.name}_4_layers", spec.model_type, {**spec.config, "num_hidden_layers": 4}, seed=16)
      for spec in (GLM4_MOE, MINIMAX_M2, ERNIE4_5_MOE)),
    TinyModelSpec("pp_cohere_4_layers", "cohere",
                  {**_DIMS, "num_hidden_layers": 4, "vocab_size": 190, "pad_token_id": 0, "use_qk_norm": True,
                   "logit_scale": 0.25}, seed=17),
    TinyModelSpec("pp_starcoder2_4_layers", "starcoder2",
                  {**_DIMS, "num_hidden_layers": 4, "vocab_size": 190, "sliding_window": 6,
                   "hidden_act": "gelu_pytorch_tanh"}, seed=18),
    TinyModelSpec("pp_smollm3_4_layers", "smollm3",
                  {**_DIMS, "num_hidden_layers": 4, "vocab_size": 190, "pad_token_id": 0}, seed=19),
    TinyModelSpec("pp_olmo2_4_layers", "olmo2", {**_DIMS, "num_hidden_layers": 4, "vocab_size": 190}, seed=20),
)
GREEDY_MODEL = PP_MODELS[0].name
GOLDEN_JOB = "stories260k_goldens"
#: Prompts run one at a time (32 steps each): fewer than the 8 of the batch, to keep the test short.
ALONE_PROMPTS = 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp_models")
    return {spec.name: save_tiny_model(spec, root / spec.name) for spec in PP_MODELS}


@pytest.fixture(scope="module")
def cases(checkpoints: dict[str, Path]) -> dict[str, Case]:
    cases = {}
    for i, spec in enumerate(PP_MODELS):
        model = load_hf_model(checkpoints[spec.name])
        specs = standard_specs(model.config.vocab_size, seed=i)
        completions, logits = hf_reference(model, specs)
        plans, expected = build_plans(specs, completions, BLOCK_SIZE, NUM_BLOCKS, seed=i)
        cases[spec.name] = Case(Job(spec.name, str(checkpoints[spec.name]), tuple(plans), NUM_BLOCKS, BLOCK_SIZE),
                                expected, completions, logits)
        if spec.name != GREEDY_MODEL:
            continue
        rng = random.Random(19)
        prompts = [tuple(rng.randrange(3, model.config.vocab_size) for _ in range(rng.randrange(2, 13)))
                   for _ in range(GREEDY_PROMPTS)]
        greedy, greedy_logits, scored = _greedy_reference(model, prompts)
        alone = [SeqSpec(i, prompts[i], GREEDY_TOKENS, GREEDY_SCORED, arrive_step=i * GREEDY_TOKENS)
                 for i in range(ALONE_PROMPTS)]
        together = [SeqSpec(i, prompts[i % GREEDY_PROMPTS], GREEDY_TOKENS, GREEDY_SCORED)
                    for i in range(2 * GREEDY_PROMPTS)]
        for kind, seqs in (("alone", alone), ("16_at_once", together)):
            want = {s.seq_id: greedy[s.seq_id % GREEDY_PROMPTS] for s in seqs}
            plans, expected = build_plans(seqs, want, BLOCK_SIZE, GREEDY_BLOCKS, seed=len(seqs))
            name = f"{spec.name}/{kind}"
            cases[name] = Case(Job(name, str(checkpoints[spec.name]), tuple(plans), GREEDY_BLOCKS, BLOCK_SIZE),
                               expected, want, {i: greedy_logits[i % GREEDY_PROMPTS] for i in want},
                               {i: scored[i % GREEDY_PROMPTS] for i in want})
    return cases


def _golden_case() -> Case | None:
    """Every stories260k golden line as one job (None where ../shared is absent)."""
    goldens = load_goldens()
    if not goldens or not (STORIES_DIR / "config.json").is_file():
        return None
    specs = [SeqSpec(i, tuple(line["prompt_token_ids"]), len(line["completion_token_ids"]),
                     arrive_step=i % 2, prefill_chunk=3 if i == 1 else None) for i, line in enumerate(goldens)]
    completions = {i: list(line["completion_token_ids"]) for i, line in enumerate(goldens)}
    num_blocks = sum(len(line["prompt_token_ids"]) + len(line["completion_token_ids"]) for line in goldens)
    plans, expected = build_plans(specs, completions, BLOCK_SIZE, num_blocks)
    return Case(Job(GOLDEN_JOB, str(STORIES_DIR), tuple(plans), num_blocks, BLOCK_SIZE), expected, completions, None)


@pytest.fixture(scope="module")
def golden_case() -> Case | None:
    return _golden_case()


@pytest.fixture(scope="module")
def records(cases: dict[str, Case], golden_case: Case | None):
    """Every layout's sampling-rank records, from one spawn of processes."""
    runs = {layout: [case.job for case in cases.values()] for layout in LAYOUTS}
    if golden_case is not None:
        runs[(2, 2)].append(golden_case.job)
    return run_pipeline_layouts(runs)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"tp{layout[0]}_pp{layout[1]}")
@pytest.mark.parametrize("name", [spec.name for spec in PP_MODELS])
def test_standard_scenario_matches_transformers(layout, name: str, cases, records) -> None:
    _check_case(cases[name], records[layout][name])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"tp{layout[0]}_pp{layout[1]}")
@pytest.mark.parametrize("kind", ["alone", "16_at_once"])
def test_32_greedy_tokens_match_transformers(layout, kind: str, cases, records) -> None:
    case = cases[f"{GREEDY_MODEL}/{kind}"]
    assert max(len(plan.scheduled) for plan in case.job.plans) == (1 if kind == "alone" else 2 * GREEDY_PROMPTS)
    _check_case(case, records[layout][case.job.name])


@requires_stories
def test_stories260k_goldens_at_tp2_pp2(golden_case: Case | None, records) -> None:
    assert golden_case is not None and len(golden_case.completions) == len(load_goldens()) >= 5  # every line
    _check_case(golden_case, records[(2, 2)][GOLDEN_JOB])


def test_layers_split_as_documented() -> None:
    """The rule of tpserve/pipeline_split.py: extra layers to the stages before the last."""
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(5, 4) == [1, 1, 2, 1]
    assert stage_layer_counts(10, 4) == [2, 3, 3, 2]
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="num_hidden_layers=2 cannot be split into pipeline_parallel_size=4"):
        stage_layer_counts(2, 4)
