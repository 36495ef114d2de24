"""The MoE block (worker/layers/moe.py) against ``transformers``' sparse MoE blocks, rank by rank.

Each ``transformers`` block (Mixtral, Qwen3-MoE with and without ``norm_topk_prob``,
Qwen2-MoE with its shared expert) gets seeded random weights; its experts are
split into the per-expert tensors a checkpoint stores and loaded into our block
for rank ``r`` of a ``tp``-way group whose all-reduce does nothing, through the
checkpoint-name mapping and the weight loaders. The ranks' partials must sum to
``transformers``' output. Multi-process runs of whole models are in
tests/worker/test_moe_models.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.shard_fakes import ShardOnlyContext
from worker.layers.moe import (
    MIXTRAL_EXPERT_NAMES,
    QWEN_EXPERT_NAMES,
    FusedMoE,
    expert_checkpoint_name,
    expert_weight_map,
    is_sparse_layer,
    select_experts,
)
from worker.layers.moe_experts import grouped_experts_torch
from tests.worker.moe_blocks import EXPERTS, HIDDEN, INTER, TOP_K, checkpoint_tensors, hf_block, our_block

CASES = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False), ("qwen2_moe", True)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("family", "norm_topk_prob"), CASES)
def test_block_matches_transformers(family: str, norm_topk_prob: bool, tp: int) -> None:
    hf = hf_block(family, norm_topk_prob)
    names = MIXTRAL_EXPERT_NAMES if family == "mixtral" else QWEN_EXPERT_NAMES
    checkpoint = checkpoint_tensors(hf, names)
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x.unsqueeze(0)).squeeze(0)  # (24, H)
        got = sum(our_block(family, norm_topk_prob, r, tp, checkpoint, names)(x) for r in range(tp))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_routing_matches_transformers_router() -> None:
    """Same experts, same weights as Mixtral's and Qwen3's routers, for 64 random tokens."""
    for family, norm in (("mixtral", True), ("qwen3_moe", False)):
        hf = hf_block(family, norm)
        x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            logits, hf_weights, hf_ids = hf.gate(x)
        weights, ids = select_experts(logits, TOP_K, renormalize=norm)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights.float(), rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert() -> None:
    """Equal probabilities: the lower expert index ranks first, alone and in a batch."""
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0], [2.0, 0.5, 2.0, 0.5]])
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [0, 2]]
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))
    assert select_experts(logits[1:], 2, renormalize=True)[1].tolist() == [[0, 2]]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_token_alone_equals_token_in_a_batch_of_16(family: str) -> None:
    """Batch invariance: each token's experts are identical alone and among 16; its output matches to 1e-6.

    The experts are exact (float64 router logits rounded once, stable ties); the output
    may differ in the last bits only because the experts' GEMMs see groups of another size.
    """
    names = MIXTRAL_EXPERT_NAMES if family == "mixtral" else QWEN_EXPERT_NAMES
    block = our_block(family, False, 0, 1, checkpoint_tensors(hf_block(family, False), names), names)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        batch = block(x)
        routed = block.experts.take_routed_counts()
        alone = torch.cat([block(x[i:i + 1]) for i in range(16)])
        routed_alone = block.experts.take_routed_counts()
        from worker.layers.moe import router_logits

        ids_batch = select_experts(router_logits(x, block.gate.weight), TOP_K, False)[1]
        ids_alone = torch.cat([select_experts(router_logits(x[i:i + 1], block.gate.weight), TOP_K, False)[1]
                               for i in range(16)])
    assert torch.equal(ids_batch, ids_alone)
    assert torch.equal(routed, routed_alone)
    torch.testing.assert_close(alone, batch, rtol=1e-6, atol=1e-6)


def test_routed_counts_sum_to_tokens_times_top_k() -> None:
    block = our_block("mixtral", True, 0, 1, checkpoint_tensors(hf_block("mixtral"), MIXTRAL_EXPERT_NAMES),
                       MIXTRAL_EXPERT_NAMES)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        block(x[:15])
        block(x[15:])
        _, ids = select_experts(x.double() @ block.gate.weight.double().T, TOP_K, True)
    counts = block.experts.take_routed_counts()
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=EXPERTS).tolist()
    assert int(counts.sum()) == 40 * TOP_K
    assert block.experts.take_routed_counts().tolist() == [0] * EXPERTS  # taken, so reset


def test_grouped_experts_equals_a_loop_over_tokens() -> None:
    """The grouped path against the plain definition: each token through its k experts, one at a time."""
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    x = torch.randn(9, HIDDEN, generator=g)
    weights, ids = select_experts(torch.randn(9, EXPERTS, generator=g), 3, True)
    expected = torch.zeros(9, HIDDEN)
    for t in range(9):
        for j in range(3):
            gate, up = (gate_up[ids[t, j]] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (down[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(grouped_experts_torch(x, gate_up, down, ids, weights), expected, rtol=1e-5, atol=1e-5)


def test_expert_names_round_trip() -> None:
    name = "model.layers.3.block_sparse_moe.experts.5.w3.weight"
    param, shard = expert_weight_map(name, MIXTRAL_EXPERT_NAMES)
    assert (param, shard) == ("model.layers.3.block_sparse_moe.experts.gate_up_proj", (5, "up"))
    assert expert_checkpoint_name(param, shard, MIXTRAL_EXPERT_NAMES) == name
    assert expert_weight_map("model.layers.3.mlp.gate.weight", QWEN_EXPERT_NAMES) is None
    assert expert_weight_map("model.layers.3.mlp.shared_expert.gate_proj.weight", QWEN_EXPERT_NAMES) is None


def test_bad_shapes_int4_and_stored_int8_are_refused() -> None:
    ctx = ShardOnlyContext(tp_rank=0, tp_size=2, device=torch.device("cpu"))
    moe = FusedMoE(EXPERTS, HIDDEN, INTER, ctx, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expected \[48, 32\]"):
        moe.weight_loader(moe.gate_up_proj, torch.zeros(INTER, HIDDEN + 1), (0, "gate"))
    with pytest.raises(ValueError, match="moe_intermediate_size=48 is not divisible by tensor_parallel_size=5"):
        FusedMoE(EXPERTS, HIDDEN, INTER, ShardOnlyContext(tp_rank=0, tp_size=5, device=torch.device("cpu")),
                 dtype=torch.float32)
    with pytest.raises(ValueError, match="--quantization int4 experts need this rank's moe_intermediate_size to be "
                                         "a multiple of 32, got 24"):  # 48 / tp 2: the int4 kernel's blocks of 32
        FusedMoE(EXPERTS, HIDDEN, INTER, ctx, dtype=torch.float32, quantization="int4")
    # The hint's --enable-expert-parallel says what it does not change: a shared expert still splits its width.
    with pytest.raises(ValueError, match="--enable-expert-parallel \\(whole experts per rank; a shared expert's"):
        FusedMoE(EXPERTS, HIDDEN, INTER, ctx, dtype=torch.float32, quantization="int4")
    with pytest.raises(ValueError, match="--quantization fp4 is not supported for mixture-of-experts models"):
        FusedMoE(EXPERTS, HIDDEN, INTER, ctx, dtype=torch.float32, quantization="fp4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--quantization int8 is not supported for mixture-of-experts models whose "
                                         "experts are experts with biases"):  # gpt-oss's biased experts
        FusedMoE(EXPERTS, HIDDEN, INTER, ctx, dtype=torch.float32, quantization="int8", bias=True)
    int8 = FusedMoE(EXPERTS, HIDDEN, INTER, ctx, dtype=torch.float32, quantization="int8")
    with pytest.raises(ValueError, match="int8 expert weights stored in the checkpoint are not supported"):
        int8.weight_loader(int8.gate_up_proj, torch.zeros(INTER, HIDDEN, dtype=torch.int8), (0, "gate"))


def test_qwen_sparse_layers_follow_step_and_exceptions() -> None:
    assert [is_sparse_layer(i, 8, 1, []) for i in range(4)] == [True] * 4
    assert [is_sparse_layer(i, 8, 2, []) for i in range(4)] == [False, True, False, True]
    assert [is_sparse_layer(i, 8, 1, [0, 2]) for i in range(4)] == [False, True, False, True]
    assert not any(is_sparse_layer(i, 0, 1, []) for i in range(4))
    with pytest.raises(ValueError, match="decoder_sparse_step=0 must be >= 1"):
        is_sparse_layer(0, 8, 0, [])
