"""One attention-metadata builder per attention backend, chosen once per runner.

A step's flat batch is laid out by worker/step_inputs.py (decodes first, see
worker/attention.py); what the attention layers then need about it depends on the
backend that reads the decode group:

* :class:`PagedKernelMetadataBuilder`: the compiled CPU paged attention
  (worker/kernels/cpu_attention.cpp, float32 CPU ranks). Its group takes every chunk of
  up to ``MAX_PAGED_QUERY_LEN`` tokens (decodes, speculative verification, short
  prompts), one entry per chunk, read through the block tables with row offsets
  (``decode_query_start_loc``); no mask.
* :class:`TritonMetadataBuilder`: the Triton paged kernel (CUDA,
  worker/kernels/triton_attention.py): one row per entry, block tables and context
  lengths; no mask.
* :class:`SdpaMetadataBuilder`: torch's ``scaled_dot_product_attention`` over the
  gathered blocks, under a ``key position < context length`` mask built once per step.

In the last two a chunk with proposals (speculative decoding) joins the group as one
decode row per token: attention writes the step's K/V before it reads, so row ``j``
attends over ``0 .. start_position + j`` through the block table like any decode.
Every backend runs the longer chunks (prefills) through SDPA, one call per chunk,
with the chunk's history read through its block table under a causal mask with offset.

vLLM's attention backends have the same shape: a builder per backend turns the
common per-step description into that backend's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention import AttentionMetadata, PrefillChunk

#: Longest chunk the compiled paged attention takes with the decodes; longer prompt chunks go to
#: SDPA, whose blocked kernel wins once a chunk's queries share enough keys.
MAX_PAGED_QUERY_LEN = 16


@dataclass(frozen=True)
class DecodeGroup:
    """The first ``num_rows`` rows of the flat batch, as the backend reads them (device tensors).

    Attributes:
        num_rows: rows of the group.
        block_tables: ``(S, B) int64`` one entry's block table per row (per chunk for the
            paged kernel), padded with block 0 (masked out, or never read).
        context_lens: ``(S,) int64`` tokens each entry attends over.
        query_start_loc: ``(S + 1,) int64`` the entries' row offsets (paged kernel only), else None.
    """

    num_rows: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor | None


@dataclass(frozen=True)
class PrefillSpec:
    """A chunk outside the decode group: rows ``[start, end)``, first position, history table or None."""

    start: int
    end: int
    start_position: int
    block_table: torch.Tensor | None  # (blocks,) int64 on the device, covering the chunk's context


class AttentionMetadataBuilder:
    """Builds one backend's :class:`AttentionMetadata` from the step's common description.

    Attributes:
        max_group_query_len: the longest chunk (in tokens) the decode group takes whole.
        one_entry_per_chunk: the group's entries are chunks (several rows each) rather than rows.
        spec_rows_in_group: chunks with proposals join the group, one decode row per token.
        triton_decode: the group is read by the Triton kernel (``AttentionMetadata.triton_decode``).
    """

    max_group_query_len = 1
    one_entry_per_chunk = False
    spec_rows_in_group = True
    triton_decode = False

    def build(self, positions: torch.Tensor, slot_mapping: torch.Tensor, group: DecodeGroup | None,
              prefills: list[PrefillSpec], block_size: int, workspace: dict[str, torch.Tensor],
              rope_seq_lens: torch.Tensor | None) -> AttentionMetadata:
        """The metadata of one step (device tensors in, views kept).

        Args:
            positions: ``(T,) int64`` each row's position.
            slot_mapping: ``(T,) int64`` each row's KV slot.
            group: the decode group, None when empty.
            prefills: the other chunks, in row order.
            block_size: tokens per KV block.
            workspace: attention's scratch kept across steps.
            rope_seq_lens: ``(T,) int64`` for dynamic NTK RoPE, else None.
        """
        return AttentionMetadata(
            positions=positions, slot_mapping=slot_mapping, num_decodes=group.num_rows if group else 0,
            decode_block_tables=group.block_tables if group else None,
            decode_mask=self._decode_mask(group, block_size) if group else None,
            prefills=tuple(_prefill_chunk(p, positions.device) for p in prefills), workspace=workspace,
            decode_context_lens=group.context_lens if group else None,
            decode_query_start_loc=group.query_start_loc if group else None,
            triton_decode=self.triton_decode and group is not None,
            rope_seq_lens=rope_seq_lens,
        )

    def _decode_mask(self, group: DecodeGroup, block_size: int) -> torch.Tensor | None:
        return None


class SdpaMetadataBuilder(AttentionMetadataBuilder):
    """torch SDPA over gathered blocks: the group's mask ``key position < context length``."""

    def _decode_mask(self, group: DecodeGroup, block_size: int) -> torch.Tensor:
        key_pos = torch.arange(group.block_tables.shape[1] * block_size, device=group.context_lens.device)  # (K,)
        return (key_pos[None, :] < group.context_lens[:, None]).view(group.num_rows, 1, 1, -1)  # (D, 1, 1, K)


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """The Triton paged decode kernel: block tables and context lengths, one row per entry."""

    triton_decode = True


class PagedKernelMetadataBuilder(AttentionMetadataBuilder):
    """The compiled CPU paged kernel: chunks of up to 16 tokens, with their row offsets."""

    max_group_query_len = MAX_PAGED_QUERY_LEN
    one_entry_per_chunk = True
    spec_rows_in_group = False


def select_metadata_builder(*, paged_kernel: bool = False, triton_decode: bool = False) -> AttentionMetadataBuilder:
    """The builder of the backend a runner uses (the compiled kernel wins over Triton; SDPA otherwise)."""
    if paged_kernel:
        return PagedKernelMetadataBuilder()
    if triton_decode:
        return TritonMetadataBuilder()
    return SdpaMetadataBuilder()


def _prefill_chunk(spec: PrefillSpec, device: torch.device) -> PrefillChunk:
    """A prefill chunk's metadata: none for a prompt's first chunk, else its table and causal mask with offset."""
    num_rows = spec.end - spec.start
    if spec.block_table is None:
        return PrefillChunk(spec.start, spec.end, None, num_rows, None)
    context = spec.start_position + num_rows
    key_pos = torch.arange(context, device=device)  # (C,)
    query_pos = torch.arange(spec.start_position, context, device=device)  # (n,)
    mask = key_pos[None, :] <= query_pos[:, None]  # (n, C) causal with the chunk's offset
    return PrefillChunk(spec.start, spec.end, spec.block_table, context, mask)
