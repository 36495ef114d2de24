"""Sizing and allocating one rank's paged KV cache.

Per layer: ``k_cache`` and ``v_cache`` of shape ``(num_blocks, block_size,
num_kv_heads, head_dim)``, ``num_kv_heads`` being this rank's share (one
replicated head when ``tensor_parallel_size > total_num_kv_heads``). The same
block id means the same token positions on every rank; each rank stores its heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.model_config import ModelConfig


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape of one rank's cache.

    Attributes:
        num_layers: decoder layers (one K and one V tensor each).
        block_size: tokens per block.
        num_kv_heads: key/value heads on this rank.
        head_dim: size of one head.
        dtype: element dtype as stored: the activations' dtype, or ``int8`` / ``float8_e4m3fn``
            with ``--kv-cache-dtype int8|fp8`` (1 byte per element: twice the blocks of a 16-bit
            cache in the same memory; worker/kv_quant.py).
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, tp: int, block_size: int, dtype: torch.dtype) -> KVCacheLayout:
        """The layout of a rank of a ``tp``-way group serving ``config``."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        return cls(config.num_hidden_layers, block_size, config.num_kv_heads_per_rank(tp), config.head_dim, dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes on this rank: K and V, all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """How many blocks fit in ``budget_bytes`` of memory (rounded down, >= 0)."""
        return max(0, budget_bytes // self.bytes_per_block)

    def allocate(self, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed ``(k_cache, v_cache)`` per layer, each ``(num_blocks, block_size, num_kv_heads, head_dim)``.

        Raises:
            ValueError: ``num_blocks < 1``.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # Zeroed, not empty: padded block-table entries point at block 0, and
        # masked-out garbage must not be NaN/inf (0 * inf would poison the output).
        return [
            (torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device))
            for _ in range(self.num_layers)
        ]


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
