"""The grouped expert GEMM in Triton (worker/kernels/triton_moe.py) against the CPU path.

Runs on CUDA where there is one, otherwise on CPU tensors in Triton's interpreter
(tests/worker/conftest.py sets ``TRITON_INTERPRET=1`` before Triton is imported).
"""

from __future__ import annotations

import pytest
import torch

from worker.kernels.triton_moe import align_rows, grouped_experts_triton
from worker.layers.moe import select_experts
from worker.layers.moe_experts import grouped_experts_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_rows_groups_every_row_once_by_expert() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]])  # 8 rows; expert 1 has one row, 4 and 5 none
    sorted_rows, block_expert = align_rows(ids, num_experts=6, block_m=4)
    assert sorted_rows.shape[0] % 4 == 0 and sorted_rows.shape[0] >= 8 + 6 * 3
    flat = ids.reshape(-1)
    blocks = sorted_rows.view(-1, 4).tolist()
    seen = []
    for rows, expert in zip(blocks, block_expert.tolist()):
        real = [r for r in rows if r < 8]
        if expert < 0:
            assert real == []
            continue
        assert real and all(flat[r] == expert for r in real)
        seen += real
    assert sorted(seen) == list(range(8))
    assert block_expert.tolist()[:4] == [0, 1, 2, 3]  # one block each, in expert order; then unused


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (19, 8, 2), (40, 16, 4), (70, 2, 2)])
def test_triton_experts_equal_the_grouped_torch_path(num_tokens: int, num_experts: int, top_k: int) -> None:
    """Decode-sized steps (16-row blocks) and a prefill-sized one (140 rows over 2 experts: 64-row blocks)."""
    g = torch.Generator().manual_seed(num_tokens)
    hidden, inter = 48, 40  # neither a multiple of the kernel's blocks: the masks matter
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    x = torch.randn(num_tokens, hidden, generator=g)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, True)
    expected = grouped_experts_torch(x, gate_up, down, ids, weights)
    got = grouped_experts_triton(*(t.to(DEVICE) for t in (x, gate_up, down, ids, weights)))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_tokens", "tp", "rank"), [(1, 2, 1), (19, 2, 0), (40, 4, 3), (140, 4, 1)])
def test_triton_experts_skip_other_ranks_experts(num_tokens: int, tp: int, rank: int) -> None:
    """Expert parallelism: a rank's stack holds ``E / tp`` experts and ids equal to ``E / tp`` are other ranks'.

    The kernel's output equals the torch path's over the same local ids, and the sum over
    ranks equals the whole layer's (one process, every rank's stack in turn).
    """
    num_experts, top_k, hidden, inter = 8, 2, 48, 40
    g = torch.Generator().manual_seed(num_tokens)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    x = torch.randn(num_tokens, hidden, generator=g)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, True)
    per_rank = num_experts // tp

    def partial(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = ids - r * per_rank
        local = torch.where((local >= 0) & (local < per_rank), local, per_rank)
        stack = slice(r * per_rank, (r + 1) * per_rank)
        args = (x, gate_up[stack].contiguous(), down[stack].contiguous(), local, weights)
        got = grouped_experts_triton(*(t.to(DEVICE) for t in args), has_remote=True).cpu()
        return got, grouped_experts_torch(*args)

    got, expected = partial(rank)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    whole = grouped_experts_torch(x, gate_up, down, ids, weights)
    torch.testing.assert_close(sum(partial(r)[0] for r in range(tp)), whole, rtol=1e-5, atol=1e-5)
