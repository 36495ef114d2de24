"""The Triton source of worker/kernels/triton_attention.py's paged decode kernel (that module documents it).

Kept apart, undecorated, so that importing the wrapper costs no Triton import, and
the same function can be jitted for the GPU or for Triton's CPU interpreter.
"""

import triton
import triton.language as tl


@triton.jit  # a device function the kernel calls (the kernel itself is jitted by its wrapper)
def load_cache(ptr, offsets, mask, FP8: tl.constexpr):
    """Cache elements as float32: as stored (a float or int8 cache), or float8 e4m3 codes read as uint8
    and decoded bit by bit (sign, exponent, mantissa moved into a float32's, times 2^120 for the
    exponent bias; subnormals alike), which needs no fp8 support from the GPU or the interpreter."""
    if FP8:
        x = tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32)
        bits = ((x & 0x7F) << 20) | ((x & 0x80) << 24)
        return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2 ** 120
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_scales(ptr, offsets, mask):
    """bfloat16 scales read as int16 bits and widened to float32 (the bits become a float32's top half)."""
    x = tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32) & 0xFFFF
    return (x << 16).to(tl.float32, bitcast=True)



def paged_decode_kernel(
    out_ptr, partial_max_ptr, partial_sum_ptr, sinks_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    context_lens_ptr, k_scale_ptr, v_scale_ptr, k_offset_ptr, scale, blocks_per_split, sliding_window, logit_softcap,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr, SCALED: tl.constexpr, FP8: tl.constexpr,
):
    # Program (seq, kv_head, split) attends over blocks [split * blocks_per_split, +blocks_per_split)
    # of the context. SPLIT: out is (S, H, num_splits, d) float32, the unnormalised partial output,
    # with its running max and sum in partial_max / partial_sum (S, H, num_splits), combined after.
    # Only positions >= context_len - sliding_window are attended (the query sits at context_len - 1;
    # the wrapper passes 2**30 for no window); blocks wholly before that are never loaded. SOFTCAP: scores pass through
    # logit_softcap * tanh(score / logit_softcap) before the softmax (Gemma 2). SINKS: one more
    # logit per query head, sinks[head], joins the softmax's denominator with no value (gpt-oss); a
    # SPLIT program leaves it to the wrapper's combination, which must count it once. SCALED: an 8-bit
    # cache (worker/kv_quant.py) of codes, keys k_scale[block, kv_head, t] * code + k_offset[kv_head, i] and
    # values v_scale[block, kv_head, t] * code (scales (num_blocks, KVH, BLOCK_SIZE) bfloat16 passed as int16,
    # offset (KVH, HEAD_DIM) float32): a key's scale multiplies its score and q . k_offset is added to
    # every score (q . (s c + mu) = s (q . c) + q . mu), a value's scale its probability; FP8: float8
    # e4m3 codes, as uint8.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)  # query heads of this KV head
    d = tl.arange(0, HEAD_PAD)
    t = tl.arange(0, BLOCK_SIZE)  # token offsets within a block
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (G, D)
    num_kv_heads = tl.num_programs(1)
    if SCALED:
        q_mu = tl.sum(q * tl.load(k_offset_ptr + kv_head * HEAD_DIM + d, mask=d_ok, other=0.0)[None, :], axis=1)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # (G,)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)  # (G,)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)  # (G, D) unnormalised output
    window_start = tl.maximum(context_len - sliding_window, 0)  # first position attended
    first = split * blocks_per_split
    for b in range(tl.maximum(first, window_start // BLOCK_SIZE),
                   tl.minimum(first + blocks_per_split, tl.cdiv(context_len, BLOCK_SIZE))):
        block = tl.load(block_tables_ptr + seq * stride_table + b).to(tl.int64)
        t_ok = (b * BLOCK_SIZE + t < context_len) & (b * BLOCK_SIZE + t >= window_start)  # (BS,)
        offsets = (block * stride_cache_block + t[:, None] * stride_cache_token
                   + kv_head * stride_cache_head + d[None, :])  # (BS, D)
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = load_cache(k_cache_ptr, offsets, kv_ok, FP8)  # (BS, D)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G, BS)
        if SCALED:
            scale_at = (block * num_kv_heads + kv_head) * BLOCK_SIZE + t  # (BS,) contiguous in the scale pools
            scores = scores * load_scales(k_scale_ptr, scale_at, t_ok)[None, :] + q_mu[:, None]
        scores = scores * scale
        if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), which overflows to the right limits
            scores = logit_softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / logit_softcap) + 1.0))
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: a block holds >= 1 position
        correction = tl.exp(running_max - new_max)  # (G,), 0 on the first block
        p = tl.exp(scores - new_max[:, None])  # (G, BS)
        running_sum = running_sum * correction + tl.sum(p, axis=1)
        v = load_cache(v_cache_ptr, offsets, kv_ok, FP8)  # (BS, D)
        if SCALED:
            p = p * load_scales(v_scale_ptr, scale_at, t_ok)[None, :]  # after the sum: it weighs the values only
        acc = acc * correction[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # (G, D)
        running_max = new_max
    if SPLIT:  # a split past the context keeps max -inf and sum 0: it weighs nothing when combined
        num_splits = tl.num_programs(2)
        stat = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # (G,) into (S, H, splits)
        tl.store(partial_max_ptr + stat, running_max, mask=g_ok)
        tl.store(partial_sum_ptr + stat, running_sum, mask=g_ok)
        tl.store(out_ptr + stat[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    else:
        if SINKS:  # rescale to the larger of the running max and the sink, so neither exponential overflows
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)  # (G,)
            top = tl.maximum(running_max, sink)
            rescale = tl.exp(running_max - top)  # (G,)
            acc = acc * rescale[:, None]
            running_sum = running_sum * rescale + tl.exp(sink - top)
        out = acc / running_sum[:, None]  # (G, D)
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
