"""The compiled CPU kernels (worker/kernels/cpu_linear.cpp) against float64 references."""

from __future__ import annotations

import shutil

import pytest
import torch

from worker.kernels import _cpu_supports_avx2, cpu_kernels_available

needs_kernels = pytest.mark.skipif(
    not (_cpu_supports_avx2() and shutil.which("c++")), reason="needs an AVX2 CPU and a C++ compiler"
)

# K: multiples of 16 and 8, and odd tails; N: whole tiles of 4 and short last tiles; M: 1, 2, odd, > 64,
# and every remainder of the AVX-512 path's groups of 6 rows and the AVX2 path's groups of 3. M = 1 to 8
# take the streamed GEMV on AVX-512 and M = 1 to 4 on AVX2, float32 and int8 (K: its 16- or 8-float
# steps and a scalar tail; N: each thread's rows in 2 or 4 streams, with rows left over to stream
# alone, and fewer rows than streams); M = 200 is cut into blocks of 96 rows and a last one of 8.
SHAPES = [(1, 64, 8), (2, 517, 37), (3, 24, 5), (16, 512, 1024), (17, 1536, 3), (70, 40, 130), (13, 33, 9),
          (11, 16, 6), (1, 48, 7), (2, 40, 9), (4, 81, 11), (200, 24, 10), (1, 512, 203), (2, 96, 45), (4, 100, 66),
          (5, 64, 31), (6, 100, 45), (8, 512, 203), (9, 40, 13)]


@pytest.fixture(params=["avx512", "avx2"])
def isa(request: pytest.FixtureRequest):
    """Run a linear test on each vector path this CPU has (an AVX-512 CPU runs both)."""
    assert cpu_kernels_available()
    if not torch.ops.tpserve_cpu.use_avx512(request.param == "avx512") and request.param == "avx512":
        pytest.skip("this CPU has no AVX-512 (the AVX2 case covers it)")
    yield request.param
    torch.ops.tpserve_cpu.use_avx512(True)


@needs_kernels
def test_the_kernels_build_on_this_machine() -> None:
    assert cpu_kernels_available()


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_linear_f32_matches_float64(m: int, k: int, n: int, threads: int, isa: str) -> None:
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = torch.ops.tpserve_cpu.linear_f32(x, w, b)
        y_nobias = torch.ops.tpserve_cpu.linear_f32(x, w, None)
    finally:
        torch.set_num_threads(before)
    expected = x.double() @ w.double().t()
    assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
    tol = 1e-6 * k**0.5 * 4
    torch.testing.assert_close(y_nobias.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(y.double(), expected + b.double(), rtol=tol, atol=tol)


@needs_kernels
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_linear_int8_matches_the_dequantized_product(m: int, k: int, n: int, isa: str) -> None:
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(m + k * 7 + n)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale, b = torch.rand(n, generator=g) / 127, torch.randn(n, generator=g)
    y = torch.ops.tpserve_cpu.linear_int8(x, q, scale, b)
    expected = (x.double() @ q.double().t()) * scale.double() + b.double()
    tol = 1e-6 * k**0.5 * 4
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_linear_w16_gives_the_bits_of_linear_f32_on_the_widened_weight(m: int, k: int, n: int, dtype: torch.dtype,
                                                                       isa: str) -> None:
    """16-bit weights are widened exactly as they are read, on the same paths in the same order as float32
    (the streamed GEMV, the tiles, the scalar tails): every output equals linear_f32's on ``w.float()``."""
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(m * 31 + k + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
    for bias in (b, None):
        y = torch.ops.tpserve_cpu.linear_w16(x, w, bias)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert torch.equal(y, torch.ops.tpserve_cpu.linear_f32(x, w.float(), bias))
    tol = 1e-6 * k**0.5 * 4
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), rtol=tol, atol=tol)


@needs_kernels
def test_bad_inputs_are_refused_with_the_reason() -> None:
    assert cpu_kernels_available()
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="K=9"):
        torch.ops.tpserve_cpu.linear_f32(x, torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tpserve_cpu.linear_f32(x, torch.randn(8, 4).t(), None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tpserve_cpu.linear_f32(x.double(), w.double(), None)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.tpserve_cpu.linear_int8(x, w, torch.ones(4), None)
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.tpserve_cpu.linear_int8(x, w.to(torch.int8), torch.ones(3), None)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        torch.ops.tpserve_cpu.linear_w16(x, w, None)


@needs_kernels
@pytest.mark.parametrize("head_size", [16, 32, 64, 80, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 4), (4, 4), (8, 1)])
@pytest.mark.parametrize("query_lens", [(1, 1, 1, 1, 1), (1, 5, 3, 16, 2)])  # decodes; short causal chunks
def test_paged_attention_matches_sdpa_over_the_gathered_context(
    head_size: int, num_heads: int, num_kv_heads: int, query_lens: tuple[int, ...]
) -> None:
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(head_size + num_heads * 10 + num_kv_heads)
    num_seqs, block_size, num_blocks, max_blocks = 5, 16, 40, 10
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    context_lens = torch.tensor([1, 17, 33, 100, 160])  # one token, block edges + 1, a full table
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(num_seqs)])
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    rows = int(starts[-1])
    # Queries as attention gets them: a view into the rotated q/k rows, not contiguous per row.
    qk = torch.randn(rows, num_heads + num_kv_heads, head_size, generator=g) * 3
    q = qk[:, :num_heads]
    out = torch.ops.tpserve_cpu.paged_attention(q, k_cache, v_cache, tables, starts, context_lens, head_size**-0.5)
    assert out.shape == (rows, num_heads, head_size) and out.is_contiguous()
    for s in range(num_seqs):
        n, length = query_lens[s], int(context_lens[s])
        k = k_cache[tables[s]].reshape(-1, num_kv_heads, head_size)[:length].transpose(0, 1).double()  # (KVH, L, d)
        v = v_cache[tables[s]].reshape(-1, num_kv_heads, head_size)[:length].transpose(0, 1).double()
        causal = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]  # (n, L)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[starts[s] : starts[s + 1]].transpose(0, 1).double(), k, v, attn_mask=causal, scale=head_size**-0.5,
            enable_gqa=True,
        ).transpose(0, 1)  # (n, H, d)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]].double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_paged_attention_refuses_a_context_past_its_block_table() -> None:
    assert cpu_kernels_available()
    k_cache = torch.randn(4, 16, 2, 64)
    tables, starts = torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="context length 33"):
        torch.ops.tpserve_cpu.paged_attention(torch.randn(1, 2, 64), k_cache, k_cache, tables, starts,
                                              torch.tensor([33]), 0.125)
    with pytest.raises(RuntimeError, match="head_dim 48"):
        torch.ops.tpserve_cpu.paged_attention(torch.randn(1, 2, 48), torch.randn(4, 16, 2, 48),
                                              torch.randn(4, 16, 2, 48), tables, starts, torch.tensor([3]), 0.125)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        torch.ops.tpserve_cpu.paged_attention(torch.randn(2, 2, 64), k_cache, k_cache, tables, starts,
                                              torch.tensor([3]), 0.125)


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, in float64."""
    x = x.double()
    return w.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernels
@pytest.mark.parametrize(("rows", "hidden"), [(1, 512), (5, 72), (33, 13)])
def test_rms_norm_and_its_fused_residual_add_match_the_reference(rows: int, hidden: int) -> None:
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(rows * hidden)
    x, residual = torch.randn(rows, hidden, generator=g) * 4, torch.randn(rows, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    torch.testing.assert_close(torch.ops.tpserve_cpu.rms_norm(x, w, 1e-5).double(), _torch_rms_norm(x, w, 1e-5),
                               rtol=1e-5, atol=1e-5)
    total, normed = torch.ops.tpserve_cpu.add_rms_norm(residual, x, w, 1e-6)
    assert torch.equal(total, residual + x)  # one float32 add, the same rounding
    torch.testing.assert_close(normed.double(), _torch_rms_norm(residual + x, w, 1e-6), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_silu_and_mul_matches_torch_over_the_whole_float_range() -> None:
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.randn(3, 37, generator=g) * 10, torch.tensor([[-200.0, -88.5, 0.0, 88.5, 200.0] * 7 + [1, 2]])])
    up = torch.randn(4, 37, generator=g)
    out = torch.ops.tpserve_cpu.silu_and_mul(torch.cat([gate, up], dim=1))
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(out).all()


@needs_kernels
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size"), [(8, 4, 64), (4, 1, 16), (2, 2, 6)])
def test_rotary_and_cache_equals_apply_rotary_then_the_cache_write(num_heads: int, num_kv_heads: int,
                                                                   head_size: int) -> None:
    from worker.attention import write_kv_cache
    from worker.layers.rotary import RotaryEmbedding, apply_rotary

    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(head_size)
    tokens, slots = 6, torch.tensor([5, 0, 17, 3, 30, 9])
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g)
    cos, sin = RotaryEmbedding(head_size, 10000.0, None, torch.device("cpu"))(torch.tensor([0, 1, 7, 100, 3, 2048]),
                                                                             torch.float32)
    caches = [torch.zeros(4, 8, num_kv_heads, head_size) for _ in range(4)]
    view = qkv.view(tokens, -1, head_size)
    qk = apply_rotary(view[:, : num_heads + num_kv_heads], cos, sin)
    v = view[:, num_heads + num_kv_heads :]
    write_kv_cache(qk[:, num_heads:], v, caches[0], caches[1], slots)
    fused = qkv.clone()
    torch.ops.tpserve_cpu.rotary_and_cache(fused, cos, sin, caches[2], caches[3], slots, num_heads, num_kv_heads)
    fused_view = fused.view(tokens, -1, head_size)
    assert torch.equal(fused_view[:, : num_heads + num_kv_heads], qk)  # the same roundings, bit for bit
    assert torch.equal(fused_view[:, num_heads + num_kv_heads :], v)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    with pytest.raises(RuntimeError, match="slot 32 outside"):
        torch.ops.tpserve_cpu.rotary_and_cache(fused, cos, sin, caches[2], caches[3], slots + 2, num_heads,
                                               num_kv_heads)


@needs_kernels
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size"), [(8, 4, 64), (4, 1, 16), (2, 2, 6)])
def test_qk_norm_rotary_and_cache_equals_the_per_head_norm_then_the_rotation(num_heads: int, num_kv_heads: int,
                                                                            head_size: int) -> None:
    """The fused QK-norm (Qwen3) against ``rotate_and_cache``'s torch path: RMSNorm per head, rotate, write."""
    import worker.layers.rotary as rotary
    from worker.layers.norm import RMSNorm

    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(head_size)
    tokens, slots = 6, torch.tensor([5, 0, 17, 3, 30, 9])
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g) * 3
    cos, sin = rotary.RotaryEmbedding(head_size, 10000.0, None, torch.device("cpu"))(
        torch.tensor([0, 1, 7, 100, 3, 2048]), torch.float32)
    norms = []
    for _ in range(2):
        norm = RMSNorm(head_size, 1e-6, dtype=torch.float32, device=torch.device("cpu"))
        norm.weight.data = 1 + 0.3 * torch.randn(head_size, generator=g)
        norms.append(norm)
    caches = [torch.zeros(4, 8, num_kv_heads, head_size) for _ in range(4)]
    reference_qkv = qkv.clone()  # the compiled path works in place
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rotary, "cpu_kernels_available", lambda: False)
        want = rotary.rotate_and_cache(reference_qkv, cos, sin, caches[0], caches[1], slots, num_heads, num_kv_heads,
                                       qk_norm=(norms[0], norms[1]))
    got = rotary.rotate_and_cache(qkv, cos, sin, caches[2], caches[3], slots, num_heads, num_kv_heads,
                                  qk_norm=(norms[0], norms[1]))
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    plain = rotary.apply_rotary(reference_qkv.view(tokens, -1, head_size)[:, :num_heads], cos, sin)
    assert not torch.allclose(got[0], plain, atol=1e-2)  # the norm did something
    torch.testing.assert_close(caches[2], caches[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[3], caches[1])  # values are copied, untouched
    assert caches[2].abs().sum() > 0
