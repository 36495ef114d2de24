"""Expert parallelism in the MoE layer (worker/layers/moe.py), rank by rank in one process.

With ``enable_expert_parallel`` rank ``r`` of a ``tp``-way group holds experts
``[r * E / tp, (r + 1) * E / tp)`` whole. Here each rank's block is loaded from a
``transformers`` block's tensors (tests/worker/moe_blocks.py) in a group
whose all-reduce does nothing: the ranks' partials must sum to ``transformers``'
output, each rank's expert stacks must be exactly its experts' checkpoint tensors,
and its loader must read no other expert's bytes. The Triton kernel's handling of
other ranks' rows is in tests/worker/test_triton_moe.py; whole models in
tests/worker/test_expert_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.shard_fakes import RecordingSource, ShardOnlyContext
from tests.worker.moe_blocks import EXPERTS, HIDDEN, INTER, SHARED_INTER, checkpoint_tensors, hf_block, our_block
from worker.layers.moe import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, FusedMoE, expert_weight_map
from worker.layers.moe_experts import grouped_experts_torch


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(("family", "norm_topk_prob"), [("mixtral", True), ("qwen3_moe", False), ("qwen2_moe", True)])
def test_expert_parallel_block_matches_transformers(family: str, norm_topk_prob: bool, tp: int) -> None:
    """Sum of the ranks' partials = ``transformers``' block (Qwen2-MoE's shared expert stays split by tp)."""
    hf = hf_block(family, norm_topk_prob)
    names = MIXTRAL_EXPERT_NAMES if family == "mixtral" else QWEN_EXPERT_NAMES
    checkpoint = checkpoint_tensors(hf, names)
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(1))
    blocks = [our_block(family, norm_topk_prob, r, tp, checkpoint, names, expert_parallel=True) for r in range(tp)]
    with torch.no_grad():
        expected = hf(x.unsqueeze(0)).squeeze(0)  # (24, H)
        got = sum(block(x) for block in blocks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    per_rank = EXPERTS // tp
    for rank, block in enumerate(blocks):
        experts = block.experts
        assert experts.gate_up_proj.shape == (per_rank, 2 * INTER, HIDDEN)  # whole experts, not I / tp
        assert experts.down_proj.shape == (per_rank, HIDDEN, INTER)
        for slot in range(per_rank):
            e = rank * per_rank + slot
            assert torch.equal(experts.gate_up_proj[slot, :INTER], checkpoint[f"experts.{e}.{names[0]}.weight"])
            assert torch.equal(experts.gate_up_proj[slot, INTER:], checkpoint[f"experts.{e}.{names[1]}.weight"])
            assert torch.equal(experts.down_proj[slot], checkpoint[f"experts.{e}.{names[2]}.weight"])
        if block.shared_expert is not None:  # tensor-parallel as without the flag
            assert block.shared_expert.gate_up_proj.weight.shape == (2 * SHARED_INTER // tp, HIDDEN)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_only_its_experts(tp: int) -> None:
    """Every expert tensor is offered to every rank (the loader's completeness check); only the owner reads it."""
    hf = hf_block("mixtral")
    checkpoint = checkpoint_tensors(hf, MIXTRAL_EXPERT_NAMES)
    for rank in range(tp):
        moe = FusedMoE(EXPERTS, HIDDEN, INTER, ShardOnlyContext(tp_rank=rank, tp_size=tp, device=torch.device("cpu"),
                                                                enable_expert_parallel=True), dtype=torch.float32)
        read = set()
        for name, tensor in checkpoint.items():
            target = expert_weight_map(name, MIXTRAL_EXPERT_NAMES)
            if target is None:
                continue
            source = RecordingSource(tensor)
            param = getattr(moe, target[0].rsplit(".", 1)[-1])
            assert target[1] in param.shard_ids
            moe.weight_loader(param, source, target[1])
            if source.reads:
                read.add(target[1][0])
                assert source.reads == [(slice(0, tensor.shape[0]), slice(None))] or \
                    source.reads == [(slice(None), slice(0, tensor.shape[1]))]  # the whole tensor, once
        assert read == set(range(rank * EXPERTS // tp, (rank + 1) * EXPERTS // tp))
        held = sum(p.numel() * p.element_size() for p in moe.parameters())
        assert held == sum(t.numel() * t.element_size() for n, t in checkpoint.items() if ".experts." in f".{n}") // tp


def test_other_ranks_rows_add_zero_and_counts_stay_global() -> None:
    """A token whose experts are all on other ranks gets exactly zero here; rank 0 counts every expert's rows."""
    ctx = ShardOnlyContext(tp_rank=0, tp_size=2, device=torch.device("cpu"), enable_expert_parallel=True)
    moe = FusedMoE(EXPERTS, HIDDEN, INTER, ctx, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, HIDDEN, generator=g)
    ids = torch.tensor([[5, 6], [1, 7], [0, 3]])  # rank 0 holds 0..3
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    out = moe(x, ids, weights)
    assert torch.equal(out[0], torch.zeros(HIDDEN))
    only_local = grouped_experts_torch(x[1:2], moe.gate_up_proj, moe.down_proj, torch.tensor([[1, 0]]),
                                       torch.tensor([[0.7, 0.0]]))
    torch.testing.assert_close(out[1:2], only_local, rtol=1e-6, atol=1e-6)
    assert moe.take_routed_counts().tolist() == [1, 1, 0, 1, 0, 1, 1, 1]  # global ids, all ranks' experts


def test_experts_not_divisible_by_the_group_are_refused() -> None:
    ctx = ShardOnlyContext(tp_rank=0, tp_size=4, device=torch.device("cpu"), enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"^num_experts=6 is not divisible by the expert-parallel size "
                                         r"\(tensor_parallel_size=4\)"):
        FusedMoE(6, HIDDEN, INTER, ctx, dtype=torch.float32)
    # The experts' width need not divide: each rank holds whole experts.
    assert FusedMoE(8, HIDDEN, 30, ctx, dtype=torch.float32).down_proj.shape == (2, HIDDEN, 30)
