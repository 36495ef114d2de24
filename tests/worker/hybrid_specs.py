"""Tiny seeded hybrid checkpoints (state layers beside attention), shared by the worker and end-to-end tests.

* :data:`LFM2`: four layers, conv / attention alternating (``layer_types``), biased convolutions
  (``conv_bias``: in_proj, the taps and out_proj), kernel 3, GQA 4:2 with QK-norm, tied LM head;
* :data:`LFM2_IDXS`: the older config form (``full_attn_idxs``), three layers of which one attends,
  kernel 4, no bias, untied LM head;
* :data:`QWEN3_NEXT_SPEC`, :data:`QWEN3_5_SPEC`, :data:`QWEN3_5_MOE_SPEC` (Gated DeltaNet + gated attention):
  four layers, ``layer_types`` linear, linear, linear, full (``full_attention_interval`` 4, as the released
  models). DeltaNet: 2 key heads of 16 serving 4 value heads of 8 (two per key head, so the grouped layout and
  the head repeat both matter; one key head per rank at tp 2), kernel 4. Attention: 4 query heads over 2 KV
  heads of 16, RoPE on a quarter of each head (the families' default). Qwen3-Next: 8 experts, top-2
  renormalised, a shared expert, layer 2 dense (``mlp_only_layers``); Qwen3.5-MoE: every layer sparse. The
  zero-centred norms' weights are drawn around 0 (each scales by about 1). Each DeltaNet query projection is
  its key projection plus noise (``query_key_correlation``, tests/tiny_models.py), so that float32 stays within
  1e-4 of float64 on these checkpoints. 160 positions, so that prompts span more than one 64-row DeltaNet chunk.
* :data:`GRANITE_HYBRID_MOE`, :data:`GRANITE_HYBRID_DENSE`, :data:`NEMOTRON_H`: Mamba-2 layers (chunk
  size 8, so every test prompt spans several chunks) beside attention (and MLP / MoE layers).

For the Mamba-2 hybrids' runner-free runs (tests/worker/hybrid_harness.py, checked against
``transformers`` by :func:`check_against_transformers`), :func:`save_hybrid_model` draws the weights as
tests/tiny_models.py does, then sets ``dt_bias`` near -2 so that the Mamba state decays slowly
(about 0.88 per token) and a wrong carried state shows in later tokens. The same specs go through
the runner in tests/worker/family_check.py (its own weights: tests/tiny_models.py's alone); every
size splits over tp 1, 2 and 4, the degrees the family tests share one process group for.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_models import TinyModelSpec, build_hf_model, load_hf_model

LFM2 = TinyModelSpec("lfm2", "lfm2", {
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 190,
    "intermediate_size": 192, "block_multiple_of": 32, "conv_L_cache": 3, "conv_bias": True, "norm_eps": 1e-5,
    "layer_types": ["conv", "full_attention", "conv", "full_attention"],
}, seed=71)
LFM2_IDXS = TinyModelSpec("lfm2_idxs", "lfm2", {
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 190,
    "intermediate_size": 96, "block_multiple_of": 16, "conv_L_cache": 4, "full_attn_idxs": [2],
    "tie_word_embeddings": False,
}, seed=72)

_MAMBA_GRANITE = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
                  "mamba_chunk_size": 8}
GRANITE_HYBRID_MOE = TinyModelSpec("granite4_hybrid_moe", "granitemoehybrid", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 190, "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "mamba"], **_MAMBA_GRANITE, "mamba_n_groups": 1,
    "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 48,
    "position_embedding_type": "nope", "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
    "attention_multiplier": 0.2, "logits_scaling": 1.5, "tie_word_embeddings": False}, seed=41)
GRANITE_HYBRID_DENSE = TinyModelSpec("granite4_hybrid_dense", "granitemoehybrid", {
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 190, "num_hidden_layers": 3,
    "layer_types": ["attention", "mamba", "mamba"], **_MAMBA_GRANITE, "mamba_n_groups": 4,
    "num_local_experts": 0, "shared_intermediate_size": 64, "position_embedding_type": "rope",
    "mamba_conv_bias": False, "mamba_proj_bias": True, "tie_word_embeddings": True}, seed=42)
NEMOTRON_H = TinyModelSpec("nemotron_h", "nemotron_h", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 190,
    "hybrid_override_pattern": "M*-ME", "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 4,
    "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 8, "intermediate_size": 96,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 1.5, "tie_word_embeddings": False}, seed=43)
#: The same blocks with ``mlp_bias``: the MLPs', the experts' and the shared expert's biases (the shared
#: expert's ``down_proj`` leaves its all-reduce, and so its bias, to the MoE block: it was dropped).
NEMOTRON_H_MLP_BIAS = TinyModelSpec("nemotron_h_mlp_bias", "nemotron_h", {**NEMOTRON_H.config, "mlp_bias": True},
                                    seed=44)

#: Greedy tokens per sequence in the acceptance runs.
MAX_TOKENS = 32


def save_hybrid_model(spec: TinyModelSpec, directory: Path) -> Path:
    """Write ``spec``'s seeded checkpoint into ``directory`` (see the module docstring); return it."""
    model = build_hf_model(spec)
    generator = torch.Generator().manual_seed(spec.seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("dt_bias"):
                param.copy_(-2.0 + 0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def prompts(count: int, seed: int, vocab_size: int = 190) -> tuple[tuple[int, ...], ...]:
    """``count`` seeded prompts of 9 to 24 tokens (longer than one Mamba chunk of 8)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(9, 25, (count,), generator=generator).tolist()
    return tuple(tuple(torch.randint(3, vocab_size, (n,), generator=generator).tolist()) for n in lengths)


def check_against_transformers(model_dir: Path, prompt_list: tuple[tuple[int, ...], ...],
                               results: list[tuple[list[int], torch.Tensor]], *, atol: float = 1e-4) -> None:
    """Each run's greedy tokens are ``transformers``' and its logprobs (prompt rows and sampled rows)
    within ``atol`` of the reference's, teacher-forced over the prompt and our tokens in one forward."""
    reference = load_hf_model(model_dir)
    for prompt, (tokens, logits) in zip(prompt_list, results, strict=True):
        assert len(tokens) == MAX_TOKENS
        full = torch.tensor([list(prompt) + tokens[:-1]], dtype=torch.int64)
        with torch.no_grad():
            want = reference(full).logits[0].float()  # (P + 31, vocab)
        assert logits.shape == want.shape
        ours, theirs = torch.log_softmax(logits, -1), torch.log_softmax(want, -1)
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
        assert tokens == want[len(prompt) - 1:].argmax(-1).tolist()  # transformers' greedy choice at every step
_HYBRID = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 190, "max_position_embeddings": 160, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
           "linear_conv_kernel_dim": 4, "tie_word_embeddings": False}
#: The DeltaNet query rows are the key rows plus this much noise (tests/tiny_models.py's
#: ``_correlate_queries_with_keys``: without it the tiny checkpoints' float32 rounding reaches ~5e-4).
_QK_NOISE = 0.3
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}

QWEN3_NEXT_SPEC = TinyModelSpec("qwen3_next", "qwen3_next", {**_HYBRID, **_MOE, "norm_topk_prob": True,
                                                             "mlp_only_layers": [2]}, seed=44,
                               zero_centred_norms=True, query_key_correlation=_QK_NOISE)
QWEN3_5_SPEC = TinyModelSpec("qwen3_5", "qwen3_5_text", _HYBRID, seed=45, zero_centred_norms=True,
                             query_key_correlation=_QK_NOISE)
QWEN3_5_MOE_SPEC = TinyModelSpec("qwen3_5_moe", "qwen3_5_moe_text", {**_HYBRID, **_MOE}, seed=46,
                                 zero_centred_norms=True, query_key_correlation=_QK_NOISE)
GATED_DELTA_NET_SPECS = (QWEN3_NEXT_SPEC, QWEN3_5_SPEC, QWEN3_5_MOE_SPEC)
