"""gpt-oss (OpenAI 2025: gpt-oss-20b, gpt-oss-120b), float checkpoints, one tensor-parallel shard of it.

Reference: ``transformers``' ``modeling_gpt_oss.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)
    for each layer i (sliding_attention: a window of ``sliding_window`` (128) tokens; full_attention:
                      the whole context; ``layer_types`` alternates them, sliding first):
        h = h + o_proj(attention_sinks(rope(q), rope(k), v))      q/k/v/o with biases, YaRN RoPE
                 softmax_t over [scores_t, sinks[head]], the sink's column dropped   (worker/attention.py)
        h = h + moe(rms_norm(h))                                   every layer sparse, one all-reduce
                 logits = router(x) = x W^T + b                    (T, E), replicated
                 ids = top_k(logits); p = softmax(logits[ids])     over the k chosen only
                 moe(x) = sum_j p_j * (down_e(act(gate_up_e(x) + b_gu)) + b_down),  e = ids_j
                 act(gate, up) = (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)
    h = rms_norm(h); logits = lm_head(h)

``p`` is computed as the softmax over all experts renormalised over the top k, which is the
same number (``exp(l_i) / sum_{j in top k} exp(l_j)``) with the routing of the other
families (worker/layers/moe.py). The attention sinks (``self_attn.sinks``, one learned logit
per query head) take probability mass without a value; they are split across ranks with the
query heads and held in float32 (worker/attention.py, every path: the compiled CPU kernel,
the Triton kernel, the torch path, CUDA graphs through the Triton kernel). The experts'
clamped SwiGLU is worker/layers/clamped_swiglu.py; their stacked, interleaved checkpoint
layout worker/layers/moe_stacked.py.

Config keys read here (and checked in tpserve/model_config_rules.py): ``num_local_experts``,
``num_experts_per_tok``, ``intermediate_size`` (one expert's width), ``swiglu_alpha``,
``swiglu_limit``, ``attention_bias``; ``sliding_window``, ``layer_types`` and the YaRN
``rope_parameters`` are read by tpserve/model_config.py. An MXFP4 checkpoint
(``quantization_config.quant_method: "mxfp4"``, the experts as 4-bit blocks) loads its
experts dequantized to the model dtype (worker/dequantize.py, through the loader: this
file sees only float tensors).
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import PagedAttention
from worker.layers.clamped_swiglu import ClampedSwiGLU
from worker.layers.moe import SparseMoeBlock
from worker.layers.moe_stacked import StackedFusedMoE
from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.models.base import ShardId
from worker.models.llama import Biases, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from worker.parallel_state import ParallelContext

#: Checkpoint module name -> ours, where they differ (the router is SparseMoeBlock's ``gate``;
#: the sinks live in the attention module that reads them).
_RENAMED = (("self_attn.sinks", "self_attn.attn.sinks"), ("mlp.router.", "mlp.gate."))


class GptOssAttention(LlamaAttention):
    """Llama's attention (biases on q/k/v/o, the layer's window) with gpt-oss's attention sinks.

    The sinks parameter, ``(num_heads,)`` float32 (this rank's query heads), belongs to the
    :class:`PagedAttention` (``attn.sinks``) so that every attention path reads it.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, biases: Biases, *, sliding_window: int | None) -> None:
        super().__init__(config, ctx, dtype, quantization, biases, sliding_window=sliding_window)
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        sinks = new_parameter((self.num_heads,), torch.float32, ctx.device, self._load_sinks)
        sinks.shard_ids = (None,)  # type: ignore[attr-defined]
        d = config.head_dim
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5,
                                   sliding_window=sliding_window, sinks=sinks)

    def _load_sinks(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """This rank's heads' sinks ``[r * H_local, (r + 1) * H_local)`` of the ``(H,)`` checkpoint tensor."""
        local = self.num_heads
        check_shape(source, (local * self.tp_size,))
        copy_into(param.data, read_narrow(source, 0, self.tp_rank * local, local))


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss: every layer :class:`GptOssAttention` and a :class:`SparseMoeBlock` of biased, clamped experts.

    Args: those of :class:`~worker.models.base.CausalLM`.

    Raises:
        ValueError: ``--quantization`` (the stacked experts are float only), a bad MoE value (named).
    """

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        bias = config.hf_value("attention_bias", True)
        attention = GptOssAttention(config, ctx, dtype, quantization, Biases(qkv=bias, o_proj=bias),
                                    sliding_window=config.layer_sliding_window(layer_index))
        num_experts = config.hf_value("num_local_experts", 128, int)
        act = ClampedSwiGLU(config.hf_value("swiglu_alpha", 1.702, (int, float)),
                            config.hf_value("swiglu_limit", 7.0, (int, float)))
        experts = StackedFusedMoE(num_experts, config.hidden_size, config.intermediate_size, ctx, dtype=dtype,
                                  quantization=quantization, activation=act)
        moe = SparseMoeBlock(config.hidden_size, num_experts, config.hf_value("num_experts_per_tok", 4, int),
                             config.intermediate_size, ctx, dtype, renormalize=True, weights_in_dtype=True,
                             router_bias=True, experts=experts)
        return LlamaDecoderLayer(config, ctx, dtype, attention, moe)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        for theirs, ours in _RENAMED:
            checkpoint_name = checkpoint_name.replace(theirs, ours)
        return super().weight_map(checkpoint_name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        name = super().checkpoint_name(param_name, shard_id)
        for theirs, ours in _RENAMED:
            name = name.replace(ours, theirs)
        return name
