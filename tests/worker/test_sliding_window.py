"""Sliding-window attention and logit soft-capping in every attention path, against a float64 reference.

One step mixes what a window has to survive: a fresh prompt longer than the window, a
continued chunk whose history crosses the window's edge (a prefix-cache hit or the second
chunk of a chunked prefill look the same to attention), a short chunk, and decodes before
and after the window fills. It runs through :class:`PagedAttention` with the metadata
:func:`build_step_inputs` makes for each path: SDPA (torch), the compiled CPU paged kernel,
and the Triton paged decode kernel (in Triton's interpreter on CPU). The reference is
written independently: for the row at position ``p``, keys at positions
``max(0, p - W + 1) .. p`` (``transformers``' ``sliding_window_overlay``: ``kv > q - W``),
float64 scores, ``c * tanh(s / c)`` when soft-capped, softmax.

Cache blocks that lie wholly before a sequence's first window are filled with NaN where the
path promises not to read them (the kernels, and prefill chunks): one read would poison the
output.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tpserve.step import SamplingParams, ScheduledChunk
from worker.attention import PagedAttention, write_kv_cache
from worker.kernels import cpu_kernels_available
from worker.kernels.triton_attention import paged_decode_attention
from worker.step_inputs import build_step_inputs

BLOCK_SIZE = 4
HEADS, KV_HEADS, D = 4, 2, 32
SCALE = D**-0.5
# (start position, tokens) per sequence, in plan order: a fresh 13-token prompt; a 20-token chunk from
# position 9 (history across the window's edge); decodes at 17 and at 2; a 3-token chunk from 10; a
# fresh 4-token prompt.
CHUNKS = [(0, 13), (9, 20), (17, 1), (2, 1), (10, 3), (0, 4)]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int, window: int | None,
               softcap: float | None) -> torch.Tensor:
    """One row: ``q (H, d)`` over ``keys, values (positions, KVH, d)`` float64 -> ``(H, d)``."""
    lo = 0 if window is None else max(0, position - window + 1)
    group = q.shape[0] // keys.shape[1]  # query heads per KV head
    k = keys[lo : position + 1].repeat_interleave(group, dim=1)  # (n, H, d)
    v = values[lo : position + 1].repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * SCALE  # (H, n)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)  # (H, d)


def _run(path: str, window: int | None, softcap: float | None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The step through ``path`` ("sdpa", "kernel", "triton"): ``(out (T, H, d), reference (T, H, d) float64)``."""
    gen = torch.Generator().manual_seed(seed)
    # Block tables: block 0 is never assigned (it pads the SDPA decode tables), the rest shuffled.
    ids = (torch.randperm(60, generator=gen) + 1).tolist()
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
    sdpa_decodes = {i for i, (_, n) in enumerate(CHUNKS) if n == 1} if path == "sdpa" else set()
    for i, (start, _) in enumerate(CHUNKS):
        for p in range(start):  # the history, already cached
            b, o = tables[i][p // BLOCK_SIZE], p % BLOCK_SIZE
            k_cache[b, o], v_cache[b, o] = keys[i][p].float(), values[i][p].float()
        if window is not None and i not in sdpa_decodes:  # blocks no row of this sequence may read
            for b in tables[i][: max(0, start - window + 1) // BLOCK_SIZE]:
                k_cache[b], v_cache[b] = math.nan, math.nan
    rows = [divmod(int(t), 1000) for t in inputs.input_ids]  # (sequence, position) of each row
    q = torch.randn(len(rows), HEADS, D, generator=gen)
    k = torch.stack([keys[i][p] for i, p in rows]).float()  # (T, KVH, d)
    v = torch.stack([values[i][p] for i, p in rows]).float()
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    attention = PagedAttention(HEADS, KV_HEADS, D, SCALE, sliding_window=window, logit_softcap=softcap)
    out = attention(q, k, v, k_cache, v_cache, meta).view(len(rows), HEADS, D)
    expected = torch.stack([_reference(q[r], keys[i], values[i], p, window, softcap) for r, (i, p) in enumerate(rows)])
    return out, expected


PATHS = [
    "sdpa",
    pytest.param("kernel", marks=pytest.mark.skipif(not cpu_kernels_available(), reason="no AVX2 CPU kernels")),
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (4, None), (1, None), (64, None), (None, 1.0), (6, 0.7)])
def test_every_path_matches_the_masked_reference(path: str, window: int | None, softcap: float | None) -> None:
    out, expected = _run(path, window, softcap)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


def test_the_window_changes_the_rows_past_it_only() -> None:
    """A check the test can fail: rows within ``W`` of position 0 equal full attention, later rows do not."""
    windowed, _ = _run("sdpa", 5, None, seed=1)
    full, _ = _run("sdpa", None, None, seed=1)
    inputs = build_step_inputs([ScheduledChunk(i, (0,) * n, s) for i, (s, n) in enumerate(CHUNKS)],
                               [[1] * 8] * len(CHUNKS), [SamplingParams()] * len(CHUNKS), BLOCK_SIZE,
                               torch.device("cpu"))
    near = inputs.attn.positions < 5  # (T,) rows whose window reaches position 0
    torch.testing.assert_close(windowed[near], full[near])
    assert ((windowed - full).abs().amax(dim=(1, 2))[~near] > 1e-3).all()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_flash_decoding_splits_skip_the_blocks_before_the_window() -> None:
    """A context long enough to split (flash-decoding): splits wholly before the window weigh nothing."""
    gen = torch.Generator().manual_seed(3)
    block_size, num_blocks, window = 16, 40, 100
    k_cache = torch.randn(num_blocks, block_size, 1, D, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, 1, D, generator=gen)
    table = torch.randperm(num_blocks, generator=gen).view(1, -1)  # (1, 40): 640 positions, two splits
    length = 630
    first_block = (length - window) // block_size
    k_cache[table[0, :first_block]] = math.nan  # never read
    v_cache[table[0, :first_block]] = math.nan
    q = torch.randn(1, 2, D, generator=gen)
    out = paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([length]), SCALE, sliding_window=window,
                                 logit_softcap=1.5)
    keys = k_cache[table[0]].reshape(-1, 1, D).double()[:length]  # (630, 1, d)
    values = v_cache[table[0]].reshape(-1, 1, D).double()[:length]
    expected = _reference(q[0], keys, values, length - 1, window, 1.5)
    torch.testing.assert_close(out[0].double(), expected, atol=2e-5, rtol=1e-4)


def test_bad_window_or_softcap_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window=0"):
        PagedAttention(HEADS, KV_HEADS, D, SCALE, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap=-1"):
        PagedAttention(HEADS, KV_HEADS, D, SCALE, logit_softcap=-1.0)
