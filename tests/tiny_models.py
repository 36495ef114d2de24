"""Seeded random tiny Hugging Face checkpoints for tests (built offline with ``transformers``).

Each variant exercises one thing the worker must get right; all are small enough
(hidden 64, 2 layers, vocab ~130-300) to run at tensor-parallel degree 4 on a CPU.
Every parameter is redrawn from a seeded generator after construction (biases
and norm weights included: ``transformers`` would initialise them to 0 and 1,
which would hide a loading bug), with a spread that keeps greedy choices well
separated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: Positions the tiny models support (tests stay well below).
TINY_MAX_POSITIONS = 96


@dataclass(frozen=True)
class TinyModelSpec:
    """One tiny checkpoint variant.

    Attributes:
        name: short id used in test names and directory names.
        model_type: a ``transformers`` model type (``"llama"``, ``"qwen2"``, ``"gemma2"``...).
        config: keyword arguments of the ``transformers`` config class.
        max_shard_size: when set, ``save_pretrained`` shards the checkpoint
            (``model.safetensors.index.json``).
        seed: seed of the weights.
        zero_centred_norms: the family's RMSNorms scale by ``1 + w`` (Qwen3-Next, Qwen3.5): their weights are
            drawn around 0, so that every norm scales by about 1 as the others do (a gated norm, ``w * x``,
            stays around 1).
        query_key_correlation: Gated DeltaNet families only (0: off): each DeltaNet layer's query projection rows
            are redrawn as its key rows plus independent noise of this relative size, and the query channels'
            conv taps copied from the key channels' (see :func:`_correlate_queries_with_keys`).
    """

    name: str
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    max_shard_size: str | None = None
    seed: int = 0
    zero_centred_norms: bool = False
    query_key_correlation: float = 0.0


_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": TINY_MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TINY_MODELS: tuple[TinyModelSpec, ...] = (
    # GQA (2 query heads per KV head), tied embeddings, vocab not divisible by 4.
    TinyModelSpec("gqa_tied", "llama", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                        "vocab_size": 130, "tie_word_embeddings": True}, seed=1),
    # MQA: one KV head, replicated at tp 2 and 4; untied LM head; Llama o_proj and MLP biases.
    TinyModelSpec("mqa_untied_bias", "llama", {"num_attention_heads": 4, "num_key_value_heads": 1,
                                               "vocab_size": 257, "tie_word_embeddings": False,
                                               "attention_bias": True, "mlp_bias": True}, seed=2),
    # Qwen2: q/k/v bias, no o_proj bias.
    TinyModelSpec("qwen2_qkv_bias", "qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                              "vocab_size": 200, "tie_word_embeddings": False,
                                              "rope_theta": 1000000.0}, seed=3),
    # Llama 3 RoPE scaling; explicit head_dim (32) != hidden / heads (16); MHA.
    TinyModelSpec("llama3_rope", "llama", {"num_attention_heads": 4, "num_key_value_heads": 4,
                                           "head_dim": 32, "vocab_size": 160, "tie_word_embeddings": True,
                                           "rope_theta": 500000.0,
                                           "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 16}}, seed=4),
    # Sharded safetensors with an index; linear RoPE scaling.
    TinyModelSpec("sharded_linear_rope", "llama", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "vocab_size": 300, "tie_word_embeddings": False,
                                                   "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                  max_shard_size="40KB", seed=5),
    # Qwen3: per-head q/k RMSNorm before RoPE; head_dim (32) != hidden / heads (16); 2 KV heads, replicated at tp 4.
    TinyModelSpec("qwen3_qk_norm", "qwen3", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                                             "vocab_size": 190, "tie_word_embeddings": False,
                                             "rope_theta": 1000000.0}, seed=6),
    # Phi-3: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj); GQA, untied.
    TinyModelSpec("phi3_fused", "phi3", {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 170,
                                         "tie_word_embeddings": False, "pad_token_id": 0}, seed=7),
)


def build_hf_model(spec: TinyModelSpec) -> torch.nn.Module:
    """The ``transformers`` model of ``spec`` with seeded random weights, float32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(spec.model_type, **{**_BASE, **spec.config})
    config._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            norm = name.endswith(("norm.weight", "norm_f.weight"))  # norm_f: Nemotron-H's final norm
            if norm and spec.zero_centred_norms and not name.endswith("linear_attn.norm.weight"):
                param.copy_(0.2 * noise)
            elif norm:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight", "backbone.embeddings.weight")):
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)  # unit-variance activations
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer (DeepSeek V3, GLM-4.5, MiniMax-M2): 0 by default
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
        if spec.query_key_correlation:
            _correlate_queries_with_keys(model, spec.query_key_correlation,
                                         torch.Generator().manual_seed(spec.seed + 3000))
    return model


def _correlate_queries_with_keys(model: torch.nn.Module, noise: float, generator: torch.Generator) -> None:
    """Make every Gated DeltaNet layer read back roughly what it wrote, as trained ones do (a conditioning fix).

    With independent random query and key projections, ``q_t . k_j`` of the L2-normalised 16-wide heads is about
    N(0, 1/16), so a head's output ``o_t = sum_j exp(G_t - G_j) (q_t . k_j) u_j`` is a sum of terms of random sign
    that often nearly cancels: rows of rms 1e-5 beside terms of 1e-1. The per-head gated RMSNorm then scales that
    row back to O(1), and float32's relative rounding of the sum with it (transformers' own float32 was up to
    4.5e-4 off its float64 in the log-probabilities, its decode steps 5e-4 off its prefill). With the query rows
    ``(k_row + noise * n) / sqrt(1 + noise^2)`` (n a fresh unit-variance row) and the query channels' conv taps
    the key channels', ``q_t . k_t`` is about 0.95 and the current token's own write dominates the read: no
    cancellation, and float32 stays within ~4e-5 of float64. The queries still differ from the keys (a swap of
    the two, or of their conv channels, changes the output far beyond the tolerance).
    """
    for layer in model.model.layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is None:
            continue
        head_dim, heads = mixer.head_k_dim, mixer.num_k_heads
        key_dim = head_dim * heads
        if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next: per key head [q, k, v (grouped), z] rows
            weight = mixer.in_proj_qkvz.weight
            per_head = weight.shape[0] // heads
            q_rows = [h * per_head + i for h in range(heads) for i in range(head_dim)]
            k_rows = [h * per_head + head_dim + i for h in range(heads) for i in range(head_dim)]
        else:  # Qwen3.5: in_proj_qkv is [q (all heads), k, v]
            weight = mixer.in_proj_qkv.weight
            q_rows, k_rows = list(range(key_dim)), list(range(key_dim, 2 * key_dim))
        fresh = torch.randn((key_dim, weight.shape[1]), generator=generator) / weight.shape[1] ** 0.5
        weight[q_rows] = (weight[k_rows] + noise * fresh) / (1 + noise**2) ** 0.5
        taps = mixer.conv1d.weight  # (q | k | v channels, 1, kernel): the conv's channels are q, k, v in order
        taps[:key_dim] = taps[key_dim:2 * key_dim]


def save_tiny_model(spec: TinyModelSpec, directory: Path) -> Path:
    """Write ``spec``'s checkpoint (config.json + safetensors) into ``directory``; return it."""
    model = build_hf_model(spec)
    kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def load_hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load a checkpoint with ``transformers`` (the reference implementation), eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()


def save_servable_model(name: str | TinyModelSpec, directory: Path, tokenizer_dir: Path) -> Path:
    """The tiny checkpoint ``name`` (of :data:`TINY_MODELS`, or a spec) at ``tokenizer_dir``'s vocabulary
    (512: stories260k's), with its tokenizer.

    Servable end to end (``tpserve serve`` needs ``tokenizer.json``); 256 positions. The LM
    head's rows of the byte-fallback tokens (``<0x..>``) are zeroed, so greedy text is made of
    whole tokens: random weights would otherwise emit invalid UTF-8 byte runs, whose
    replacement characters are the detokenizer's business, not the model's. Returns ``directory``.
    """
    import dataclasses
    import shutil

    from tokenizers import Tokenizer

    spec = name if isinstance(name, TinyModelSpec) else next(s for s in TINY_MODELS if s.name == name)
    spec = dataclasses.replace(spec, config={**spec.config, "vocab_size": 512, "max_position_embeddings": 256})
    model = build_hf_model(spec)
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab()
    byte_tokens = [i for token, i in vocab.items() if token.startswith("<0x") and token.endswith(">")]
    with torch.no_grad():
        model.get_output_embeddings().weight[byte_tokens] = 0.0
    model.save_pretrained(directory, safe_serialization=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, directory / file)
    return directory
