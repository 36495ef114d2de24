"""Seeded ``transformers`` sparse MoE blocks and our blocks loaded from their tensors, rank by rank
(shared by tests/worker/test_moe_layer.py and tests/worker/test_expert_parallel_layer.py).
"""

from __future__ import annotations

import torch

from tests.worker.shard_fakes import ShardOnlyContext
from worker.layers.moe import SparseMoeBlock, expert_weight_map

HIDDEN, EXPERTS, TOP_K, INTER, SHARED_INTER = 32, 8, 2, 48, 64


def hf_block(family: str, norm_topk_prob: bool = True) -> torch.nn.Module:
    """A ``transformers`` sparse MoE block with seeded random weights, float32."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                                    num_local_experts=EXPERTS, num_experts_per_tok=TOP_K))
    elif family == "qwen3_moe":
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER,
                                                      num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                                      norm_topk_prob=norm_topk_prob))
    else:
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER,
                                                      shared_expert_intermediate_size=SHARED_INTER,
                                                      num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                                      norm_topk_prob=norm_topk_prob))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return block.float().eval()


def checkpoint_tensors(block: torch.nn.Module, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """The block's tensors as a checkpoint names them: one gate/up/down per expert."""
    tensors = {}
    for name, value in block.state_dict().items():
        if name == "experts.gate_up_proj":
            for e in range(EXPERTS):
                tensors[f"experts.{e}.{names[0]}.weight"] = value[e, :INTER]
                tensors[f"experts.{e}.{names[1]}.weight"] = value[e, INTER:]
        elif name == "experts.down_proj":
            for e in range(EXPERTS):
                tensors[f"experts.{e}.{names[2]}.weight"] = value[e]
        else:
            tensors[name] = value
    return tensors


def our_block(family: str, norm_topk_prob: bool, rank: int, tp: int, checkpoint: dict[str, torch.Tensor],
               names: tuple[str, str, str], expert_parallel: bool = False) -> SparseMoeBlock:
    """Rank ``rank``'s block, loaded from ``checkpoint`` through the mapping and every parameter's loader."""
    ctx = ShardOnlyContext(tp_rank=rank, tp_size=tp, device=torch.device("cpu"), enable_expert_parallel=expert_parallel)
    block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, INTER, ctx, torch.float32,
                           renormalize=family == "mixtral" or norm_topk_prob, weights_in_dtype=family != "mixtral",
                           shared_expert_intermediate_size=SHARED_INTER if family == "qwen2_moe" else 0)
    params = dict(block.named_parameters())
    loaded = set()
    for name, tensor in checkpoint.items():
        param_name, shard_id = parameter_for(name, names)
        param = params[param_name]
        assert shard_id in param.shard_ids
        param.weight_loader(param, tensor, shard_id)
        loaded.add((param_name, shard_id))
    assert loaded == {(n, s) for n, p in params.items() for s in p.shard_ids}  # every shard, once
    return block


def parameter_for(name: str, names: tuple[str, str, str]) -> tuple[str, object]:
    """The experts' mapping, then the shared expert's fused gate/up (as the model files map them)."""
    mapped = expert_weight_map(name, names)
    if mapped is not None:
        return mapped
    parts = name.split(".")
    for checkpoint_module, shard in (("gate_proj", 0), ("up_proj", 1)):
        if checkpoint_module in parts:
            parts[parts.index(checkpoint_module)] = "gate_up_proj"
            return ".".join(parts), shard
    return name, None
