"""Paged attention over a latent cache: multi-head latent attention's two equal forms.

Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434, section 2.1; reference:
``transformers``' ``DeepseekV3Attention``) caches per token one latent ``c`` (``r =
kv_lora_rank`` numbers, shared by every head) and one rotated key ``k_pe`` (``d_r =
qk_rope_head_dim``, shared too). Head ``h``'s key and value are rebuilt from the latent by
``kv_b_proj``, whose rows per head are ``[W_uk[h] (d_n, r) | W_uv[h] (d_v, r)]``:

    k[h] = [W_uk[h] c ; k_pe]        (d_n + d_r)          v[h] = W_uv[h] c        (d_v)
    o[h] = sum_j softmax_j(scale * (q_nope[h] . k_nope[h]_j + q_pe[h] . k_pe_j)) v[h]_j

Two ways to compute the same ``o``:

* **expanded** (:func:`expanded_attention`, prefill): up-project every context token's
  ``k_nope`` and ``v`` per head, then ordinary attention, ``O(C * H * (d_n + d_v) * r)`` for
  the up-projection; best when the queries are as many as the keys (a prompt);
* **absorbed** (:func:`absorbed_attention`, decode): since ``q_nope . (W_uk c) = (W_uk^T q_nope)
  . c``, fold ``W_uk`` into the query (``q_lat[h] = W_uk[h]^T q_nope[h]``, width ``r``) and
  ``W_uv`` into the output (``o[h] = W_uv[h] (sum_j p_j c_j)``): attention with one shared
  key/value head of width ``r + d_r`` read straight from the cache, no per-token
  up-projection; best for a few queries over a long context (DeepSeek-V2, appendix B).

:class:`LatentPagedAttention` runs a step's flat batch like worker/attention.py's
``PagedAttention`` (decodes first, then prefill chunks): the decode group absorbed, over
the latents gathered through its block tables (the SDPA metadata's ``decode_mask``, or the
``decode_context_lens`` of a CUDA rank's Triton-builder metadata: a mask built here on the
device), each prefill chunk expanded, over its own latents (a prompt's first chunk) or its
history read through its block table. Everything is torch ops, on every device: the compiled
CPU paged kernel and the Triton kernel read per-head caches, and the worker does not select
the compiled kernel, nor capture decode graphs, for MLA (worker/model_runner.py: a graph's
static block tables are ``max_model_len`` wide, which this gather would read in full).

Cache per layer and rank: ``latent_cache (num_blocks, block_size, 1, r)`` and
``rope_cache (num_blocks, block_size, 1, d_r)`` (worker/kv_cache.py's latent layout). With
``--kv-cache-dtype int8|fp8`` both hold 8-bit codes, each token's latent and rotated key with a
bfloat16 scale of its own (its absmax over the code range, worker/kv_quant.py's per-token rule with
one "head" and no offset: the latent is both key and value), in scale pools ``(num_blocks, 1,
block_size)`` (:attr:`LatentPagedAttention.kv_scales`); every read converts the gathered codes back
to the activations' dtype before the same torch math, and a first chunk reads its own rows as the
cache rounds them, so that a prefix hit or a recomputed sequence sees exactly what a miss did.
A token then costs ``r + d_r + 4`` bytes against ``2 (r + d_r)`` in 16 bits: 1.99x the blocks
(DeepSeek-V3: r = 512, d_r = 64; 580 bytes against 1,152).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention import AttentionMetadata, PrefillChunk
from worker.kv_quant import as_cached, dequantize, is_quantized, quantize

#: An 8-bit latent cache's scale pools: ``(latent_scale, rope_scale)``, each ``(num_blocks, 1, block_size)``
#: bfloat16, one scale per token of the latent and of the rotated key.
LatentScales = tuple[torch.Tensor, torch.Tensor]


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, k_pe: torch.Tensor,
                       kv_b_weight: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """MLA with the keys and values up-projected per head: ``(n, H, d_v)``.

    Args:
        q_nope: ``(n, H, d_n)`` the queries' position-free part.
        q_pe: ``(n, H, d_r)`` the queries' rotated part.
        latents: ``(C, r)`` the context's normalised latents.
        k_pe: ``(C, d_r)`` the context's rotated shared keys.
        kv_b_weight: ``(H * (d_n + d_v), r)`` this rank's ``kv_b_proj`` rows (per head ``[k_nope | v]``).
        mask: ``(n, C) bool`` True = attend; None: causal with ``n == C``.
        scale: softmax scale.
    """
    num_heads, d_n = q_nope.shape[1], q_nope.shape[2]
    kv = F.linear(latents, kv_b_weight).view(latents.shape[0], num_heads, -1)  # (C, H, d_n + d_v)
    k_nope, v = kv.split([d_n, kv.shape[-1] - d_n], dim=-1)  # (C, H, d_n), (C, H, d_v)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)  # (C, H, d_n + d_r)
    q = torch.cat([q_nope, q_pe], dim=-1)  # (n, H, d_n + d_r)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       is_causal=mask is None, scale=scale)  # (H, n, d_v)
    return o.transpose(0, 1)  # (n, H, d_v)


def absorb_query(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, d_n: int) -> torch.Tensor:
    """``q_lat[t, h] = W_uk[h]^T q_nope[t, h]``: ``q_nope (n, H, d_n)`` -> ``(n, H, r)``."""
    num_heads = q_nope.shape[1]
    w_uk = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])[:, :d_n]  # (H, d_n, r)
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (n, H, r)


def absorb_output(o_lat: torch.Tensor, kv_b_weight: torch.Tensor, d_n: int) -> torch.Tensor:
    """``o[t, h] = W_uv[h] o_lat[t, h]``: ``o_lat (n, H, r)`` -> ``(n, H, d_v)``."""
    num_heads = o_lat.shape[1]
    w_uv = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])[:, d_n:]  # (H, d_v, r)
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (n, H, d_v)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, k_pe: torch.Tensor,
                       kv_b_weight: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA with ``kv_b_proj`` folded into the query and the output: ``(S, n, H, d_v)``.

    One shared key/value head per sequence: keys ``[c ; k_pe]`` (width ``r + d_r``), values ``c``.

    Args:
        q_nope: ``(S, n, H, d_n)``; q_pe: ``(S, n, H, d_r)``: ``n`` queries of each of ``S`` sequences.
        latents: ``(S, C, r)``; k_pe: ``(S, C, d_r)``: each sequence's (padded) context.
        kv_b_weight: ``(H * (d_n + d_v), r)`` as :func:`expanded_attention`.
        mask: ``(S, n, C) bool`` True = attend (every row attends at least one key).
        scale: softmax scale.
    """
    seqs, n, num_heads, d_n = q_nope.shape
    q_lat = absorb_query(q_nope.reshape(seqs * n, num_heads, d_n), kv_b_weight, d_n)  # (S * n, H, r)
    q_lat = q_lat.reshape(seqs, n * num_heads, -1)  # (S, n * H, r)
    scores = torch.bmm(q_lat, latents.transpose(1, 2))  # (S, n * H, C)
    scores = scores + torch.bmm(q_pe.reshape(seqs, n * num_heads, -1), k_pe.transpose(1, 2))
    scores = (scores * scale).view(seqs, n, num_heads, -1)  # (S, n, H, C)
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(latents.dtype)  # (S, n, H, C)
    o_lat = torch.bmm(probs.view(seqs, n * num_heads, -1), latents)  # (S, n * H, r)
    o = absorb_output(o_lat.view(seqs * n, num_heads, -1), kv_b_weight, d_n)  # (S * n, H, d_v)
    return o.reshape(seqs, n, num_heads, -1)  # (S, n, H, d_v)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, workspace: dict[str, torch.Tensor],
            name: str) -> torch.Tensor:
    """``cache[block_ids]`` for ``block_ids (m,)``: ``(m * block_size, width)``, in a buffer reused across steps."""
    numel = block_ids.numel() * cache[0].numel()
    buffer = workspace.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype or buffer.device != cache.device:
        buffer = workspace[name] = cache.new_empty(numel)
    out = buffer[:numel].view(block_ids.numel(), *cache.shape[1:])
    return torch.index_select(cache, 0, block_ids, out=out).view(-1, cache.shape[-1])


def write_latent_cache(latents: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
                       rope_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       scales: LatentScales | None = None) -> None:
    """Write ``latents (T, r)`` and ``k_pe (T, d_r)`` at ``slot_mapping (T,) int64``, in place.

    An 8-bit cache stores each row's codes and its scale in ``scales`` (module docstring).

    Raises:
        ValueError: an 8-bit cache without ``scales``.
    """
    if not is_quantized(latent_cache):
        latent_cache.view(-1, latent_cache.shape[-1]).index_copy_(0, slot_mapping, latents)
        rope_cache.view(-1, rope_cache.shape[-1]).index_copy_(0, slot_mapping, k_pe)
        return
    if scales is None:
        raise ValueError(f"a {latent_cache.dtype} latent cache needs its scale pools to be written")
    block_size = latent_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    for rows, cache, pool in ((latents, latent_cache, scales[0]), (k_pe, rope_cache, scales[1])):
        codes, row_scales = quantize(rows.unsqueeze(1), cache.dtype)  # (T, 1, width), (T, 1)
        # As bytes: index_copy_ has no float8 kernel (the copy moves bytes either way).
        cache.view(torch.uint8).view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, codes.view(torch.uint8).squeeze(1))
        pool[blocks, 0, offsets] = row_scales.squeeze(1)


def _read_rows(cache: torch.Tensor, pool: torch.Tensor | None, block_ids: torch.Tensor, dtype: torch.dtype,
               workspace: dict[str, torch.Tensor] | None = None, name: str = "") -> torch.Tensor:
    """Blocks ``block_ids (m,)`` of a latent or rope cache as rows ``(m * block_size, width)`` of ``dtype``: the
    values, or an 8-bit cache's codes times their scales (``pool``). ``workspace``: a buffer reused for the gather."""
    if workspace is not None:
        rows = _gather(cache, block_ids, workspace, name)
    else:
        rows = cache.index_select(0, block_ids).view(-1, cache.shape[-1])
    if pool is None:
        return rows
    row_scales = pool.index_select(0, block_ids).view(-1, 1)  # (m * block_size, 1): a block's scales in order
    return dequantize(rows.unsqueeze(1), row_scales, dtype).squeeze(1)


class LatentPagedAttention:
    """A step's MLA over the paged latent cache, for this rank's heads (see the module docstring).

    Args:
        qk_nope_head_dim: ``d_n``.
        scale: softmax scale (``(d_n + d_r) ** -0.5``, times YaRN's ``mscale**2`` where it applies).
    """

    def __init__(self, qk_nope_head_dim: int, scale: float) -> None:
        self.d_n = qk_nope_head_dim
        self.scale = scale
        #: An 8-bit cache's scale pools (module docstring); None with a float cache.
        self.kv_scales: LatentScales | None = None

    def set_kv_scales(self, latent_scale: torch.Tensor, rope_scale: torch.Tensor) -> None:
        """Attach an 8-bit cache's scale pools, ``(num_blocks, 1, block_size)`` bfloat16 each (a new pool with
        each cache).

        Raises:
            ValueError: pools of another shape, or not contiguous.
        """
        if latent_scale.shape != rope_scale.shape or latent_scale.dim() != 3 or latent_scale.shape[1] != 1 \
                or not (latent_scale.is_contiguous() and rope_scale.is_contiguous()):
            raise ValueError(f"latent_scale {tuple(latent_scale.shape)}, rope_scale {tuple(rope_scale.shape)} must "
                             "be contiguous (num_blocks, 1, block_size)")
        self.kv_scales = (latent_scale, rope_scale)

    def __call__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, k_pe: torch.Tensor,
                 kv_b_weight: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """``q_nope (T, H, d_n)``, ``q_pe (T, H, d_r)`` -> ``(T, H * d_v)``.

        ``latents (T, r)`` and ``k_pe (T, d_r)`` are this step's, already written at the
        step's slots (:func:`write_latent_cache`).
        """
        if meta.decode_query_start_loc is not None:  # the compiled kernel's group (chunks of several rows)
            raise RuntimeError("multi-head latent attention does not take the compiled paged kernel's step "
                               "metadata (worker/model_runner.py does not select it for a latent cache)")
        num_tokens, num_heads = q_nope.shape[0], q_nope.shape[1]
        d_v = kv_b_weight.shape[0] // num_heads - self.d_n
        num_decodes = meta.num_decodes
        out = q_nope.new_empty(num_tokens, num_heads, d_v)  # (T, H, d_v)
        if num_decodes:
            out[:num_decodes] = self._decode(q_nope[:num_decodes], q_pe[:num_decodes], kv_b_weight, latent_cache,
                                             rope_cache, meta)
        for chunk in meta.prefills:
            out[chunk.start : chunk.end] = self._prefill(q_nope, q_pe, latents, k_pe, kv_b_weight, latent_cache,
                                                         rope_cache, chunk)
        return out.view(num_tokens, num_heads * d_v)  # (T, H * d_v)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                latent_cache: torch.Tensor, rope_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decode group (one row per sequence), absorbed: ``(D, H, d_v)``."""
        tables = meta.decode_block_tables  # (D, B)
        assert tables is not None and meta.decode_context_lens is not None  # num_decodes > 0
        seqs = tables.shape[0]
        block_ids = tables.reshape(-1)  # (D * B,)
        pools = self.kv_scales or (None, None)
        latents = _read_rows(latent_cache, pools[0], block_ids, q_nope.dtype, meta.workspace,
                             "latents").view(seqs, -1, latent_cache.shape[-1])
        k_pe = _read_rows(rope_cache, pools[1], block_ids, q_nope.dtype, meta.workspace,
                          "rope_keys").view(seqs, -1, rope_cache.shape[-1])
        if meta.decode_mask is not None:
            mask = meta.decode_mask.view(seqs, 1, -1)  # (D, 1, B * bs)
        else:  # a CUDA rank's Triton-builder metadata: context lengths only
            key_pos = torch.arange(latents.shape[1], device=latents.device)  # (B * bs,)
            mask = (key_pos[None, :] < meta.decode_context_lens[:, None]).unsqueeze(1)  # (D, 1, B * bs)
        o = absorbed_attention(q_nope.unsqueeze(1), q_pe.unsqueeze(1), latents, k_pe, kv_b_weight, mask,
                               self.scale)  # (D, 1, H, d_v)
        return o.squeeze(1)  # (D, H, d_v)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, k_pe: torch.Tensor,
                 kv_b_weight: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                 chunk: PrefillChunk) -> torch.Tensor:
        """One prefill chunk's rows, expanded: ``(n, H, d_v)``."""
        rows = slice(chunk.start, chunk.end)
        if chunk.block_table is None:  # a prompt's first chunk: its own latents, causal
            own, own_pe = latents[rows], k_pe[rows]
            if is_quantized(latent_cache):  # as the cache holds them, as every later read sees them
                own = as_cached(own.unsqueeze(1), latent_cache.dtype).squeeze(1)
                own_pe = as_cached(own_pe.unsqueeze(1), rope_cache.dtype).squeeze(1)
            return expanded_attention(q_nope[rows], q_pe[rows], own, own_pe, kv_b_weight, None, self.scale)
        context = chunk.context_len  # a later chunk: the history through the block table, causal with offset
        pools = self.kv_scales or (None, None)
        history = _read_rows(latent_cache, pools[0], chunk.block_table, q_nope.dtype)[:context]
        history_pe = _read_rows(rope_cache, pools[1], chunk.block_table, q_nope.dtype)[:context]
        return expanded_attention(q_nope[rows], q_pe[rows], history, history_pe, kv_b_weight, chunk.mask,
                                  self.scale)
