"""Phi-3: the Llama decoder, stored with its projections fused in the checkpoint.

Reference: ``transformers``' ``modeling_phi3.py``. The maths is Llama's (RMSNorm, RoPE,
SwiGLU ``down(up * silu(gate))``, GQA, no bias anywhere); the checkpoint holds
``self_attn.qkv_proj.weight`` (q's rows, then k's, then v's) and ``mlp.gate_up_proj.weight``
(gate's rows, then up's) already fused, under the names of tpserve's own fused parameters.
So nothing is stacked: every tensor maps to the parameter of its name with ``shard_id=None``,
which the fused layers split into their parts, each rank reading only its rows.

A ``sliding_window`` shorter than the context (Phi-3-mini-4k's 2047) applies to every layer,
as ``transformers``' Phi-3 masks it. Refused by the shared config (tpserve/model_config.py):
``longrope`` RoPE scaling (the 128k variants, Phi-3.5), ``partial_rotary_factor`` below 1
(Phi-4-mini).
"""

from __future__ import annotations

from tpserve.model_config import ModelConfig
from worker.models.llama import Biases, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """The Phi-3 causal LM (``Phi3ForCausalLM``); constructor and errors as :class:`LlamaForCausalLM`."""

    stacked_params_mapping = ()  # qkv_proj and gate_up_proj are fused in the checkpoint already

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        return Biases()
