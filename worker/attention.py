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

Per layer, two options change what a row attends over (both are the layer's, set
at construction, so one step's metadata serves every layer):

* ``sliding_window = W``: a query at position ``p`` attends only keys at positions
  ``> p - W`` (its own and the ``W - 1`` before it; Hugging Face's ``sliding_window``,
  ``masking_utils.sliding_window_overlay``, as Mistral, Qwen2 and Gemma 2/3 use it).
  The compiled and Triton kernels skip the blocks before the window; a later prefill
  chunk reads its history from the first block its window touches; the SDPA decode
  group still gathers the whole table (one copy, as before) and masks it.
* ``attention_chunk_size = C`` (Llama 4's chunked local attention): a query at position ``p``
  attends only keys of its own chunk, positions ``p - p % C .. p`` (``transformers``'
  ``masking_utils.chunked_overlay``). Prefill chunks take it as a mask (and skip the blocks
  before the first row's chunk); the decode group takes it in every mode (the compiled CPU
  kernel's, Triton's and SDPA's steps alike, CUDA graphs included) through
  :meth:`PagedAttention._chunked_decode`: on Triton's steps each row becomes a "virtual"
  sequence (its table shifted to its chunk's first block, its context the chunk so far;
  vLLM's ``make_local_attention_virtual_batches``) for the unchanged kernel; elsewhere SDPA
  over the at most ``ceil((C - 1) / block_size) + 1`` blocks a row's chunk can span, gathered
  by a fixed-shape index (no host sync).
* ``logit_softcap = c``: scores become ``c * tanh(score / c)`` before the mask and
  softmax (Gemma 2's ``attn_logit_softcapping``). SDPA cannot do that, so there the
  torch path spells the attention out (:func:`_explicit_attention`); the kernels
  take it as an argument.
* ``sinks``: one learned logit per query head that joins every softmax's denominator
  and has no value (gpt-oss's attention sinks; ``transformers``' ``modeling_gpt_oss.py``):
  ``out = sum_t exp(s_t) v_t / (exp(sink) + sum_t exp(s_t))``. It takes probability mass
  from the keys, so a head may attend to "nothing". SDPA cannot add it either (it returns
  no log-sum-exp), so the torch path spells the attention out with the sink as one more
  column of the logits (:func:`_explicit_attention`); the compiled and Triton kernels take
  the ``(H,)`` float32 tensor. The sinks are a parameter of this module (``attn.sinks``),
  this rank's heads' slice, so every path reads the same values.

With an 8-bit cache (``--kv-cache-dtype fp8|int8``, worker/kv_quant.py) the caches hold codes
and each layer's ``k_scale``, ``v_scale``: :func:`write_kv_cache` quantizes, the compiled and
Triton kernels convert in registers (the scales folded into the query and the output), the
torch path dequantizes the blocks it gathers, and a prompt's first chunk attends over its own
keys and values rounded as the cache holds them, so that every path, and a prefix-cache hit
against a miss, reads the same values.

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
from worker.kv_quant import dequantize, is_quantized, quantize
from worker.kernels.triton_attention import paged_decode_attention
from worker.state_metadata import StateMetadata

#: Head sizes the compiled paged kernel is instantiated for (worker/kernels/cpu_attention.cpp).
KERNEL_HEAD_SIZES = (16, 32, 64, 80, 96, 128)


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
        rope_seq_lens: ``(T,) int64`` the sequence length each row's dynamic NTK RoPE is
            computed for, ``max(prompt length, position + 1)``; None unless the model uses it.
        window_masks: the step's sliding-window masks by window, built on first use
            (:meth:`decode_window_mask`).
        state: hybrid models: what the state layers need about the step (slots, row offsets,
            checkpoints: worker/state_metadata.py); None for attention-only models.
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
    rope_seq_lens: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    state: StateMetadata | None = None

    def decode_window_mask(self, window: int) -> torch.Tensor:
        """``decode_mask`` restricted to each row's last ``window`` positions, built once per step and window.

        ``(num_decodes, 1, 1, max_blocks * block_size) bool``, True where
        ``context_len - window <= key position < context_len``.
        """
        mask = self.window_masks.get(window)
        if mask is None:
            key_pos = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)  # (K,)
            first = (self.decode_context_lens - window).view(-1, 1, 1, 1)  # (D, 1, 1, 1) first position attended
            mask = self.window_masks[window] = self.decode_mask & (key_pos >= first)
        return mask


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
                   slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write ``k, v (T, num_kv_heads, d)`` into the caches at ``slot_mapping (T,) int64``, in place.

    An 8-bit cache stores ``quantize(k / k_scale)``, ``quantize(v / v_scale)`` with ``kv_scales``
    (the layer's :attr:`PagedAttention.kv_scales`; worker/kv_quant.py).

    Raises:
        ValueError: an 8-bit cache without ``kv_scales``.
    """
    num_kv_heads, d = k.shape[1], k.shape[2]
    if is_quantized(k_cache):
        if kv_scales is None:
            raise ValueError(f"a {k_cache.dtype} KV cache needs the layer's kv_scales to be written")
        k, v = quantize(k, kv_scales[0], k_cache.dtype), quantize(v, kv_scales[1], v_cache.dtype)
        # As bytes: index_copy_ has no float8 kernel (the copy moves bytes either way).
        k, v, k_cache, v_cache = k.view(torch.uint8), v.view(torch.uint8), k_cache.view(torch.uint8), \
            v_cache.view(torch.uint8)
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
        sliding_window: None, or ``W >= 1``: each query attends only the keys at its own and
            the ``W - 1`` previous positions (see the module docstring).
        logit_softcap: None, or ``c > 0``: scores soft-capped to ``c * tanh(score / c)``.
        sinks: None, or a ``(num_heads,)`` float32 parameter, this rank's heads' attention-sink
            logits (filled by the loader; see the module docstring); it becomes ``self.sinks``.
        attention_chunk_size: None, or ``C >= 1``: each query attends only the keys of its own
            ``C``-token chunk (see the module docstring); not with ``sliding_window``.

    Raises:
        ValueError: ``sliding_window < 1``, ``logit_softcap <= 0``, ``sinks`` not ``(num_heads,)`` float32,
            ``attention_chunk_size < 1``, or both a window and a chunk size.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, *,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 sinks: nn.Parameter | None = None, attention_chunk_size: int | None = None) -> None:
        super().__init__()
        if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32):
            raise ValueError(f"sinks {tuple(sinks.shape)} {sinks.dtype} must be ({num_heads},) float32, "
                             "one logit per query head")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1 (or None: no window)")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap={logit_softcap} must be > 0 (or None: no soft-capping)")
        if attention_chunk_size is not None and (attention_chunk_size < 1 or sliding_window is not None):
            raise ValueError(f"attention_chunk_size={attention_chunk_size} must be >= 1 and without a sliding_window")
        self.attention_chunk_size = attention_chunk_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.sinks = sinks
        self.enable_gqa = num_kv_heads != num_heads
        # An 8-bit cache's scales, (KVH, d) float32 each (worker/kv_quant.py; None with a float cache), and
        # the calibration's running maxima of |k|, |v| per head and channel while it runs (None otherwise).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_absmax: list[torch.Tensor] | None = None

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Set an 8-bit cache's scales, ``(num_kv_heads, head_size)`` float32 each, on the cache's device;
        every path reads them (and a CUDA graph captures their addresses: set them before capturing).

        Raises:
            ValueError: a scale of another shape, or not positive and finite.
        """
        shape = (self.num_kv_heads, self.head_size)
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(t.shape) != shape or not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise ValueError(f"{name} {tuple(t.shape)} must be {shape}, positive and finite")
        self.k_scale, self.v_scale = (t.to(torch.float32).contiguous() for t in (k_scale, v_scale))
        self.kv_scales = (self.k_scale, self.v_scale)

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
        if self.kv_absmax is not None:  # start-up calibration of an 8-bit cache's scales (worker/kv_quant.py)
            self.kv_absmax = [torch.maximum(m, x.abs().amax(0).float())
                              for m, x in zip(self.kv_absmax, (k, v))]  # (KVH, d) each
        num_decodes = meta.num_decodes
        decoded = None
        if num_decodes == num_tokens and num_decodes:  # a pure decode step: every row, no slice, no scatter
            return self._decode(q, k_cache, v_cache, meta).reshape(num_tokens, self.num_heads * d)  # (T, H * d)
        if num_decodes:
            decoded = self._decode(q[:num_decodes], k_cache, v_cache, meta)  # (D, H, d)
        out = q.new_empty(num_tokens, self.num_heads, d)  # (T, H, d)
        if decoded is not None:
            out[:num_decodes] = decoded
        for chunk in meta.prefills:
            out[chunk.start : chunk.end] = self._prefill(q, k, v, k_cache, v_cache, chunk)
        return out.view(num_tokens, self.num_heads * d)  # (T, H * d)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q (D, H, d)`` -> ``(D, H, d)``: the decode group's rows over their paged contexts."""
        if self.attention_chunk_size is not None:
            return self._chunked_decode(q, k_cache, v_cache, meta)  # (D, H, d), whatever the step's mode
        num_seqs, kvh, d = q.shape[0], self.num_kv_heads, self.head_size
        window, softcap = self.sliding_window or 0, self.logit_softcap or 0.0  # the kernels' "none" is 0
        if meta.decode_query_start_loc is not None:  # step_inputs checked the kernel takes this step
            return torch.ops.tpserve_cpu.paged_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_query_start_loc,
                meta.decode_context_lens, self.scale, window, softcap, self.sinks, self.k_scale, self.v_scale,
            )  # (D, H, d), read in place through the block tables (8-bit codes converted in registers)
        if meta.triton_decode:
            return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                          self.scale, sliding_window=window,
                                          logit_softcap=softcap, sinks=self.sinks,
                                          kv_scales=self.kv_scales)  # (D, H, d), likewise on the GPU
        block_ids = meta.decode_block_tables.view(-1)  # (D * B,)
        keys = _gather_blocks(k_cache, block_ids, meta.workspace, "keys")  # (D * B, bs, KVH, d)
        values = _gather_blocks(v_cache, block_ids, meta.workspace, "values")
        if is_quantized(k_cache):  # the gathered copy of 8-bit codes, converted (the cache stays 8-bit)
            keys, values = dequantize(keys, self.k_scale, q.dtype), dequantize(values, self.v_scale, q.dtype)
        keys = keys.view(num_seqs, -1, kvh, d).transpose(1, 2)  # (D, KVH, B * bs, d)
        values = values.view(num_seqs, -1, kvh, d).transpose(1, 2)  # (D, KVH, B * bs, d)
        mask = meta.decode_mask if self.sliding_window is None else meta.decode_window_mask(self.sliding_window)
        o = self._attention(q.unsqueeze(2), keys, values, mask)  # (D, H, 1, d)
        return o.squeeze(2)  # (D, H, d)

    def _chunked_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        """``q (D, H, d)`` -> ``(D, H, d)``: each decode-group row over its own chunk's keys, ``p - p % C .. p``.

        Serves every decode mode: one row per sequence (SDPA, Triton) or several
        (the compiled CPU kernel's groups, ``decode_query_start_loc``). On the Triton
        kernel's steps (CUDA graphs included) with chunks a whole number of blocks, each
        row goes to the kernel as a virtual sequence: its table shifted to its chunk's first
        block, its context ``p % C + 1``. Otherwise, per row, the ``span`` blocks from the one
        holding its chunk's first position are gathered (indices past the table clamped;
        their positions lie past the row's and are masked) for SDPA. Every shape is fixed by
        the step's sizes: no host sync, graph-safe.
        """
        rows, kvh, d = q.shape[0], self.num_kv_heads, self.head_size
        chunk, block_size = self.attention_chunk_size, k_cache.shape[1]
        assert chunk is not None and meta.decode_block_tables is not None
        positions = meta.positions[:rows]  # (D,) int64
        tables = meta.decode_block_tables  # (S, B)
        if meta.triton_decode and chunk % block_size == 0:
            # Chunks start on block edges: each row is a "virtual" sequence whose table starts at its chunk's
            # first block and whose context is its chunk so far; the Triton kernel reads only those blocks.
            width = tables.shape[1]
            first_block = (positions - positions % chunk) // block_size  # (D,)
            index = (first_block[:, None] + torch.arange(width, device=q.device)).clamp(max=width - 1)  # (D, B)
            return paged_decode_attention(q, k_cache, v_cache, tables.gather(1, index), positions % chunk + 1,
                                          self.scale, logit_softcap=self.logit_softcap or 0.0,
                                          sinks=self.sinks)  # (D, H, d)
        if meta.decode_query_start_loc is not None:  # a sequence may own several consecutive rows
            rows_index = torch.arange(rows, device=q.device)
            seq = torch.searchsorted(meta.decode_query_start_loc[1:], rows_index, right=True)  # (D,)
            tables = tables.index_select(0, seq)  # (D, B)
        span = min((chunk + block_size - 2) // block_size + 1, tables.shape[1])  # blocks one chunk can touch
        first_key = positions - positions % chunk  # (D,) the row's chunk start
        first_block = first_key // block_size  # (D,)
        index = (first_block[:, None] + torch.arange(span, device=q.device)).clamp(max=tables.shape[1] - 1)
        block_ids = tables.gather(1, index).reshape(-1)  # (D * span,)
        keys = _gather_blocks(k_cache, block_ids, meta.workspace, "keys")  # (D * span, bs, KVH, d)
        values = _gather_blocks(v_cache, block_ids, meta.workspace, "values")
        keys = keys.view(rows, -1, kvh, d).transpose(1, 2)  # (D, KVH, span * bs, d)
        values = values.view(rows, -1, kvh, d).transpose(1, 2)
        key_pos = first_block[:, None] * block_size + torch.arange(span * block_size, device=q.device)  # (D, K)
        mask = (key_pos >= first_key[:, None]) & (key_pos <= positions[:, None])  # (D, K), the row itself included
        o = self._attention(q.unsqueeze(2), keys, values, mask[:, None, None, :])  # (D, H, 1, d)
        return o.squeeze(2)  # (D, H, d)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``q (B, H, n, d)`` over ``k, v (B, KVH, C, d)`` under ``mask`` (broadcast to ``(B, H, n, C)``,
        True = attend; None: causal, ``n == C``) -> ``(B, H, n, d)``."""
        if self.logit_softcap is not None or self.sinks is not None:
            if mask is None:
                mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()  # (n, C)
            return _explicit_attention(q, k, v, mask, self.scale, self.logit_softcap, self.sinks)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                              enable_gqa=self.enable_gqa)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        """One chunk's rows of ``q (T, H, d)`` -> ``(n, H, d)``."""
        kvh, d, window, local = self.num_kv_heads, self.head_size, self.sliding_window, self.attention_chunk_size
        n = chunk.end - chunk.start
        first_pos = chunk.context_len - n  # the chunk's first position
        qs = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # (1, H, n, d)
        if chunk.block_table is None:  # a prompt's first chunk: its own keys, causal
            ks, vs = k[chunk.start : chunk.end], v[chunk.start : chunk.end]  # (n, KVH, d)
            if is_quantized(k_cache) and self.kv_absmax is None:  # as the cache holds them (not while calibrating):
                # a later read of these positions (a prefix hit, a preempted sequence) sees the same values
                ks, vs = _as_cached(ks, self.k_scale, k_cache.dtype), _as_cached(vs, self.v_scale, v_cache.dtype)
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)  # (1, KVH, n, d)
            mask = None if window is None or n <= window else _window_mask(0, n, 0, n, window, q.device)
            if local is not None and n > local:  # positions 0 .. n - 1 span more than one attention chunk
                mask = _local_chunk_mask(0, n, 0, n, local, q.device)
        else:  # a later chunk: the history through the block table, causal with offset
            skip = 0  # whole blocks before the first row's window (or attention chunk): never read
            if window is not None:
                skip = max(0, first_pos - window + 1) // k_cache.shape[1]
            if local is not None:
                skip = (first_pos - first_pos % local) // k_cache.shape[1]
            table = chunk.block_table[skip:]
            key_start = skip * k_cache.shape[1]  # position of the first key read
            ks = k_cache.index_select(0, table).view(-1, kvh, d)[: chunk.context_len - key_start]  # (C, KVH, d)
            vs = v_cache.index_select(0, table).view(-1, kvh, d)[: chunk.context_len - key_start]
            if is_quantized(k_cache):
                ks, vs = dequantize(ks, self.k_scale, q.dtype), dequantize(vs, self.v_scale, q.dtype)
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)  # (1, KVH, C, d)
            mask = chunk.mask if window is None else _window_mask(first_pos, n, key_start, chunk.context_len,
                                                                  window, q.device)
            if local is not None:
                mask = _local_chunk_mask(first_pos, n, key_start, chunk.context_len, local, q.device)
        o = self._attention(qs, ks, vs, mask)  # (1, H, n, d)
        return o[0].transpose(0, 1)  # (n, H, d)


def _as_cached(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x (n, KVH, d)`` as an 8-bit cache of ``cache_dtype`` with ``scale (KVH, d)`` holds it, in ``x``'s dtype."""
    return dequantize(quantize(x, scale, cache_dtype), scale, x.dtype)


def _window_mask(first_pos: int, num_queries: int, key_start: int, key_end: int, window: int,
                 device: torch.device) -> torch.Tensor:
    """``(num_queries, key_end - key_start) bool``: queries at ``first_pos ..`` over keys at ``key_start ..``,
    True where ``query position - window < key position <= query position``."""
    query_pos = torch.arange(first_pos, first_pos + num_queries, device=device)[:, None]  # (n, 1)
    key_pos = torch.arange(key_start, key_end, device=device)[None, :]  # (1, C)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def _local_chunk_mask(first_pos: int, num_queries: int, key_start: int, key_end: int, chunk: int,
                      device: torch.device) -> torch.Tensor:
    """``(num_queries, key_end - key_start) bool``: queries at ``first_pos ..`` over keys at ``key_start ..``,
    True where the key is causal and in the query's attention chunk (``p - p % chunk <= key position <= p``)."""
    query_pos = torch.arange(first_pos, first_pos + num_queries, device=device)[:, None]  # (n, 1)
    key_pos = torch.arange(key_start, key_end, device=device)[None, :]  # (1, C)
    return (key_pos <= query_pos) & (key_pos >= query_pos - query_pos % chunk)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                        softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``softmax(c * tanh(q k^T * scale / c) masked [, sink]) v`` for ``q (B, H, n, d)``, ``k, v (B, KVH, C, d)``.

    What SDPA cannot do, spelled out. Gemma 2's soft-cap (``transformers``' ``eager_attention_forward``
    with ``softcap``; None: no cap) is applied to the scaled scores, then the mask (``(n, C)`` or
    broadcastable to ``(B, H, n, C)``, True = attend) and a float32 softmax. gpt-oss's ``sinks``
    (``(H,)``; None: none) are one more logit column per head, dropped after the softmax
    (``modeling_gpt_oss.py``'s ``eager_attention_forward``). Returns ``(B, H, n, d)`` in ``q``'s dtype.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # GQA: each KV head serves ``groups`` consecutive query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, C, d)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, n, C)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, n, C)
    else:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, n, 1)
        with_sink = torch.cat([scores, sink], dim=-1)  # (B, H, n, C + 1)
        probs = torch.softmax(with_sink, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)  # (B, H, n, C)
    return torch.matmul(probs, v)  # (B, H, n, d)
