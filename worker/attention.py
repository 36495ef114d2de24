"""Paged attention over a flat batch that mixes prefill chunks and decodes.

Data flow of one step (metadata built once by :meth:`AttentionMetadata.build`,
then passed to every layer as an argument):

1. the new tokens' keys and values are written into the paged KV cache at their
   slots (``slot = block_table[pos // block_size] * block_size + pos % block_size``);
2. the step's sequences are split into at most two *attention batches*: decodes
   (one query each) and prefill chunks (several queries). Splitting keeps a long
   prefill chunk from padding every decode to its length;
3. per attention batch, one ``scaled_dot_product_attention`` call: each
   sequence's keys/values are gathered from the cache through its block table
   (``k_cache[block_tables]``), its queries are gathered into a padded
   ``(num_seqs, max_query_len)`` grid, and a boolean mask keeps key position
   ``j`` for query position ``i`` iff ``j < context_len and j <= i`` (causal);
4. the padded grid is unpadded back to the flat ``(T, num_heads * head_dim)``.

No Python loop runs over sequences inside a layer; the loop over attention
batches has at most two iterations. Padded query rows still see key 0, so the
softmax never meets an all-masked row (no NaN); their output is discarded.

KV cache layout per layer and rank: ``k_cache, v_cache (num_blocks, block_size,
num_kv_heads, head_dim)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AttentionBatch:
    """Sequences attended in one SDPA call (all decodes, or all prefill chunks).

    Attributes:
        block_tables: ``(num_seqs, num_blocks) int64``, trimmed to the longest context.
        token_index: ``(num_seqs * max_query_len,) int64``: flat token that fills
            each padded query row (padding rows repeat the sequence's first token).
        output_rows: ``(num_tokens,) int64``: padded rows that hold real tokens.
        output_tokens: ``(num_tokens,) int64``: their index in the flat batch.
        attn_mask: ``(num_seqs, 1, max_query_len, max_kv_len) bool``, True = attend.
        num_seqs, max_query_len, max_kv_len: the padded grid's sizes.
    """

    block_tables: torch.Tensor
    token_index: torch.Tensor
    output_rows: torch.Tensor
    output_tokens: torch.Tensor
    attn_mask: torch.Tensor
    num_seqs: int
    max_query_len: int
    max_kv_len: int


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step, built once and shared by all layers.

    Attributes:
        positions: ``(T,) int64`` absolute position of each token of the flat batch.
        slot_mapping: ``(T,) int64`` cache slot of each token, ``block_id * block_size + offset``.
        block_tables: ``(S, max_blocks) int64``, padded with block 0 (masked out).
        context_lens: ``(S,) int64`` tokens in each sequence's context after this step.
        query_start_loc: ``(S + 1,) int64`` where each sequence's tokens start in the flat batch.
        batches: one or two :class:`AttentionBatch` (decodes, prefill chunks).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    batches: tuple[AttentionBatch, ...]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        start_positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Build a step's metadata from per-sequence Python lists (sequence order = flat batch order).

        Args:
            query_lens: tokens each sequence feeds this step (>= 1).
            start_positions: absolute position of each sequence's first fed token.
            block_tables: each sequence's KV block ids; block ``i`` holds positions
                ``[i * block_size, (i + 1) * block_size)``.
            block_size: tokens per KV block.
            device: where the tensors go.

        Raises:
            ValueError: a sequence has no tokens or too few blocks for its context.
        """
        num_seqs = len(query_lens)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)  # (S,)
        starts = torch.tensor(start_positions, dtype=torch.int64)  # (S,)
        context_lens = starts + q_lens  # (S,)
        num_blocks = -(-int(context_lens.max()) // block_size)
        for i, table in enumerate(block_tables):
            if query_lens[i] < 1 or len(table) * block_size < int(context_lens[i]):
                raise ValueError(
                    f"sequence {i}: {query_lens[i]} tokens from position {start_positions[i]} need "
                    f"{-(-int(context_lens[i]) // block_size)} blocks of {block_size}, table has {len(table)}"
                )
        padded = [list(t[:num_blocks]) + [0] * (num_blocks - min(len(t), num_blocks)) for t in block_tables]
        tables = torch.tensor(padded, dtype=torch.int64).view(num_seqs, num_blocks)  # (S, B)
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)  # (S + 1,)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)  # (T,)
        offsets = torch.arange(num_tokens) - query_start_loc[seq_of_token]  # (T,) index within the chunk
        positions = starts[seq_of_token] + offsets  # (T,)
        slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size  # (T,)

        is_decode = q_lens == 1  # (S,)
        groups = [torch.nonzero(mask).flatten() for mask in (is_decode, ~is_decode)]
        batches = tuple(
            _build_batch(idx, q_lens, starts, context_lens, query_start_loc, tables, block_size, device)
            for idx in groups
            if idx.numel()
        )
        return cls(
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            block_tables=tables.to(device),
            context_lens=context_lens.to(device),
            query_start_loc=query_start_loc.to(device),
            batches=batches,
        )


def _build_batch(
    idx: torch.Tensor,
    q_lens: torch.Tensor,
    starts: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> AttentionBatch:
    """The padded grid of the sequences ``idx`` (CPU index tensors in, device tensors out)."""
    max_query_len = int(q_lens[idx].max())
    max_kv_len = int(context_lens[idx].max())
    rows = torch.arange(max_query_len)  # (Q,)
    valid = rows[None, :] < q_lens[idx, None]  # (S_g, Q) real query rows
    first = query_start_loc[idx, None]  # (S_g, 1)
    token_index = torch.where(valid, first + rows[None, :], first).flatten()  # (S_g * Q,)
    output_rows = torch.nonzero(valid.flatten()).flatten()  # (T_g,)
    output_tokens = token_index[output_rows]  # (T_g,)
    # The mask is the one large tensor: compute it where it is used.
    query_pos = (starts[idx, None] + rows[None, :]).to(device)  # (S_g, Q)
    key_pos = torch.arange(max_kv_len, device=device)  # (K,)
    ctx_lens = context_lens[idx].to(device)  # (S_g,)
    attn_mask = (key_pos[None, None, :] < ctx_lens[:, None, None]) & (
        key_pos[None, None, :] <= query_pos[:, :, None]
    )  # (S_g, Q, K)
    return AttentionBatch(
        block_tables=tables[idx, : -(-max_kv_len // block_size)].to(device),
        token_index=token_index.to(device),
        output_rows=output_rows.to(device),
        output_tokens=output_tokens.to(device),
        attn_mask=attn_mask.unsqueeze(1),  # (S_g, 1, Q, K)
        num_seqs=int(idx.numel()),
        max_query_len=max_query_len,
        max_kv_len=max_kv_len,
    )


class PagedAttention(nn.Module):
    """Causal multi-head attention over the paged KV cache, for this rank's heads.

    Args:
        num_heads: query heads on this rank.
        num_kv_heads: key/value heads on this rank (``num_heads`` divisible by it; GQA).
        head_size: size of one head ``d``.
        scale: softmax scale, ``d ** -0.5`` for Llama.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale

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

        Writes ``k, v`` into ``k_cache, v_cache`` at ``attn_metadata.slot_mapping``.
        """
        num_tokens, kvh, d = k.shape
        slots = attn_metadata.slot_mapping  # (T,)
        k_cache.view(-1, kvh, d).index_copy_(0, slots, k)  # cache now holds this step's keys
        v_cache.view(-1, kvh, d).index_copy_(0, slots, v)
        out = q.new_empty(num_tokens, self.num_heads, d)  # (T, H, d)
        for batch in attn_metadata.batches:  # decodes, then prefill chunks: at most two
            s, qlen, kvlen = batch.num_seqs, batch.max_query_len, batch.max_kv_len
            qb = q[batch.token_index].view(s, qlen, self.num_heads, d).transpose(1, 2)  # (S_g, H, Q, d)
            kb = k_cache[batch.block_tables].view(s, -1, kvh, d)[:, :kvlen].transpose(1, 2)  # (S_g, KVH, K, d)
            vb = v_cache[batch.block_tables].view(s, -1, kvh, d)[:, :kvlen].transpose(1, 2)  # (S_g, KVH, K, d)
            ob = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=batch.attn_mask, scale=self.scale, enable_gqa=kvh != self.num_heads
            )  # (S_g, H, Q, d)
            ob = ob.transpose(1, 2).reshape(s * qlen, self.num_heads, d)  # (S_g * Q, H, d)
            out[batch.output_tokens] = ob[batch.output_rows]  # (T_g, H, d) back to flat order
        return out.view(num_tokens, self.num_heads * d)  # (T, H * d)
