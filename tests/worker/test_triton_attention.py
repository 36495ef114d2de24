"""The Triton paged decode kernel against attention over each sequence's gathered context.

On a CUDA machine the kernel runs compiled on the GPU; elsewhere in Triton's
interpreter on CPU tensors (tests/worker/conftest.py sets ``TRITON_INTERPRET``),
so the same cases check the same kernel source everywhere. The reference is
written independently: each sequence's keys and values gathered position by
position through its block table, float64 softmax attention.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from worker.kernels.triton_attention import (MAX_SPLITS, SPLIT_BELOW_PROGRAMS, paged_decode_attention, split_plan,
                                             triton_attention_available)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (it ships with torch's CUDA builds; `pip install "
                                       "triton` elsewhere: the kernel then runs in its interpreter)")


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``(S, H, d)`` float64: softmax(q K^T scale) V per sequence, position by position through its table."""
    num_seqs, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(context_lens[s])
        slots = [(int(block_tables[s, p // block_size]), p % block_size) for p in range(n)]
        keys = torch.stack([k_cache[b, o] for b, o in slots]).double().cpu()  # (n, KVH, d)
        values = torch.stack([v_cache[b, o] for b, o in slots]).double().cpu()
        group = num_heads // num_kv_heads
        for h in range(num_heads):
            scores = keys[:, h // group] @ q[s, h].double().cpu() * scale  # (n,)
            out[s, h] = scores.softmax(0) @ values[:, h // group]
    return out


CASES = [  # (heads, kv heads, head size, block size, dtype)
    (4, 1, 16, 4, torch.float32),  # MQA, the tiny models' shape
    (8, 2, 64, 16, torch.float32),  # GQA groups of 4, Llama's head size
    (4, 4, 80, 8, torch.float32),  # MHA, a head size that is not a power of two (padded lanes)
    (6, 2, 32, 16, torch.float16),  # groups of 3 (padded to 4)
    (8, 4, 64, 16, torch.bfloat16),
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size", "block_size", "dtype"), CASES)
def test_matches_attention_over_the_gathered_context(num_heads: int, num_kv_heads: int, head_size: int,
                                                     block_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_heads * 1000 + head_size)
    num_blocks, max_blocks = 24, 4
    # Context lengths: one token, exactly one block, one past it, odd, all four blocks full.
    context_lens = torch.tensor([1, block_size, block_size + 1, 2 * block_size + 3, max_blocks * block_size])
    num_seqs = len(context_lens)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in range(num_seqs)])
    # q as the model passes it: a view of the fused qkv projection (row stride past the heads).
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_size, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_size].view(num_seqs, num_heads, head_size)
    scale = head_size**-0.5
    expected = reference(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
                                 context_lens.to(DEVICE), scale)
    assert out.shape == q.shape and out.dtype == dtype
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # the output's rounding
    torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_of_few_sequences_split_and_combine(dtype: torch.dtype) -> None:
    """Flash-decoding: three programs per (sequence, KV head), combined by their softmax statistics."""
    block_size, width = 16, 80  # tables of 1,280 tokens
    assert split_plan(4, 2, width, block_size) == (3, 27)
    gen = torch.Generator().manual_seed(11)
    k_cache = torch.randn(100, block_size, 2, 32, generator=gen).to(dtype)
    v_cache = torch.randn(100, block_size, 2, 32, generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(100, generator=gen)[:width] for _ in range(4)])
    # One token (two splits empty), one past the first split's 432, the whole table, one full split.
    lens = torch.tensor([1, 433, width * block_size, 27 * block_size])
    q = torch.randn(4, 4, 32, generator=gen).to(dtype)
    out = paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                                 lens.to(DEVICE), 32**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.cpu().double(), reference(q, k_cache, v_cache, tables, lens, 32**-0.5),
                               atol=tolerance, rtol=tolerance)


def test_split_plan_splits_only_narrow_steps_over_long_tables() -> None:
    assert split_plan(1, 8, 32, 16) == (1, 32)  # 512 tokens: one part
    assert split_plan(1, 8, 33, 16) == (2, 17)
    assert split_plan(1, 8, 8192, 16) == (MAX_SPLITS, 512)  # 128k tokens: at most MAX_SPLITS parts
    assert split_plan(SPLIT_BELOW_PROGRAMS // 8, 8, 8192, 16) == (1, 8192)  # enough programs already


def test_writes_into_a_given_output_and_takes_int32_tables() -> None:
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(6, 4, 1, 16, generator=gen)
    v_cache = torch.randn(6, 4, 1, 16, generator=gen)
    q = torch.randn(2, 2, 16, generator=gen)
    tables = torch.tensor([[5, 0, 3], [2, 4, 1]], dtype=torch.int32)
    lens = torch.tensor([9, 3], dtype=torch.int32)
    out = torch.full_like(q, float("nan")).to(DEVICE)
    result = paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                                    lens.to(DEVICE), 0.25, out=out)
    assert result is out
    with pytest.raises(ValueError, match="must be like q"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, out=torch.empty(2, 2, 8))
    torch.testing.assert_close(out.cpu().double(), reference(q, k_cache, v_cache, tables, lens, 0.25))


@pytest.mark.parametrize(("q_shape", "cache_shape", "table_rows", "message"), [
    ((2, 4, 16), (6, 6, 1, 16), 2, "power of two"),
    ((2, 3, 16), (6, 4, 2, 16), 2, "does not fit"),
    ((2, 4, 8), (6, 4, 1, 16), 2, "does not fit"),
    ((2, 4, 16), (6, 4, 1, 16), 3, "must have 2 rows"),
])
def test_bad_shapes_are_refused(q_shape: tuple, cache_shape: tuple, table_rows: int, message: str) -> None:
    cache = torch.zeros(cache_shape)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(torch.zeros(q_shape), cache, cache, torch.zeros(table_rows, 2, dtype=torch.int64),
                               torch.ones(q_shape[0], dtype=torch.int64), 1.0)


def test_available_on_cuda_with_a_power_of_two_block_only(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    assert triton_attention_available(cuda, 16) and triton_attention_available(cuda, 1)
    assert not triton_attention_available(cuda, 12)
    assert not triton_attention_available(torch.device("cpu"), 16)  # the CPU has its compiled kernel
    monkeypatch.setenv("TPSERVE_TRITON_ATTENTION", "0")
    assert not triton_attention_available(cuda, 16)
