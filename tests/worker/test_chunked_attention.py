"""Chunked local attention (Llama 4's ``attention_chunk_size``) in every attention path, against a float64 reference.

The step of tests/worker/test_sliding_window.py (a fresh prompt longer than a chunk, a
continued chunk whose history crosses chunk edges, a short chunk, decodes before and after
an edge) through :class:`PagedAttention` with the metadata :func:`build_step_inputs` makes
for each path: SDPA (torch), the compiled CPU paged kernel's step (its decode group holds a
3-token chunk), and the Triton paged kernel's step (in Triton's interpreter on CPU). The
reference is written independently: the row at position ``p`` attends keys at
``p - p % C .. p`` (``transformers``' ``chunked_overlay``: ``kv // C == q // C``, causal),
float64. Cache blocks wholly before a sequence's first attention chunk are NaN: one read
would poison the output.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tpserve.step import SamplingParams, ScheduledChunk
from worker.attention import PagedAttention, write_kv_cache
from worker.kernels import cpu_kernels_available
from worker.step_inputs import build_step_inputs

BLOCK_SIZE = 4
HEADS, KV_HEADS, D = 4, 2, 32
SCALE = D**-0.5
# (start position, tokens) per sequence: a fresh 13-token prompt; a 20-token chunk from 9; decodes at 17
# and 2; a 3-token chunk from 10 (across the edge at 12 when C = 4 or 6); a fresh 4-token prompt.
CHUNKS = [(0, 13), (9, 20), (17, 1), (2, 1), (10, 3), (0, 4)]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int, chunk: int) -> torch.Tensor:
    """One row: ``q (H, d)`` over ``keys, values (positions, KVH, d)`` float64 -> ``(H, d)``."""
    lo = position // chunk * chunk
    group = q.shape[0] // keys.shape[1]
    k = keys[lo : position + 1].repeat_interleave(group, dim=1)  # (n, H, d)
    v = values[lo : position + 1].repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * SCALE  # (H, n)
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)  # (H, d)


def _run(path: str, chunk: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The step through ``path`` ("sdpa", "kernel", "triton"): ``(out (T, H, d), reference (T, H, d) float64)``."""
    gen = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(60, generator=gen) + 1).tolist()  # block 0 pads the tables: never assigned
    tables = []
    for start, n in CHUNKS:
        count = -(-(start + n) // BLOCK_SIZE)
        tables.append(ids[:count])
        ids = ids[count:]
    chunks = [ScheduledChunk(i, tuple(1000 * i + p for p in range(s, s + n)), s, sample=True)
              for i, (s, n) in enumerate(CHUNKS)]
    inputs = build_step_inputs(chunks, tables, [SamplingParams()] * len(CHUNKS), BLOCK_SIZE, torch.device("cpu"),
                               paged_kernel=path == "kernel", triton_decode=path == "triton")
    meta = inputs.attn
    keys = [torch.randn(s + n, KV_HEADS, D, generator=gen, dtype=torch.float64) for s, n in CHUNKS]
    values = [torch.randn(s + n, KV_HEADS, D, generator=gen, dtype=torch.float64) for s, n in CHUNKS]
    k_cache = torch.zeros(61, BLOCK_SIZE, KV_HEADS, D)
    v_cache = torch.zeros_like(k_cache)
    for i, (start, _) in enumerate(CHUNKS):
        for p in range(start):  # the history, already cached
            b, o = tables[i][p // BLOCK_SIZE], p % BLOCK_SIZE
            k_cache[b, o], v_cache[b, o] = keys[i][p].float(), values[i][p].float()
        for b in tables[i][: start // chunk * chunk // BLOCK_SIZE]:  # before the first row's chunk: never read
            k_cache[b], v_cache[b] = math.nan, math.nan
    rows = [divmod(int(t), 1000) for t in inputs.input_ids]  # (sequence, position) of each row
    q = torch.randn(len(rows), HEADS, D, generator=gen)
    k = torch.stack([keys[i][p] for i, p in rows]).float()  # (T, KVH, d)
    v = torch.stack([values[i][p] for i, p in rows]).float()
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    attention = PagedAttention(HEADS, KV_HEADS, D, SCALE, attention_chunk_size=chunk)
    out = attention(q, k, v, k_cache, v_cache, meta).view(len(rows), HEADS, D)
    expected = torch.stack([_reference(q[r], keys[i], values[i], p, chunk) for r, (i, p) in enumerate(rows)])
    return out, expected


PATHS = [
    "sdpa",
    pytest.param("kernel", marks=pytest.mark.skipif(not cpu_kernels_available(), reason="no AVX2 CPU kernels")),
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunk", [4, 6, 8, 1, 64])
def test_every_path_matches_the_chunked_reference(path: str, chunk: int) -> None:
    out, expected = _run(path, chunk)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


def test_chunks_change_the_rows_past_the_first_chunk_only() -> None:
    """A check the test can fail: rows in chunk 0 equal full attention, rows past it do not."""
    chunked, _ = _run("sdpa", 8, seed=1)
    full, _ = _run("sdpa", 64, seed=1)  # one chunk covers every position: causal attention
    inputs = build_step_inputs([ScheduledChunk(i, (0,) * n, s) for i, (s, n) in enumerate(CHUNKS)],
                               [[1] * 8] * len(CHUNKS), [SamplingParams()] * len(CHUNKS), BLOCK_SIZE,
                               torch.device("cpu"))
    first = inputs.attn.positions < 8
    torch.testing.assert_close(chunked[first], full[first])
    assert ((chunked - full).abs().amax(dim=(1, 2))[~first] > 1e-3).all()


def test_bad_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError, match="attention_chunk_size=0"):
        PagedAttention(HEADS, KV_HEADS, D, SCALE, attention_chunk_size=0)
    with pytest.raises(ValueError, match="without a sliding_window"):
        PagedAttention(HEADS, KV_HEADS, D, SCALE, attention_chunk_size=8, sliding_window=4)
