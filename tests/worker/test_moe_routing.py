"""Biased top-k routing (worker/layers/moe_routing.py) against ``transformers``' own routers and MoE blocks.

The routers of DeepSeek V3, GLM-4.5 (expert groups, correction bias, scaling),
MiniMax-M2 (one group, logits in the model dtype) and Ernie 4.5 (softmax scores,
``moe_norm_min``) get seeded random weights and a random correction bias; ours, loaded
with the same tensors, must choose the same experts (as sets: ``transformers`` ranks with
``topk(sorted=False)``) with the same weights. DeepSeek V3's whole MoE block (routed
plus shared experts) is then compared rank by rank, the ranks' partials summing to
``transformers``' output.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.shard_fakes import ShardOnlyContext
from worker.layers.moe import QWEN_EXPERT_NAMES, SparseMoeBlock, expert_weight_map
from worker.layers.moe_routing import BiasedRouting, BiasedTopKRouter, is_dense_first_layer, select_experts_biased

HIDDEN, EXPERTS, TOP_K, INTER = 32, 16, 4, 24
CPU = ShardOnlyContext(tp_rank=0, tp_size=1, device=torch.device("cpu"))


def _seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter and buffer of ``module`` redrawn from a seeded generator (the bias too)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / max(tensor.shape[-1], 4) ** 0.5)
    return module.float().eval()


def _deepseek_config(**overrides: object):  # type: ignore[no-untyped-def]
    from transformers import DeepseekV3Config

    keys = dict(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, norm_topk_prob=True, moe_intermediate_size=INTER, n_shared_experts=2)
    keys.update(overrides)
    return DeepseekV3Config(**keys)


def _ours(hf_router: torch.nn.Module, routing: BiasedRouting, bias: torch.Tensor) -> BiasedTopKRouter:
    router = BiasedTopKRouter(HIDDEN, EXPERTS, routing, CPU, torch.float32)
    router.weight.weight_loader(router.weight, hf_router.weight.detach(), None)
    router.e_score_correction_bias.weight_loader(router.e_score_correction_bias, bias.detach(), None)
    return router


def _assert_same_routing(ours: tuple[torch.Tensor, torch.Tensor], hf_weights: torch.Tensor,
                         hf_ids: torch.Tensor) -> None:
    """Same expert set per token, and the same weight for each expert."""
    weights, ids = ours
    ids_sorted, order = ids.sort(dim=-1)
    hf_sorted, hf_order = hf_ids.sort(dim=-1)
    assert torch.equal(ids_sorted, hf_sorted)
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-6, atol=1e-7)


X = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_grouped_sigmoid_router_matches_transformers(family: str, norm_topk_prob: bool) -> None:
    """16 experts in 4 groups, 2 groups kept, top 4, scaling 2.5: same experts and weights for 64 tokens."""
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router

        config = _deepseek_config(norm_topk_prob=norm_topk_prob)
    else:
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router

        config = Glm4MoeConfig(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=4,
                               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob)
    hf = _seeded(Router(config), seed=5)
    routing = BiasedRouting(top_k=TOP_K, n_group=4, topk_group=2, renormalize=norm_topk_prob,
                            routed_scaling_factor=2.5)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf(X)
        ours = _ours(hf, routing, hf.e_score_correction_bias)(X)
    _assert_same_routing(ours, hf_weights, hf_ids)
    # The bias and the groups both matter here: without either, some token's experts differ.
    logits = torch.nn.functional.linear(X, hf.weight)
    no_bias = select_experts_biased(logits, torch.zeros(EXPERTS), routing)[1].sort(dim=-1).values
    no_groups = select_experts_biased(logits, hf.e_score_correction_bias,
                                      BiasedRouting(top_k=TOP_K, routed_scaling_factor=2.5))[1].sort(dim=-1).values
    assert not torch.equal(no_bias, hf_ids.sort(dim=-1).values)
    assert not torch.equal(no_groups, hf_ids.sort(dim=-1).values)
    # Every chosen expert lies in one of topk_group groups.
    assert all(len(set((row // (EXPERTS // 4)).tolist())) <= 2 for row in ours[1])


def test_minimax_m2_router_matches_transformers() -> None:
    """One group, always renormalised, no scaling; the bias lives on the block in ``transformers``."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    block = _seeded(MiniMaxM2SparseMoeBlock(MiniMaxM2Config(hidden_size=HIDDEN, intermediate_size=INTER,
                                                            num_local_experts=EXPERTS,
                                                            num_experts_per_tok=TOP_K)), seed=6)
    routing = BiasedRouting(top_k=TOP_K, norm_eps=0.0, logits_in_float32=False)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(X, block.e_score_correction_bias)
        ours = _ours(block.gate, routing, block.e_score_correction_bias)(X)
    _assert_same_routing(ours, hf_weights, hf_ids)


def test_ernie_router_matches_transformers() -> None:
    """Softmax scores, bias to choose, renormalised with the ``moe_norm_min`` clamp, weights in the model dtype."""
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    config = Ernie4_5_MoeConfig(hidden_size=HIDDEN, moe_num_experts=EXPERTS, moe_k=TOP_K, moe_norm_min=1e-12)
    hf = _seeded(Ernie4_5_MoeTopKRouter(config), seed=8)
    bias = hf.moe_statics.e_score_correction_bias  # (1, E), as the checkpoint stores it
    assert bias.shape == (1, EXPERTS)
    routing = BiasedRouting(top_k=TOP_K, score="softmax", norm_min=1e-12, norm_eps=0.0, weights_in_dtype=True)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf(X)
        ours = _ours(hf, routing, bias)(X)
    _assert_same_routing(ours, hf_weights, hf_ids)


@pytest.mark.parametrize("tp", [1, 2])
def test_deepseek_v3_block_matches_transformers(tp: int) -> None:
    """Router, 16 routed experts and 2 shared experts: the ranks' partials sum to ``DeepseekV3MoE``'s output."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf = _seeded(DeepseekV3MoE(_deepseek_config()), seed=9)
    checkpoint = {}
    for name, value in hf.state_dict().items():
        if name == "experts.gate_up_proj":
            for e in range(EXPERTS):
                checkpoint[f"experts.{e}.gate_proj.weight"] = value[e, :INTER]
                checkpoint[f"experts.{e}.up_proj.weight"] = value[e, INTER:]
        elif name == "experts.down_proj":
            checkpoint.update({f"experts.{e}.down_proj.weight": value[e] for e in range(EXPERTS)})
        else:
            checkpoint[name] = value
    assert "gate.e_score_correction_bias" in checkpoint and "shared_experts.gate_proj.weight" in checkpoint
    routing = BiasedRouting(top_k=TOP_K, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    total = torch.zeros(X.shape)
    for rank in range(tp):
        ctx = ShardOnlyContext(tp_rank=rank, tp_size=tp, device=torch.device("cpu"))
        block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, INTER, ctx, torch.float32, renormalize=True,
                               weights_in_dtype=False,
                               router=BiasedTopKRouter(HIDDEN, EXPERTS, routing, ctx, torch.float32),
                               shared_experts_intermediate_size=2 * INTER)
        params = dict(block.named_parameters())
        loaded = set()
        for name, tensor in checkpoint.items():
            mapped = expert_weight_map(name, QWEN_EXPERT_NAMES)
            module = name.split(".")[-2]
            if mapped is None and module in ("gate_proj", "up_proj"):  # the shared experts' fused gate/up
                mapped = (name.replace(f"{module}.weight", "gate_up_proj.weight"), ("gate_proj", "up_proj").index(module))
            elif mapped is None:
                mapped = (name, None)
            param = params[mapped[0]]
            param.weight_loader(param, tensor, mapped[1])
            loaded.add(mapped)
        assert loaded == {(n, s) for n, p in params.items() for s in p.shard_ids}  # every shard, once
        with torch.no_grad():
            total += block(X)
    with torch.no_grad():
        expected = hf(X.unsqueeze(0)).squeeze(0)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_token_alone_equals_token_in_a_batch() -> None:
    """Batch invariance: each token's experts are identical alone and among 64, its weights equal to 1 ulp.

    (The CPU's vectorised sigmoid may round a lone row's last bit otherwise than a batch's.)
    """
    router = BiasedTopKRouter(HIDDEN, EXPERTS, BiasedRouting(top_k=TOP_K, n_group=4, topk_group=2), CPU,
                              torch.float32)
    _seeded(router, seed=10)
    batch = router(X)
    alone = [router(X[i:i + 1]) for i in range(X.shape[0])]
    assert torch.equal(batch[1], torch.cat([ids for _, ids in alone]))
    torch.testing.assert_close(batch[0], torch.cat([w for w, _ in alone]), rtol=3e-7, atol=0.0)


def test_ties_go_to_the_lower_index() -> None:
    """Equal biased scores rank the lower expert first; equal group scores keep the lower group."""
    logits = torch.zeros(1, 8)  # every score 0.5
    weights, ids = select_experts_biased(logits, torch.zeros(8), BiasedRouting(top_k=3, n_group=4, topk_group=2))
    assert ids.tolist() == [[0, 1, 2]]  # groups 0 and 1 kept, then the lower indices
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3))


@pytest.mark.parametrize(("routing", "experts", "field"), [
    (BiasedRouting(top_k=9), 8, "num_experts_per_tok"),
    (BiasedRouting(top_k=2, n_group=3), 8, "n_group"),
    (BiasedRouting(top_k=2, n_group=8), 8, "n_group"),
    (BiasedRouting(top_k=2, n_group=2, topk_group=3), 8, "topk_group"),
    (BiasedRouting(top_k=6, n_group=4, topk_group=2), 8, "topk_group"),
    (BiasedRouting(top_k=2, score="relu"), 8, "scoring_func"),
])
def test_impossible_routing_is_refused_naming_the_field(routing: BiasedRouting, experts: int, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}="):
        routing.check(experts)


def test_dense_first_layers() -> None:
    assert [is_dense_first_layer(i, 2) for i in range(4)] == [True, True, False, False]
