"""Attention sinks (gpt-oss) in every attention path, against a float64 softmax with the sink as one more logit.

The reference is written independently of the paths: each row's keys and values gathered
position by position through its block table (its window only, if any), the scaled scores
with ``sinks[h]`` appended, a float64 softmax, the sink's column dropped, times the values
(``transformers``' ``modeling_gpt_oss.py``, ``eager_attention_forward``). Checked: the compiled
CPU kernel (decodes and short causal chunks), the Triton paged kernel in one program per
sequence and split over several (flash-decoding, the sink counted once in the combination),
and :class:`PagedAttention`'s torch path (decodes over gathered blocks, a prompt's first chunk,
a continued chunk) and compiled-kernel path in one mixed step. Sinks span a dominant logit
(+6: most of the mass goes nowhere) to a negligible one (-30).
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from tpserve.step import SamplingParams, ScheduledChunk
from worker.attention import PagedAttention, write_kv_cache
from worker.kernels import _cpu_supports_avx2, cpu_kernels_available
from worker.kernels.triton_attention import paged_decode_attention, split_plan
from worker.step_inputs import build_step_inputs

needs_kernels = pytest.mark.skipif(not (_cpu_supports_avx2() and shutil.which("c++")),
                                   reason="needs an AVX2 CPU and a C++ compiler")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (its interpreter runs the kernel on the CPU)")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sinks_for(num_heads: int, generator: torch.Generator) -> torch.Tensor:
    """``(H,)`` float32 sinks: a dominant one, a negligible one, the rest of the scores' size."""
    sinks = torch.randn(num_heads, generator=generator)
    sinks[0], sinks[-1] = 6.0, -30.0
    return sinks


def reference_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """One row: ``q (H, d)`` over ``keys, values (n, KVH, d)`` -> ``(H, d)`` float64, softmax with the sink."""
    num_heads, group = q.shape[0], q.shape[0] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        scores = keys[:, h // group].double() @ q[h].double() * scale  # (n,)
        probs = torch.cat([scores, sinks[h:h + 1].double()]).softmax(0)[:-1]  # (n,): the sink's mass dropped
        out[h] = probs @ values[:, h // group].double()
    return out


def gather(cache: torch.Tensor, table: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Positions ``first .. last`` of a sequence, one by one through its block table: ``(n, KVH, d)``."""
    block_size = cache.shape[1]
    return torch.stack([cache[int(table[p // block_size]), p % block_size] for p in range(first, last + 1)])


@needs_kernels
@pytest.mark.parametrize("head_size", [16, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 4), (4, 1), (2, 2)])
@pytest.mark.parametrize("window", [0, 5])
def test_the_cpu_kernel_adds_the_sink_to_every_softmax(head_size: int, num_heads: int, num_kv_heads: int,
                                                       window: int) -> None:
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(head_size + 10 * num_heads + window)
    block_size, num_blocks, max_blocks = 4, 30, 8
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    query_lens, context_lens = (1, 3, 1, 7), torch.tensor([1, 9, 17, 32])  # decodes and short causal chunks
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in query_lens])
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    q = torch.randn(int(starts[-1]), num_heads, head_size, generator=g) * 2
    sinks = sinks_for(num_heads, g)
    scale = head_size**-0.5
    out = torch.ops.tpserve_cpu.paged_attention(q, k_cache, v_cache, tables, starts, context_lens, scale, window,
                                                0.0, sinks)
    plain = torch.ops.tpserve_cpu.paged_attention(q, k_cache, v_cache, tables, starts, context_lens, scale, window)
    for s, n in enumerate(query_lens):
        length = int(context_lens[s])
        for i in range(n):
            row, p = int(starts[s]) + i, length - n + i
            first = max(0, p - window + 1) if window else 0
            keys, values = gather(k_cache, tables[s], first, p), gather(v_cache, tables[s], first, p)
            torch.testing.assert_close(out[row].double(), reference_row(q[row], keys, values, sinks, scale),
                                       rtol=1e-5, atol=1e-5)
    # The sink only takes mass: each head's output is the plain one times (1 - the sink's probability).
    assert not torch.allclose(out, plain, atol=1e-3)


@needs_kernels
def test_the_cpu_kernel_refuses_sinks_of_the_wrong_shape_or_dtype() -> None:
    k_cache = torch.randn(4, 4, 2, 16)
    args = (torch.randn(1, 4, 16), k_cache, k_cache, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0, 1]),
            torch.tensor([3]), 0.25, 0, 0.0)
    for bad in (torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(8)[::2]):
        with pytest.raises(RuntimeError, match="sinks must be a contiguous float32"):
            torch.ops.tpserve_cpu.paged_attention(*args, bad)


def _triton_case(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, width: int,
                 seed: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks = num_seqs * width + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(num_seqs)])
    q = torch.randn(num_seqs, num_heads, head_size, generator=g) * 2
    return q, k_cache, v_cache, tables, sinks_for(num_heads, g)


def _triton_reference(q, k_cache, v_cache, tables, lens, sinks, scale, window):
    rows = []
    for s in range(q.shape[0]):
        p = int(lens[s]) - 1
        first = max(0, p - window + 1) if window else 0
        rows.append(reference_row(q[s], gather(k_cache, tables[s], first, p), gather(v_cache, tables[s], first, p),
                                  sinks, scale))
    return torch.stack(rows)


@needs_triton
@pytest.mark.parametrize("window", [0, 6])
def test_the_triton_kernel_adds_the_sink_to_every_softmax(window: int) -> None:
    q, k_cache, v_cache, tables, sinks = _triton_case(4, 4, 2, 16, 4, 6, seed=window)
    lens = torch.tensor([1, 4, 9, 24])  # one token, one block, past a block, the whole table
    out = paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                                 lens.to(DEVICE), 0.25, sliding_window=window, sinks=sinks.to(DEVICE))
    expected = _triton_reference(q, k_cache, v_cache, tables, lens, sinks, 0.25, window)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


@needs_triton
def test_the_triton_kernel_split_over_a_long_context_counts_the_sink_once() -> None:
    """Flash-decoding: the splits leave the sink out, their combination adds it once."""
    q, k_cache, v_cache, tables, sinks = _triton_case(2, 4, 2, 16, 16, 40, seed=3)
    assert split_plan(2, 2, 40, 16)[0] == 2
    lens = torch.tensor([5, 600])  # the second split empty for the first sequence; both used by the second
    out = paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                                 lens.to(DEVICE), 0.25, sinks=sinks.to(DEVICE))
    expected = _triton_reference(q, k_cache, v_cache, tables, lens, sinks, 0.25, 0)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


@needs_triton
def test_the_triton_kernel_refuses_sinks_of_the_wrong_shape() -> None:
    q, k_cache, v_cache, tables, _ = _triton_case(1, 4, 2, 16, 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"sinks \(3,\) torch.float32 must be a contiguous \(4,\) float32"):
        paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                               torch.tensor([3]).to(DEVICE), 0.25, sinks=torch.zeros(3, device=DEVICE))


# One mixed step, plan order: a fresh 6-token prompt, a decode at position 9, a 3-token chunk from 4, a decode at 2.
QUERY_LENS, STARTS, TABLES = (6, 1, 3, 1), (0, 9, 4, 2), ([7, 2], [0, 5, 3], [6, 1], [4])
BLOCK_SIZE, HEADS, KV_HEADS = 4, 4, 2
MODULE_PATHS = [(8, False), pytest.param(16, True, marks=needs_kernels)]  # (head size, the compiled paged kernel)


@pytest.mark.parametrize(("head_size", "paged_kernel"), MODULE_PATHS)
@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_applies_the_sinks_in_a_mixed_step(head_size: int, paged_kernel: bool,
                                                           window: int | None) -> None:
    """The torch path (SDPA's place: gathered decodes, a first chunk, a continued chunk) and the kernel's."""
    g = torch.Generator().manual_seed(head_size)
    chunks = [ScheduledChunk(i, tuple(range(n)), s) for i, (n, s) in enumerate(zip(QUERY_LENS, STARTS))]
    inputs = build_step_inputs(chunks, [list(t) for t in TABLES], [SamplingParams(temperature=0)] * 4, BLOCK_SIZE,
                               torch.device("cpu"), paged_kernel=paged_kernel)
    k_cache = torch.randn(8, BLOCK_SIZE, KV_HEADS, head_size, generator=g)  # the histories: whatever is there
    v_cache = torch.randn(8, BLOCK_SIZE, KV_HEADS, head_size, generator=g)
    order = [0, 1, 2, 3] if paged_kernel else [1, 3, 0, 2]  # the flat batch: decodes first (the kernel: all)
    rows = sum(QUERY_LENS)
    q = torch.randn(rows, HEADS, head_size, generator=g)
    k, v = torch.randn(rows, KV_HEADS, head_size, generator=g), torch.randn(rows, KV_HEADS, head_size, generator=g)
    write_kv_cache(k, v, k_cache, v_cache, inputs.attn.slot_mapping)
    sinks = torch.nn.Parameter(sinks_for(HEADS, g), requires_grad=False)
    attention = PagedAttention(HEADS, KV_HEADS, head_size, head_size**-0.5, sliding_window=window, sinks=sinks)
    out = attention(q, k, v, k_cache, v_cache, inputs.attn).view(rows, HEADS, head_size)
    row = 0
    for i in order:
        table = torch.tensor(TABLES[i])
        for j in range(QUERY_LENS[i]):
            p = STARTS[i] + j
            first = max(0, p - window + 1) if window else 0
            expected = reference_row(q[row], gather(k_cache, table, first, p), gather(v_cache, table, first, p),
                                     sinks.data, head_size**-0.5)
            torch.testing.assert_close(out[row].double(), expected, rtol=1e-5, atol=1e-5, msg=f"seq {i} row {j}")
            row += 1


def test_paged_attention_refuses_sinks_that_are_not_one_float32_per_head() -> None:
    with pytest.raises(ValueError, match=r"sinks \(3,\) torch.float32 must be \(4,\) float32"):
        PagedAttention(4, 2, 8, 0.25, sinks=torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match="must be"):
        PagedAttention(4, 2, 8, 0.25, sinks=torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)))
