"""The Llama decoder, one tensor-parallel shard of it; Mistral and Qwen2 are Llama with other biases.

Architecture (Touvron et al. 2023, arXiv:2302.13971; reference: ``transformers``'
``modeling_llama.py``), for a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)                                   vocab-parallel, all-reduce
    for each layer:
        h = h + o_proj(attention(rope(q, k), v))           o_proj row-parallel, all-reduce
                 where q, k, v = qkv_proj(rms_norm(h))     column-parallel by head
        h = h + down_proj(silu(gate) * up)                 down_proj row-parallel, all-reduce
                 where gate, up = gate_up_proj(rms_norm(h))  column-parallel
    h = rms_norm(h)
    logits = lm_head(h[rows that sample])                  vocab-parallel, gathered on rank 0

``num_heads``/``num_kv_heads``/``intermediate`` below are this rank's shares.
Parameter names match the Hugging Face checkpoint except the fused
``qkv_proj`` (q/k/v_proj) and ``gate_up_proj`` (gate/up_proj): the class's
``stacked_params_mapping`` (worker/models/base.py).

The families differ only in which projections carry a bias (``transformers``'
``modeling_llama.py``, ``modeling_mistral.py``, ``modeling_qwen2.py``):

| class              | q/k/v bias         | o_proj bias        | MLP bias    |
| ------------------ | ------------------ | ------------------ | ----------- |
| LlamaForCausalLM   | ``attention_bias`` | ``attention_bias`` | ``mlp_bias``|
| MistralForCausalLM | no                 | no                 | no          |
| Qwen2ForCausalLM   | always             | no                 | no          |

Mistral's ``sliding_window`` and Qwen2's (``use_sliding_window``, ``max_window_layers``)
make some layers attend over a window (``ModelConfig.layer_sliding_window``,
worker/attention.py).

A related family reuses the pieces through :meth:`LlamaForCausalLM.decoder_layer`
(its attention or MLP) and :meth:`LlamaForCausalLM.biases`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata, PagedAttention
from worker.layers.decode_block import (DecodeStack, decode_block_forward, decode_block_supported,
                                        step_takes_decode_block)
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm, SiluAndMul
from worker.layers.rotary import RotaryEmbedding, rotate_and_cache
from worker.models.base import LLAMA_STACKED_PARAMS, CausalLM, KVCache
from worker.parallel_state import ParallelContext

#: The step's RoPE ``(cos, sin)``, each ``(T, 1, head_dim)``, shared by every layer.
Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Biases:
    """Which projections carry a bias."""

    qkv: bool = False
    o_proj: bool = False
    mlp: bool = False


class LlamaAttention(nn.Module):
    """Self-attention of one layer, on this rank's query and key/value heads (``sliding_window``: its window)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None = None, biases: Biases = Biases(), *,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.total_num_heads, config.total_num_kv_heads, ctx,
            bias=biases.qkv, dtype=dtype, quantization=quantization,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.total_num_heads * d, config.hidden_size, ctx, bias=biases.o_proj, dtype=dtype,
            quantization=quantization,
        )
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5, sliding_window=sliding_window)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = rotate_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                   self.num_kv_heads, kv_scales=self.attn.kv_scales)  # q, k rotated; k, v now in the cache at their slots
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


#: The attention classes whose maths the compiled decode layer reproduces (worker/layers/decode_block.py).
#: Exact types: a subclass that changes the maths must not inherit the compiled path (Qwen3's QK-norm
#: adds itself, worker/models/qwen3.py).
DECODE_BLOCK_ATTENTIONS: set[type[nn.Module]] = {LlamaAttention}


class LlamaMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020, arXiv:2002.05202)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None = None, *, bias: bool = False) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], ctx, bias=bias, dtype=dtype, quantization=quantization
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size, ctx, bias=bias, dtype=dtype,
                                           quantization=quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        h = self.act_fn(gate_up)  # (T, intermediate)
        return self.down_proj(h)  # (T, hidden), all-reduced over ranks


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: ``self_attn`` then ``mlp``, given (a family picks them)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, self_attn: nn.Module,
                 mlp: nn.Module) -> None:
        super().__init__()
        device = ctx.device
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = mlp
        # Llama's own attention and MLP on a float32 CPU: a tensor-parallel rank's decode step runs each
        # half of the layer as one compiled call (one rank: LlamaModel's decode_stack takes the whole step).
        self.decode_block = (type(self_attn) in DECODE_BLOCK_ATTENTIONS and type(mlp) is LlamaMLP
                             and decode_block_supported(self_attn, device, dtype))

    def forward(self, rope: Rope, h: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        if self.decode_block and step_takes_decode_block(h, attn_metadata):
            return decode_block_forward(self, rope, h, kv_cache, attn_metadata)  # (T, hidden), bit-identical
        a = self.self_attn(rope, self.input_layernorm(h), kv_cache, attn_metadata)  # (T, hidden)
        h, x = self.post_attention_layernorm.add_and_norm(h, a)  # h + a, and its norm, in one pass
        return h + self.mlp(x)  # (T, hidden)


class LlamaModel(nn.Module):
    """Embedding, the given decoder layers and final norm.

    With pipeline stages (worker/pipeline.py) ``layers`` are this stage's; ``embedding``
    False leaves out the embedding (a stage after the first), ``head`` False the final
    norm (a stage before the last). ``norm``: the final norm (default Llama's RMSNorm);
    ``interleaved_rope``: the step's ``(cos, sin)`` in the interleaved layout (Cohere's and
    Llama 4's, worker/layers/rotary.py) instead of rotate-half's.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, layers: list[nn.Module], *,
                 embedding: bool = True, head: bool = True, norm: nn.Module | None = None,
                 interleaved_rope: bool = False) -> None:
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx, dtype=dtype)
                             if embedding else None)
        # Partial RoPE (config.rotary_dim: GLM-4.5, MiniMax-M2) rotates the leading dims of a head only.
        self.rotary_emb = RotaryEmbedding(config.rotary_dim or config.head_dim, config.rope_theta, config.rope_scaling,
                                          ctx.device, max_position=config.max_model_len,  # a cos/sin table when small
                                          interleaved=interleaved_rope)
        self.layers = nn.ModuleList(layers)
        if head and norm is None:
            norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.norm = norm if head else None
        # One rank of Llama's own layers on a float32 CPU: a decode step runs the whole stack as one
        # compiled call (the same kernels as the modules, without the Python between them).
        # A tensor-parallel rank whose group shares memory on one host, with the compiled collectives: the
        # same, its all-reduces inside the call (worker/layers/decode_block.py).
        shm = ctx.shm if ctx.tp_size > 1 and ctx.shm is not None and ctx.shm.compiled else None
        self.decode_stack = (DecodeStack(self.layers, shm) if (ctx.tp_size == 1 or shm is not None) and layers
                             and all(getattr(layer, "decode_block", False) for layer in layers) else None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # (T, hidden): embedded and all-reduced over ranks, or the previous pipeline stage's output.
        h = self.embed_tokens(input_ids) if hidden_states is None else hidden_states
        rope = self.rotary_emb(positions, h.dtype, attn_metadata.rope_seq_lens)  # cos, sin: (T, 1, head_dim) each
        stacked = None
        if self.decode_stack is not None and step_takes_decode_block(h, attn_metadata):
            stacked = self.decode_stack(rope, h, kv_caches, attn_metadata)  # (T, hidden), bit-identical, or None
        if stacked is not None:
            h = stacked
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                h = layer(rope, h, kv_cache, attn_metadata)  # (T, hidden)
        return h if self.norm is None else self.norm(h)  # (T, hidden)


class LlamaForCausalLM(CausalLM):
    """The causal LM: :class:`LlamaModel` plus a vocab-parallel LM head.

    Args: those of :class:`~worker.models.base.CausalLM`. ``quantization="int8"``:
    every decoder linear layer (qkv, o, gate_up, down) holds int8 weights and
    per-channel scales (``"int4"``: packed 4-bit codes with group-wise scales and offsets);
    the embedding, the LM head and the norms stay in ``dtype`` (docs/design/models.md,
    "Weight-only int8", "Weight-only int4").

    Raises:
        ValueError: ``hidden_act`` is not one of ``hidden_acts`` (Llama: ``"silu"``), or a bias key is not a boolean.
    """

    stacked_params_mapping = LLAMA_STACKED_PARAMS
    supports_pipeline = True
    #: The ``hidden_act`` values the family's MLP computes.
    hidden_acts: tuple[str, ...] = ("silu",)
    #: Whether the family rotates interleaved pairs (Cohere, Llama 4) rather than the halves of each head.
    interleaved_rope = False

    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
        quantization: Quantization | None = None,
    ) -> None:
        super().__init__()
        if config.hidden_act not in self.hidden_acts:
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported by {config.architecture}; "
                             f"expected {' or '.join(repr(a) for a in self.hidden_acts)}")
        self.config = config
        self.quantization = quantization
        # Pipeline stages: this stage's layer range; the first embeds, the last holds the norm and the LM head
        # (and, with tied embeddings, the embedding matrix the head shares).
        stage = ctx.pp
        self.layer_range = stage.layer_range(config.num_hidden_layers)
        self.has_head = stage.is_last
        self.has_embedding = stage.is_first or (stage.is_last and tie_word_embeddings)
        layers = [self.decoder_layer(config, ctx, dtype, quantization, i) for i in range(*self.layer_range)]
        self.model = self.build_model(config, ctx, dtype, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, dtype=dtype) if self.has_head else None
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings and self.has_head:
            self.lm_head.tie_to(self.model.embed_tokens)

    def build_model(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                    layers: list[nn.Module]) -> LlamaModel:
        """The decoder stack around ``layers`` (this stage's): where a family with RoPE per layer type
        (worker/models/olmo3.py) swaps in its own."""
        return LlamaModel(config, ctx, dtype, layers, embedding=self.has_embedding, head=self.has_head,
                          norm=self.final_norm(config, ctx, dtype) if self.has_head else None,
                          interleaved_rope=self.interleaved_rope)

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        """Llama: ``attention_bias`` on q/k/v and o_proj, ``mlp_bias`` on the MLP (both default False)."""
        attention_bias = config.hf_value("attention_bias", False)
        return Biases(qkv=attention_bias, o_proj=attention_bias, mlp=config.hf_value("mlp_bias", False))

    def final_norm(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> nn.Module:
        """The norm after the last layer: Llama's RMSNorm (``rms_norm_eps``); a related family swaps it."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        """Decoder layer ``layer_index``: where a related family swaps its attention or MLP."""
        biases = self.biases(config)
        attention = LlamaAttention(config, ctx, dtype, quantization, biases,
                                   sliding_window=config.layer_sliding_window(layer_index))
        return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization, bias=biases.mlp))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids, positions (T,) int64`` -> final hidden states ``(T, hidden_size)``.

        Writes this step's keys and values into ``kv_caches`` (one per layer of this stage);
        ``hidden_states``: the previous pipeline stage's output (worker/models/base.py).
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata, hidden_states)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden (N, hidden_size)`` of the rows that sample -> ``(N, vocab_size)`` on rank 0, else None.

        A collective: every rank must call it with the same ``N``.
        """
        return self.lm_head(hidden)  # (N, vocab_size) on rank 0


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with no bias at all (and, v0.1, a ``sliding_window`` on every layer)."""

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        return Biases()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with a bias on q/k/v (always) and none on o_proj or the MLP."""

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        return Biases(qkv=True)
