"""Sizing and allocating one rank's paged KV cache.

Per layer two tensors, each ``(num_blocks, block_size, heads, width)``, whose shapes are the
model's cache spec (:meth:`tpserve.model_config.ModelConfig.kv_cache_spec`):

* per-head (grouped-query attention): ``k_cache`` and ``v_cache``, ``heads`` this rank's KV
  heads (one replicated head when ``tensor_parallel_size > total_num_kv_heads``), ``width = head_dim``;
* latent (multi-head latent attention, worker/layers/mla.py): the compressed latent
  ``(.., 1, kv_lora_rank)`` and the shared RoPE key ``(.., 1, qk_rope_head_dim)``, the same
  on every rank (not split by heads).

The same block id means the same token positions on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.model_config import KVCacheSpec, ModelConfig
from worker.kv_quant import QMAX, SCALE_DTYPE


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape of one rank's cache.

    Attributes:
        num_layers: decoder layers with a KV cache (two cache tensors each): every layer but a hybrid
            model's state layers, whose states are worker/state_cache.py's.
        block_size: tokens per block.
        spec: per token and layer, the two tensors' ``(heads, width)`` (:class:`KVCacheSpec`).
        dtype: element dtype as stored: the activations' dtype, or ``int8`` / ``float8_e4m3fn``
            with ``--kv-cache-dtype int8|fp8`` (1 byte per element plus a 2-byte scale per token
            and head: ``2d / (d + 2)`` times the blocks of a 16-bit cache in the same memory,
            1.94x at d = 64; worker/kv_quant.py; a latent cache's one "head" per tensor: a scale for
            the latent and one for the rotated key, worker/layers/mla_attention.py).
    """

    num_layers: int
    block_size: int
    spec: KVCacheSpec
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, tp: int, block_size: int, dtype: torch.dtype) -> KVCacheLayout:
        """The layout of a rank of a ``tp``-way group serving ``config``."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        return cls(config.num_attention_layers, block_size, config.kv_cache_spec(tp), dtype)  # a hybrid's state layers: none

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes on this rank: both tensors, all layers, and an 8-bit cache's scales."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_token = self.spec.elements_per_token * element_size
        if self.quantized:  # one scale per (token, KV head) of K and of V
            per_token += (self.spec.first[0] + self.spec.second[0]) * torch.empty((), dtype=SCALE_DTYPE).element_size()
        return self.num_layers * self.block_size * per_token

    @property
    def quantized(self) -> bool:
        """Whether the cache holds 8-bit codes with per-token scales (worker/kv_quant.py)."""
        return self.dtype in QMAX

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """How many blocks fit in ``budget_bytes`` of memory (rounded down, >= 0)."""
        return max(0, budget_bytes // self.bytes_per_block)

    def allocate(self, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed cache tensors per layer, each ``(num_blocks, block_size, heads, width)`` of the spec.

        Raises:
            ValueError: ``num_blocks < 1``.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        first = (num_blocks, self.block_size, *self.spec.first)
        second = (num_blocks, self.block_size, *self.spec.second)
        # Zeroed, not empty: padded block-table entries point at block 0, and
        # masked-out garbage must not be NaN/inf (0 * inf would poison the output).
        return [
            (torch.zeros(first, dtype=self.dtype, device=device), torch.zeros(second, dtype=self.dtype, device=device))
            for _ in range(self.num_layers)
        ]

    def allocate_scales(self, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """An 8-bit cache's zeroed ``(k_scale, v_scale)`` per layer, each ``(num_blocks, KVH, block_size)``
        bfloat16: a KV head's scales of a block contiguous, so that a kernel widens them 8 at a time (a zero
        scale reads a never-written slot as 0, never NaN).

        Raises:
            ValueError: a cache that is not 8-bit, or ``num_blocks < 1``.
        """
        if not self.quantized or num_blocks < 1:
            raise ValueError(f"scales are for an 8-bit cache of >= 1 blocks, not {self.dtype} x {num_blocks}")
        shape = (num_blocks, self.spec.first[0], self.block_size)
        return [(torch.zeros(shape, dtype=SCALE_DTYPE, device=device),
                 torch.zeros(shape, dtype=SCALE_DTYPE, device=device)) for _ in range(self.num_layers)]


@dataclass(frozen=True)
class PairedKVCacheLayout:
    """A target's and its draft model's caches, indexed by the same block ids: sized as one.

    Attributes:
        target, draft: the two layouts (the same ``block_size``).
    """

    target: KVCacheLayout
    draft: KVCacheLayout

    @property
    def block_size(self) -> int:
        return self.target.block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id takes on this rank: the target's block and the draft's."""
        return self.target.bytes_per_block + self.draft.bytes_per_block

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """How many block ids fit in ``budget_bytes`` (rounded down, >= 0)."""
        return max(0, budget_bytes // self.bytes_per_block)
