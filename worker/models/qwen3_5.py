"""Qwen3.5 (dense) and Qwen3.5-MoE text models: Qwen3-Next's hybrid decoder with Qwen3.5's DeltaNet projections.

Reference: ``transformers``' ``modeling_qwen3_5.py`` (``Qwen3_5ForCausalLM``) and ``modeling_qwen3_5_moe.py``
(``Qwen3_5MoeForCausalLM``). The maths is Qwen3-Next's (worker/models/qwen3_next.py): Gated DeltaNet and
gated full attention by ``layer_types``, zero-centred RMSNorms, partial RoPE. Two differences:

* the DeltaNet input projections are stored apart, ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
  ``in_proj_a`` (:class:`~worker.layers.gated_delta_net.SeparateProjectionGatedDeltaNet`), not grouped by key head;
* the MLP: the dense model's is ``down(silu(gate(x)) * up(x))`` on every layer; the MoE model's is the
  shared-expert MoE block on every layer, its top-k probabilities always renormalised (``Qwen3VLMoe``'s router).

Text positions only: the multimodal RoPE of the reference rotates every section by the same text position,
which is the plain (partial) RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.layers.gated_delta_net import GatedDeltaNet, SeparateProjectionGatedDeltaNet
from worker.models.llama import LlamaMLP
from worker.models.qwen3_next import Qwen3NextForCausalLM
from worker.parallel_state import ParallelContext


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 dense: Qwen3-Next's layers with separate DeltaNet projections and a dense MLP everywhere."""

    delta_net_class: type[GatedDeltaNet] = SeparateProjectionGatedDeltaNet

    def mlp(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, quantization: Quantization | None,
            layer_index: int) -> nn.Module:
        return LlamaMLP(config, ctx, dtype, quantization)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: Qwen3.5's layers with the shared-expert MoE block (renormalised top-k) on every layer."""

    def mlp(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, quantization: Quantization | None,
            layer_index: int) -> nn.Module:
        return self.moe(config, ctx, dtype, quantization, renormalize=True)
