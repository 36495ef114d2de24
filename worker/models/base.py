"""The contract between a model family and the rest of the worker, and its default weight mapping.

Every family's ``*ForCausalLM`` (worker/models/<family>.py) subclasses
:class:`CausalLM`. The loader (worker/loader.py) builds it with the constructor
below and asks it, for every checkpoint tensor, which parameter and which shard
of that parameter the tensor fills (:meth:`CausalLM.weight_map`); the
parameter's ``weight_loader`` then reads this rank's slice. The runner calls
``forward`` and ``compute_logits``.

Hybrid families (docs/design/models.md, "Hybrid models") also say which decoder layers keep a
per-sequence state instead of a KV cache: :meth:`CausalLM.state_layers` maps each such layer's
index to its :class:`~worker.state_metadata.StateLayer`, whose ``state_shapes()`` and
``state_dtypes()`` size the runner's state pool (worker/state_cache.py). The runner then passes,
in ``forward``'s ``kv_caches`` list at that layer's index, the layer's state tuple (each tensor
``(num_state_slots, *per_slot_shape)``) where an attention layer gets its ``(k_cache, v_cache)``,
and ``attn_metadata.state`` (a :class:`~worker.state_metadata.StateMetadata`) for the step.
Attention-only families inherit an empty map: nothing changes for them (``attn_metadata.state``
stays None).

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
      loader: what the config says, or the family's default; an untied model needs ``lm_head.weight``);
    * ``quantization``: None, ``"int8"`` or ``"int4"`` (decoder linear layers only).

    Parameters are allocated uninitialised on ``ctx.device``; the loader fills them.
    """

    #: Checkpoint tensors stacked into one fused parameter (see the module docstring).
    stacked_params_mapping: tuple[tuple[str, str, ShardId], ...] = ()
    #: Checkpoint tensors that are not weights (recomputed buffers), by name suffix.
    skipped_weight_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    #: Pipeline stages (worker/pipeline.py): whether the family builds a layer range only. A family
    #: that does sets the four attributes below in its constructor; the others refuse P > 1.
    supports_pipeline: bool = False
    #: Checkpoint name prefixes: the decoder layers (``<prefix><index>.``), the embedding, and
    #: what the last stage holds after the layers (final norm, LM head).
    layers_prefix: str = "model.layers."
    embedding_prefixes: tuple[str, ...] = ("model.embed_tokens.",)
    head_prefixes: tuple[str, ...] = ("model.norm.", "lm_head.")
    #: This rank's decoder layers: global indices ``[start, end)``; the stage's modules hold them as
    #: local indices ``0 .. end - start - 1``. Whether it holds the embedding and the head.
    layer_range: tuple[int, int] = (0, 0)
    has_embedding: bool = True
    has_head: bool = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids, positions (T,) int64`` -> final hidden states ``(T, hidden_size)``.

        Writes this step's keys and values into ``kv_caches`` (one per layer of this stage: a
        ``(k_cache, v_cache)`` pair, or a state layer's state tuple, see the module docstring).
        With pipeline stages: ``hidden_states (T, hidden_size)`` is the previous stage's
        output (None on the first stage, which embeds ``input_ids``), and a stage before
        the last returns its last layer's output, before the final norm.
        """
        raise NotImplementedError

    def state_layers(self) -> dict[int, nn.Module]:
        """The decoder layers with a per-sequence state: ``{layer index: its StateLayer module}``.

        The default finds them in ``self.model.layers``: a layer that has ``state_shapes``
        (worker/state_metadata.py's :class:`~worker.state_metadata.StateLayer` protocol), or its first
        direct child that has. Empty for attention-only families (the runner then builds no state
        pool and no :class:`~worker.state_metadata.StateMetadata`). Indices are this stage's
        (hybrids serve one pipeline stage). Called once, at start-up.
        """
        layers = getattr(getattr(self, "model", None), "layers", None)
        found: dict[int, nn.Module] = {}
        for index, layer in enumerate(layers if layers is not None else ()):
            candidates = [layer, *layer.children()]
            owner = next((m for m in candidates if hasattr(m, "state_shapes")), None)
            if owner is not None:
                found[index] = owner
        return found

    def stage_checkpoint_name(self, checkpoint_name: str) -> str | None:
        """A checkpoint tensor's name as this stage's modules number it, or None: not on this stage.

        ``model.layers.7.mlp.down_proj.weight`` on a stage holding layers ``[6, 12)`` is
        ``model.layers.1.mlp.down_proj.weight``; on any other stage None. The embedding
        is kept where ``has_embedding``, the final norm and LM head where ``has_head``;
        every other name is returned as it is (one stage: every name, unchanged).
        """
        if not self.supports_pipeline:
            return checkpoint_name
        if checkpoint_name.startswith(self.layers_prefix):
            index, _, rest = checkpoint_name[len(self.layers_prefix):].partition(".")
            start, end = self.layer_range
            if not index.isdigit() or not start <= int(index) < end:
                return None
            return f"{self.layers_prefix}{int(index) - start}.{rest}"
        if checkpoint_name.startswith(self.embedding_prefixes):
            return checkpoint_name if self.has_embedding else None
        if checkpoint_name.startswith(self.head_prefixes):
            return checkpoint_name if self.has_head else None
        return checkpoint_name

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
