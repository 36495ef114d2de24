"""Paged decode attention in Triton: each sequence's query over its keys and values where they lie.

The GPU's counterpart of cpu_attention.cpp. Without it a CUDA decode step gathers
every sequence's context out of the paged cache (``index_select`` of whole
blocks) before one SDPA call: a copy of the whole context per layer per step,
padded to the longest sequence. Here one program per ``(sequence, KV head)``
walks that sequence's block table, loads one block of keys at a time, and keeps
the softmax online (Milakov & Gimelshein 2018, arXiv:1805.02867; the
paged-attention layout of Kwon et al. 2023, arXiv:2309.06180), so each key and
value is read once, from where it lies, and nothing past the context length is
touched. The ``num_heads / num_kv_heads`` query heads that share a KV head (GQA)
are one program: their keys are read once for the group.

Its shapes are fixed by the batch size alone (the context lengths are read from
a device tensor inside the loop), so a decode step that calls it can be captured
in a CUDA graph (worker/cuda_graphs.py) and replayed at any context length.

Triton is imported on first use: it ships with PyTorch's CUDA builds, and a CPU
machine without it never gets here. With ``TRITON_INTERPRET=1`` in the environment
before Triton is first imported, the same kernel runs on CPU tensors in Triton's
interpreter (slowly): tests/worker/conftest.py sets it on machines without CUDA,
so the kernel's tests run everywhere.
``TPSERVE_TRITON_ATTENTION=0`` turns the kernel off (SDPA over gathered blocks
instead), for A/B measurements.

A step of few sequences would be only ``num_seqs * num_kv_heads`` programs wide, a
fraction of a GPU's SMs, so there a long context is split into parts attended by
programs of their own and combined by their softmax statistics (flash-decoding;
:func:`split_plan`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


#: Splitting one context over several programs (flash-decoding): only when a step has fewer
#: ``(sequence, KV head)`` programs than this (an H200 has 132 SMs), into at most ``MAX_SPLITS``
#: parts of at least ``SPLIT_TOKENS`` tokens (vLLM's paged_attention_v2 partitions 512).
SPLIT_BELOW_PROGRAMS = 128
MAX_SPLITS = 16
SPLIT_TOKENS = 512
#: The window the kernel is given for "no window": longer than any context it can be asked to read.
_NO_WINDOW = 1 << 30


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_attention_available(device: torch.device, block_size: int) -> bool:
    """Whether decode attention on ``device`` runs :func:`paged_decode_attention`.

    True on CUDA with Triton importable and a power-of-two ``block_size`` (a block is
    one ``tl.arange``), unless ``TPSERVE_TRITON_ATTENTION=0``.
    """
    return (device.type == "cuda" and _is_power_of_two(block_size)
            and os.environ.get("TPSERVE_TRITON_ATTENTION", "1") != "0"
            and importlib.util.find_spec("triton") is not None)


def split_plan(num_seqs: int, num_kv_heads: int, table_width: int, block_size: int) -> tuple[int, int]:
    """``(num_splits, blocks_per_split)`` for a step: how many programs share one sequence's context.

    Decided from shapes only (so a CUDA graph keeps its choice): split only when the step's
    ``num_seqs * num_kv_heads`` programs would leave most of a GPU's SMs idle
    (``SPLIT_BELOW_PROGRAMS``) and the block tables span more than ``SPLIT_TOKENS`` tokens;
    then into at most ``MAX_SPLITS`` parts of at least ``SPLIT_TOKENS`` tokens. A split
    past a sequence's context does nothing.
    """
    max_tokens = table_width * block_size
    if num_seqs * num_kv_heads >= SPLIT_BELOW_PROGRAMS or max_tokens <= SPLIT_TOKENS:
        return 1, max(1, table_width)
    num_splits = min(MAX_SPLITS, -(-max_tokens // SPLIT_TOKENS))
    return num_splits, -(-table_width // num_splits)


@functools.cache
def _kernel():
    """The jitted kernel, built on first use."""
    import triton

    from worker.kernels import _triton_paged_decode

    return triton.jit(_triton_paged_decode.paged_decode_kernel)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, *, sliding_window: int = 0,
                           logit_softcap: float = 0.0, sinks: torch.Tensor | None = None,
                           kv_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context: ``softmax(cap(q K^T * scale)) V``.

    Args:
        q: ``(S, H, d)`` float16 / bfloat16 / float32, the last dim contiguous.
        k_cache, v_cache: ``(num_blocks, block_size, KVH, d)``, same dtype, contiguous;
            ``H`` a multiple of ``KVH``, ``block_size`` a power of two. Either ``q``'s dtype or
            an 8-bit cache's codes (``int8`` or ``float8_e4m3fn``; worker/kv_quant.py), converted
            in the kernel.
        block_tables: ``(S, B) int32 / int64``: sequence ``s``'s positions ``p`` lie in
            block ``block_tables[s, p // block_size]``; entries past its context are never read.
        context_lens: ``(S,) int32 / int64``, each ``>= 1``: keys at positions
            ``0 .. context_lens[s] - 1`` are attended over (the query's own included).
        scale: softmax scale, ``d ** -0.5`` for Llama.
        out: ``(S, H, d)`` to write into (a CUDA graph's static output); None: a new tensor.
        sliding_window: ``W > 0``: only the last ``W`` positions (``> context_len - 1 - W``,
            Hugging Face's ``sliding_window``) are attended, and the blocks before them never
            loaded; 0: the whole context.
        logit_softcap: ``c > 0``: scores become ``c * tanh(score / c)`` before the softmax
            (``cap``; Gemma 2's ``attn_logit_softcapping``); 0: none.
        sinks: ``(H,)`` float32, one learned logit per query head that joins the softmax's
            denominator with no value (gpt-oss's attention sinks: ``exp(sinks[h])`` added to
            ``sum_t exp(score_t)``; ``transformers``' ``modeling_gpt_oss.py``); None: none
            (the kernel is compiled without that code).
        kv_scales: an 8-bit cache's ``(k_scale, v_scale, k_offset)`` on ``q``'s device (worker/kv_quant.py):
            scales ``(num_blocks, KVH, block_size)`` bfloat16, contiguous, and the key offset ``(KVH, d)``
            float32; keys are ``k_scale[block, head, offset] * code + k_offset[head]``, values
            ``v_scale[block, head, offset] * code``; None for a float cache.

    Returns:
        ``(S, H, d)`` in ``q``'s dtype; the arithmetic is float32.

    Raises:
        ValueError: mismatched shapes, ``H`` not a multiple of ``KVH``, a block size
            that is not a power of two, an ``out`` unlike ``q``, CPU tensors outside Triton's interpreter,
            a negative ``sliding_window`` or ``logit_softcap``, ``sinks`` not ``(H,)`` float32 on ``q``'s device.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if not _is_power_of_two(block_size):
        raise ValueError(f"block_size={block_size} must be a power of two")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must have {num_seqs} rows")
    if q.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q's last dimension and the caches must be contiguous")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("a Triton kernel on CPU tensors needs TRITON_INTERPRET=1 before triton is imported")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be like q {tuple(q.shape)} {q.dtype}, last dim contiguous")
    if sliding_window < 0 or logit_softcap < 0:
        raise ValueError(f"sliding_window={sliding_window} and logit_softcap={logit_softcap} must be >= 0 (0: none)")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32
                              or sinks.device != q.device or not sinks.is_contiguous()):
        raise ValueError(f"sinks {tuple(sinks.shape)} {sinks.dtype} must be a contiguous ({num_heads},) float32 "
                         f"tensor on {q.device}")
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    num_splits, blocks_per_split = split_plan(num_seqs, num_kv_heads, block_tables.shape[1], block_size)
    constants = dict(GROUP=group, GROUP_PAD=max(2, 1 << (group - 1).bit_length()), BLOCK_SIZE=block_size,
                     HEAD_DIM=head_dim, HEAD_PAD=max(16, 1 << (head_dim - 1).bit_length()),
                     SOFTCAP=logit_softcap > 0, SINKS=sinks is not None, SCALED=kv_scales is not None,
                     FP8=k_cache.dtype == torch.float8_e4m3fn)
    window = (sliding_window or _NO_WINDOW, float(logit_softcap))
    k_scale, v_scale, k_offset = (out, out, out) if kv_scales is None else kv_scales  # unread without SCALED
    if kv_scales is not None:  # bfloat16 bits, widened in the kernel (no bfloat16 loads needed)
        k_scale, v_scale = k_scale.view(torch.int16), v_scale.view(torch.int16)
    if constants["FP8"]:  # the kernel decodes e4m3 bits itself (no fp8 arithmetic needed from the GPU)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    if num_splits == 1:
        _kernel()[(num_seqs, num_kv_heads, 1)](
            out, out, out, out if sinks is None else sinks, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, k_offset, scale,
            blocks_per_split, *window, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides, SPLIT=False, **constants)
        return out
    # Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"; vLLM's
    # paged_attention_v2): each split's partial output, max and sum, then one weighted combination.
    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    partial_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty_like(partial_max)
    _kernel()[(num_seqs, num_kv_heads, num_splits)](
        partial, partial_max, partial_sum, partial_max, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, k_offset, scale,
        blocks_per_split,
        *window,
        q.stride(0), q.stride(1), 0, 0, *strides, SPLIT=True, **constants)
    top = partial_max.amax(dim=-1, keepdim=True)  # (S, H, 1)
    if sinks is not None:  # the sink joins the denominator once, in the combination (the splits leave it out)
        top = torch.maximum(top, sinks.view(1, -1, 1))
    weights = torch.exp(partial_max - top)  # (S, H, splits); 0 where empty
    denominator = (partial_sum * weights).sum(dim=-1, keepdim=True)  # (S, H, 1)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks.view(1, -1, 1) - top)
    combined = (partial * weights.unsqueeze(-1)).sum(dim=2) / denominator
    return out.copy_(combined)  # (S, H, d) in q's dtype
