"""The contract between a model family and the rest of the worker, and its default weight mapping.

Every family's ``*ForCausalLM`` (worker/models/<family>.py) subclasses
:class:`CausalLM`. The loader (worker/loader.py) builds it with the constructor
below and asks it, for every checkpoint tensor, which parameter and which shard
of that parameter the tensor fills (:meth:`CausalLM.weight_map`); the
parameter's ``weight_loader`` then reads this rank's slice. The runner calls
``forward`` and ``compute_logits``.

Checkpoint names map to parameter names one to one, except the tensors a family
stacks into one fused parameter, declared in ``stacked_params_mapping`` as
``(parameter module, checkpoint module, shard_id)``: the Llama layout stacks
``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` (shards ``"q"``/``"k"``/``"v"``)
and ``gate_proj``/``up_proj`` into ``gate_up_proj`` (shards 0/1). A module name
matches one whole dotted component of the checkpoint name. A family with another
scheme (experts stacked along a new axis, say) overrides :meth:`CausalLM.weight_map`
and :meth:`CausalLM.checkpoint_name` instead.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.attention import AttentionMetadata

#: One layer's paged cache on this rank: ``(k_cache, v_cache)``, each
#: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
KVCache = tuple[torch.Tensor, torch.Tensor]
#: The shard of a parameter a checkpoint tensor fills (None: the whole parameter).
ShardId = str | int | None
#: The fused Llama layout: ``(parameter module, checkpoint module, shard_id)``.
LLAMA_STACKED_PARAMS: tuple[tuple[str, str, ShardId], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class CausalLM(nn.Module):
    """Base of every family's causal LM: the constructor, the step interface and the weight mapping.

    Subclasses take ``(config, ctx, dtype, *, tie_word_embeddings, quantization=None)``:

    * ``config``: the parsed config; family-specific keys come from
      ``config.hf_config`` through :meth:`ModelConfig.hf_value` (a bad value raises
      ``ValueError`` naming the key, before any weight is read);
    * ``ctx``: this rank's tensor-parallel group;
    * ``dtype``: parameter and activation dtype;
    * ``tie_word_embeddings``: the LM head shares the input embedding (decided by the
      loader: the config says so, or the checkpoint has no ``lm_head.weight``);
    * ``quantization``: None or ``"int8"`` (decoder linear layers only).

    Parameters are allocated uninitialised on ``ctx.device``; the loader fills them.
    """

    #: Checkpoint tensors stacked into one fused parameter (see the module docstring).
    stacked_params_mapping: tuple[tuple[str, str, ShardId], ...] = ()
    #: Checkpoint tensors that are not weights (recomputed buffers), by name suffix.
    skipped_weight_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """``input_ids, positions (T,) int64`` -> final hidden states ``(T, hidden_size)``.

        Writes this step's keys and values into ``kv_caches`` (one per layer).
        """
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden (N, hidden_size)`` of the rows that sample -> ``(N, vocab_size)`` on rank 0, else None.

        A collective: every rank must call it with the same ``N``.
        """
        raise NotImplementedError

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        """Where a checkpoint tensor goes: ``(parameter name, shard_id)``, or None to skip it.

        ``model.layers.0.self_attn.k_proj.weight`` -> ``("model.layers.0.self_attn.qkv_proj.weight", "k")``
        under the Llama layout. The loader refuses a name whose parameter does not exist.
        """
        if checkpoint_name.endswith(self.skipped_weight_suffixes):
            return None
        parts = checkpoint_name.split(".")
        for param_module, checkpoint_module, shard_id in self.stacked_params_mapping:
            if checkpoint_module in parts:
                parts[parts.index(checkpoint_module)] = param_module
                return ".".join(parts), shard_id
        return checkpoint_name, None

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        """Inverse of :meth:`weight_map`: the checkpoint tensor that fills ``param_name``'s ``shard_id``."""
        parts = param_name.split(".")
        for param_module, checkpoint_module, stacked_shard in self.stacked_params_mapping:
            if param_module in parts and stacked_shard == shard_id:
                parts[parts.index(param_module)] = checkpoint_module
                return ".".join(parts)
        return param_name
