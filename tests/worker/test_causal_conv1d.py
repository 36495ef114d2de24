"""worker/layers/causal_conv1d.py against torch's zero-padded causal conv1d (the reference's form)."""

import torch
import torch.nn.functional as F

from worker.layers.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill
from worker.state_metadata import StateMetadata


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``(L, C)`` through ``nn.Conv1d(groups=C, padding=K-1)`` cut to the first L outputs, then SiLU."""
    channels, kernel = weight.shape
    y = F.conv1d(x.t().unsqueeze(0), weight.unsqueeze(1), bias, padding=kernel - 1, groups=channels)
    return F.silu(y[0, :, : x.shape[0]].t())


def test_chunks_and_decode_steps_equal_the_whole_sequence():
    torch.manual_seed(0)
    channels, kernel, length = 6, 4, 11
    x, weight, bias = torch.randn(length, channels), torch.randn(channels, kernel), torch.randn(channels)
    expected = _reference(x, weight, bias)
    pool = torch.zeros(3, channels, kernel - 1)
    # rows 0-1 (shorter than the window), 2-6 as prefill chunks, then 7-10 one decode step at a time in slot 2
    parts = [causal_conv1d_prefill(x[0:2], weight, bias, pool[2], "silu"),
             causal_conv1d_prefill(x[2:7], weight, bias, pool[2], "silu")]
    slots = torch.tensor([2])
    parts += [causal_conv1d_decode(x[t:t + 1], weight, bias, pool, slots, "silu") for t in range(7, length)]
    torch.testing.assert_close(torch.cat(parts), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[2], x[-(kernel - 1):].t())
    assert pool[0].abs().sum() == 0 and pool[1].abs().sum() == 0  # other slots untouched


def test_segments_split_rows_at_checkpoints():
    meta = StateMetadata(slots=torch.tensor([0, 1]), query_start_loc=(0, 1, 21), num_decodes=1,
                         checkpoints=((), ((8, 5), (16, 6))))
    assert meta.num_seqs == 2
    assert meta.segments(0) == [(0, 1, None)]
    assert meta.segments(1) == [(1, 9, 5), (9, 17, 6), (17, 21, None)]
