"""Paged attention over a flat batch that mixes decodes and prefill chunks.

The step's flat batch is ordered **decodes first**: rows ``0 .. num_decodes - 1``
are sequences that feed one token (decodes, or one-token prompts), the rows
after them are prefill chunks, each a contiguous run of rows. Per layer:

1. the new tokens' keys and values are written into the paged KV cache at their
   slots (``slot = block_table[pos // block_size] * block_size + pos % block_size``)
   by :func:`write_kv_cache`, or fused with RoPE (worker/layers/rotary.py's
   ``rotate_and_cache``); :class:`PagedAttention` then only reads the cache;
2. decodes: on a float32 CPU step with the compiled kernels (worker/kernels/),
   one ``paged_attention`` call reads each sequence's keys and values where they
   lie in the cache, through its block table, with no copy and no padding; there
   the group also holds chunks of up to 16 tokens (speculative verification,
   short prompts), each row causal over its own position. On CUDA, the Triton paged
   kernel (worker/kernels/triton_attention.py) likewise, one row per sequence.
   Elsewhere, one ``scaled_dot_product_attention`` call for all of them:
   their queries are the first rows of ``q`` as they lie (no gather); their keys
   and values are read through the block tables (``index_select`` of whole blocks
   into a reused buffer: one copy of each context, which is what a paged layout
   costs without a custom kernel), with a mask ``key position < context_len``
   built once per step;
3. prefill chunks: one call each. A chunk that starts a prompt attends over its
   own keys and values, which are already in registers' reach as ``k, v`` (causal,
   no cache read, no mask tensor); a later chunk of a long prompt reads its
   earlier positions through its block table under a causal mask with offset.

Why not one padded call for everything: a decode batch padded to the longest
prefill chunk does ``num_seqs x chunk_len x context`` work for one useful row per
decode, and a padded prefill grid wastes up to half of a mixed batch; the
per-chunk loop costs one SDPA call per prompt chunk per layer (a few per step).

KV cache layout per layer and rank: ``k_cache, v_cache (num_blocks, block_size,
num_kv_heads, head_dim)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels import cpu_kernels_available
from worker.kernels.triton_attention import paged_decode_attention

#: Head sizes the compiled paged kernel is instantiated for (worker/kernels/cpu_attention.cpp).
KERNEL_HEAD_SIZES = (32, 64, 80, 96, 128)


def paged_kernel_available(device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
    """Whether the compiled paged attention takes a step of ``dtype`` activations on ``device``."""
    return (device.type == "cpu" and dtype == torch.float32 and head_size in KERNEL_HEAD_SIZES
            and cpu_kernels_available())


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill chunk's rows and, for a continued prompt, where its history lies.

    Attributes:
        start, end: its rows ``[start, end)`` in the flat batch.
        block_table: ``(num_blocks,) int64`` on the device, covering positions
            ``0 .. context_len - 1``; None when the chunk starts at position 0
            (it attends only over its own keys and values).
        context_len: tokens attended over (``start_position + num_tokens``).
        mask: ``(num_tokens, context_len) bool``, True = attend (causal with the
            chunk's offset); None when ``block_table`` is None.
    """

    start: int
    end: int
    block_table: torch.Tensor | None
    context_len: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class AttentionMetadata:
    """What attention needs about one step, built once (worker/step_inputs.py) and shared by every layer.

    Attributes:
        positions: ``(T,) int64`` absolute position of each row of the flat batch.
        slot_mapping: ``(T,) int64`` cache slot of each row, ``block_id * block_size + offset``.
        num_decodes: the first ``num_decodes`` rows are the decode group: one-token
            sequences (and, with ``decode_query_start_loc``, short chunks).
        decode_block_tables: ``(S, max_blocks) int64`` for the group's ``S`` sequences,
            padded with block 0 (masked out, or never read); None when ``num_decodes == 0``.
        decode_mask: ``(num_decodes, 1, 1, max_blocks * block_size) bool``, True for
            key positions below the sequence's context length; None likewise.
        prefills: the prefill chunks, in row order.
        workspace: scratch tensors by name, kept by the caller from step to step
            (the gathered keys and values land there: a fresh multi-megabyte
            tensor per layer would page-fault on every step).
        decode_context_lens: ``(S,) int64`` tokens each sequence of the first group
            attends over (its last position + 1); None when ``num_decodes == 0``.
        decode_query_start_loc: ``(S + 1,) int64`` row offsets of the first group's
            sequences, when it is read by the compiled paged kernel and may hold
            chunks of several tokens (worker/step_inputs.py's ``paged_kernel``); None
            otherwise (one row per sequence, ``decode_mask`` set).
        triton_decode: the first group (one row per sequence) is read by the Triton
            paged kernel through ``decode_block_tables`` and ``decode_context_lens``
            (CUDA; worker/kernels/triton_attention.py); ``decode_mask`` is None.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillChunk, ...]
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)
    decode_context_lens: torch.Tensor | None = None
    decode_query_start_loc: torch.Tensor | None = None
    triton_decode: bool = False


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, workspace: dict[str, torch.Tensor],
                   name: str) -> torch.Tensor:
    """``cache[block_ids]`` for ``block_ids (n,)``: ``(n, block_size, kv_heads, d)``, in a reused buffer.

    ``index_select`` into a preallocated tensor copies whole blocks; advanced
    indexing (``cache[ids]``) runs an element-wise kernel several times slower.
    """
    numel = block_ids.numel() * cache[0].numel()
    buffer = workspace.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype or buffer.device != cache.device:
        buffer = workspace[name] = cache.new_empty(numel)
    out = buffer[:numel].view(block_ids.numel(), *cache.shape[1:])
    return torch.index_select(cache, 0, block_ids, out=out)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write ``k, v (T, num_kv_heads, d)`` into the caches at ``slot_mapping (T,) int64``, in place."""
    num_kv_heads, d = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, d).index_copy_(0, slot_mapping, v)


class PagedAttention(nn.Module):
    """Causal multi-head attention over the paged KV cache, for this rank's heads.

    Args:
        num_heads: query heads on this rank.
        num_kv_heads: key/value heads on this rank (``num_heads`` divisible by it; GQA,
            Ainslie et al. 2023, arXiv:2305.13245).
        head_size: size of one head ``d``.
        scale: softmax scale, ``d ** -0.5`` for Llama (Vaswani et al. 2017).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.enable_gqa = num_kv_heads != num_heads

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``q (T, num_heads, d)``, ``k, v (T, num_kv_heads, d)`` -> ``(T, num_heads * d)``.

        ``k, v`` must already be in ``k_cache, v_cache`` at ``attn_metadata.slot_mapping``
        (:func:`write_kv_cache`); a prompt's first chunk attends over ``k, v`` as given.
        """
        num_tokens, d = k.shape[0], k.shape[2]
        meta = attn_metadata
        num_decodes = meta.num_decodes
        decoded = None
        if num_decodes:
            decoded = self._decode(q[:num_decodes], k_cache, v_cache, meta)  # (D, H, d)
            if num_decodes == num_tokens:
                return decoded.reshape(num_tokens, self.num_heads * d)  # a pure decode step: no scatter
        out = q.new_empty(num_tokens, self.num_heads, d)  # (T, H, d)
        if decoded is not None:
            out[:num_decodes] = decoded
        for chunk in meta.prefills:
            out[chunk.start : chunk.end] = self._prefill(q, k, v, k_cache, v_cache, chunk)
        return out.view(num_tokens, self.num_heads * d)  # (T, H * d)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q (D, H, d)`` -> ``(D, H, d)``: the decode group's rows over their paged contexts."""
        num_seqs, kvh, d = q.shape[0], self.num_kv_heads, self.head_size
        if meta.decode_query_start_loc is not None:  # step_inputs checked the kernel takes this step
            return torch.ops.tpserve_cpu.paged_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_query_start_loc,
                meta.decode_context_lens, self.scale,
            )  # (D, H, d), read in place through the block tables
        if meta.triton_decode:
            return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                          self.scale)  # (D, H, d), likewise on the GPU
        block_ids = meta.decode_block_tables.view(-1)  # (D * B,)
        keys = _gather_blocks(k_cache, block_ids, meta.workspace, "keys")  # (D * B, bs, KVH, d)
        values = _gather_blocks(v_cache, block_ids, meta.workspace, "values")
        keys = keys.view(num_seqs, -1, kvh, d).transpose(1, 2)  # (D, KVH, B * bs, d)
        values = values.view(num_seqs, -1, kvh, d).transpose(1, 2)  # (D, KVH, B * bs, d)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=self.enable_gqa
        )  # (D, H, 1, d)
        return o.squeeze(2)  # (D, H, d)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        """One chunk's rows of ``q (T, H, d)`` -> ``(n, H, d)``."""
        kvh, d = self.num_kv_heads, self.head_size
        qs = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # (1, H, n, d)
        if chunk.block_table is None:  # a prompt's first chunk: its own keys, causal
            ks = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # (1, KVH, n, d)
            vs = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale,
                                               enable_gqa=self.enable_gqa)  # (1, H, n, d)
        else:  # a later chunk: the history through the block table, causal with offset
            ks = k_cache.index_select(0, chunk.block_table).view(-1, kvh, d)[: chunk.context_len]  # (C, KVH, d)
            vs = v_cache.index_select(0, chunk.block_table).view(-1, kvh, d)[: chunk.context_len]
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)  # (1, KVH, C, d)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=chunk.mask, scale=self.scale,
                                               enable_gqa=self.enable_gqa)  # (1, H, n, d)
        return o[0].transpose(0, 1)  # (n, H, d)
