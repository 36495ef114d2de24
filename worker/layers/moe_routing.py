"""Biased top-k routing (DeepSeek-V3 style): choose experts with a correction bias, weight them without it.

DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437, section 2.1.2, "auxiliary-loss-free
load balancing") routes each token ``x (H,)`` as follows, all in float32:

    s      = score(x @ W_router.T)                 (E,)  score = sigmoid (DeepSeek V3, GLM-4.5, MiniMax-M2)
                                                         or softmax over experts (Ernie 4.5)
    c      = s + e_score_correction_bias           (E,)  used to CHOOSE only
    groups : the E experts split into n_group contiguous groups of E / n_group;
             a group's score is the sum of its two largest c; the topk_group best
             groups are kept, every expert of the others gets c = -inf
    ids    = the top_k experts by c                (k,)
    w      = s[ids]                                (k,)  weights WITHOUT the bias
    w      = w / max(sum(w), norm_min) + ...       when renormalised (see :class:`BiasedTopKRouter`)
    w      = w * routed_scaling_factor

References: ``transformers``' ``DeepseekV3TopkRouter`` (modeling_deepseek_v3.py),
``Glm4MoeTopkRouter`` (modeling_glm4_moe.py, the same math), ``MiniMaxM2TopKRouter``
(one group, always renormalised, logits rounded to the model dtype) and
``Ernie4_5_MoeTopKRouter`` (softmax scores, ``moe_norm_min`` clamp, weights in the model
dtype). The router is held whole on every rank, so every rank picks the same experts;
:class:`worker.layers.moe.SparseMoeBlock` takes it as its ``router``.

Batch invariance, as for the softmax routers (worker/layers/moe.py): the logits are
accumulated in float64 and rounded once, and ties in every ranking are broken by the
lower index (stable sorts), so a token's experts depend on its own hidden state only.
``transformers`` ranks with ``torch.topk(sorted=False)``: the chosen *set* is the same
(barring exact ties), only its order differs, which changes the sum of the experts'
outputs by rounding alone.

Every step here is a fixed-shape tensor op with no host read, so a decode step that
routes this way stays capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.layers.moe import SparseMoeBlock
from worker.layers.weights import CheckpointSource, copy_into, new_parameter, source_shape
from worker.parallel_state import ParallelContext

#: The score functions a biased router applies to its logits.
SCORE_FUNCTIONS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class BiasedRouting:
    """How a biased router turns scores into ``(weights, ids)``; defaults are DeepSeek V3's with one group.

    Attributes:
        top_k: experts per token (``num_experts_per_tok``), ``1 <= top_k``.
        score: ``"sigmoid"`` or ``"softmax"`` (over all experts), applied in float32.
        n_group: expert groups; ``num_experts`` must divide by it.
        topk_group: groups kept per token, ``1 <= topk_group <= n_group``.
        renormalize: divide the chosen weights by their sum (``norm_topk_prob``).
        norm_min: the sum is clamped below at this value first (Ernie's ``moe_norm_min``; 0: no clamp).
        norm_eps: added to the (clamped) sum (DeepSeek/GLM add 1e-20; MiniMax adds nothing).
        routed_scaling_factor: multiplies the final weights.
        logits_in_float32: the router weight, its bias and the logits are float32 (DeepSeek, GLM, Ernie);
            False holds the weight and bias in the model dtype and rounds the logits to it before
            scoring, as MiniMax-M2's router (no float32 modules there) computes them.
        weights_in_dtype: round the final weights to the activation dtype (Ernie); else float32.
    """

    top_k: int
    score: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    norm_min: float = 0.0
    norm_eps: float = 1e-20
    routed_scaling_factor: float = 1.0
    logits_in_float32: bool = True
    weights_in_dtype: bool = False

    def check(self, num_experts: int) -> None:
        """Raise ``ValueError`` naming the config key of an impossible setting for ``num_experts`` experts."""
        if self.score not in SCORE_FUNCTIONS:
            raise ValueError(f"scoring_func={self.score!r} must be one of {', '.join(SCORE_FUNCTIONS)}")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, number of experts={num_experts}]")
        if self.n_group < 1 or num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must be >= 1 and divide the number of experts={num_experts}")
        if self.n_group > 1 and num_experts // self.n_group < 2:
            raise ValueError(f"n_group={self.n_group} leaves fewer than 2 experts per group "
                             f"(a group is scored by its two best experts)")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.topk_group * (num_experts // self.n_group) < self.top_k:
            raise ValueError(f"topk_group={self.topk_group} groups of {num_experts // self.n_group} experts hold "
                             f"fewer than num_experts_per_tok={self.top_k}")


def select_experts_biased(logits: torch.Tensor, correction_bias: torch.Tensor,
                          routing: BiasedRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of the module docstring, from logits.

    Args:
        logits: ``(T, E)`` router logits in float32 (or any float dtype; scored in float32).
        correction_bias: ``(E,)`` ``e_score_correction_bias`` (float32, or the model dtype; added in float32).
        routing: the family's settings (:class:`BiasedRouting`).

    Returns:
        ``(weights (T, top_k) float32, ids (T, top_k) int64)``, best by biased score first.
    """
    num_tokens, num_experts = logits.shape
    logits = logits.float()
    scores = torch.sigmoid(logits) if routing.score == "sigmoid" else torch.softmax(logits, dim=-1)  # (T, E)
    choice = scores + correction_bias  # (T, E)
    if routing.n_group > 1:
        per_group = num_experts // routing.n_group
        grouped = choice.view(num_tokens, routing.n_group, per_group)  # (T, G, E / G)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, G): sum of each group's two best
        kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :routing.topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # (T, G)
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :routing.top_k]  # (T, k)
    weights = scores.gather(1, ids)  # (T, k): without the bias
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True).clamp(min=routing.norm_min) + routing.norm_eps)
    return weights * routing.routed_scaling_factor, ids


class BiasedTopKRouter(nn.Module):
    """The router ``weight (E, H)`` and ``e_score_correction_bias (E,)``, whole on every rank.

    Args:
        hidden_size: ``H``.
        num_experts: ``E``.
        routing: the family's settings; checked against ``E`` here.
        ctx: the tensor-parallel group (for the device).
        dtype: the activation dtype; the weight and the bias are held in float32 when
            ``routing.logits_in_float32`` (``transformers`` keeps these routers in float32), else in ``dtype``.

    Shapes: ``forward(x (T, H))`` -> ``(weights (T, k), ids (T, k) int64)``; weights float32, or
    ``x.dtype`` when ``routing.weights_in_dtype``.

    Raises:
        ValueError: an impossible ``routing`` (the message names the config key).
    """

    def __init__(self, hidden_size: int, num_experts: int, routing: BiasedRouting, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        routing.check(num_experts)
        self.routing = routing
        self.weight = new_parameter((num_experts, hidden_size),
                                    torch.float32 if routing.logits_in_float32 else dtype, ctx.device)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]
        # As transformers keeps them: float32 where the router is (DeepSeek, GLM, Ernie list both in
        # _keep_in_fp32_modules_strict), else the model dtype (MiniMax-M2 rounds its bias to it).
        self.e_score_correction_bias = new_parameter((num_experts,), self.weight.dtype, ctx.device,
                                                     _load_correction_bias)
        self.e_score_correction_bias.shard_ids = (None,)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # float64 accumulation rounded once: the same logits for a row alone or in any batch.
        out_dtype = torch.float32 if self.routing.logits_in_float32 else x.dtype
        logits = F.linear(x.double(), self.weight.double()).to(out_dtype)  # (T, E)
        weights, ids = select_experts_biased(logits, self.e_score_correction_bias, self.routing)
        return (weights.to(x.dtype) if self.routing.weights_in_dtype else weights), ids


def _load_correction_bias(param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
    """Load ``(E,)``, or Ernie's ``(1, E)`` (one row per expert group of its original code), as ``(E,)``."""
    shape = source_shape(source)
    if shape not in ((param.shape[0],), (1, param.shape[0])):
        raise ValueError(f"checkpoint tensor has shape {list(shape)}, expected [{param.shape[0]}] or "
                         f"[1, {param.shape[0]}]")
    copy_into(param.data, source[tuple(slice(None) for _ in shape)].reshape(param.shape))


@dataclass(frozen=True)
class DeepseekMoeDefaults:
    """A DeepSeek-style family's ``transformers`` defaults (a saved config.json omits a key at its default).

    Attributes:
        routing: ``num_experts_per_tok``, ``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``.
        num_experts: ``n_routed_experts``.
        moe_intermediate_size: one routed expert's width.
        n_shared_experts: shared experts (their MLP is ``n_shared_experts * moe_intermediate_size`` wide).
        first_k_dense_replace: leading layers with a dense MLP (``intermediate_size``).
    """

    routing: BiasedRouting
    num_experts: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int


DEEPSEEK_V3_DEFAULTS = DeepseekMoeDefaults(
    BiasedRouting(top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5), num_experts=256,
    moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3)
GLM4_MOE_DEFAULTS = DeepseekMoeDefaults(BiasedRouting(top_k=8), num_experts=128, moe_intermediate_size=1408,
                                        n_shared_experts=1, first_k_dense_replace=1)


def deepseek_routing(config: ModelConfig, num_experts: int, defaults: BiasedRouting) -> BiasedRouting:
    """The :class:`BiasedRouting` of a DeepSeek-V3-style config (DeepSeek V3, Kimi K2, GLM-4.5/4.6).

    Args:
        config: the checkpoint's parsed config.
        num_experts: ``n_routed_experts``.
        defaults: the family's ``transformers`` defaults (e.g. ``DEEPSEEK_V3_DEFAULTS.routing``).

    Keys read: ``num_experts_per_tok``, ``n_group``, ``topk_group``, ``norm_topk_prob``,
    ``routed_scaling_factor``. Scores are sigmoids whatever ``scoring_func`` says, as in ``transformers``.

    Raises:
        ValueError: a value of the wrong type or an impossible one, naming the key.
    """
    routing = BiasedRouting(
        top_k=config.hf_value("num_experts_per_tok", defaults.top_k),
        n_group=config.hf_value("n_group", defaults.n_group),
        topk_group=config.hf_value("topk_group", defaults.topk_group),
        renormalize=config.hf_value("norm_topk_prob", defaults.renormalize),
        routed_scaling_factor=config.hf_value("routed_scaling_factor", defaults.routed_scaling_factor, float),
    )
    routing.check(num_experts)
    return routing


def is_deepseek_moe_layer(config: ModelConfig, layer_index: int, defaults: DeepseekMoeDefaults) -> bool:
    """Whether layer ``layer_index`` has a MoE block: not among the first ``first_k_dense_replace`` (dense MLPs)."""
    return not is_dense_first_layer(layer_index, config.hf_value("first_k_dense_replace",
                                                                 defaults.first_k_dense_replace))


def deepseek_moe_block(config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                       quantization: Quantization | None, defaults: DeepseekMoeDefaults) -> SparseMoeBlock:
    """DeepSeek V3's MoE block (``DeepseekV3MoE``; GLM-4.5's ``Glm4MoeMoE`` is the same): the biased sigmoid
    router, ``n_routed_experts`` routed experts and the ungated shared experts, in one all-reduce.

    Checkpoint names under the block: ``gate.weight``, ``gate.e_score_correction_bias``,
    ``experts.{e}.{gate,up,down}_proj.weight`` (:data:`worker.layers.moe.QWEN_EXPERT_NAMES`),
    ``shared_experts.{gate,up,down}_proj.weight``.

    Raises:
        ValueError: a bad routing key (named). (The experts are float, int8 or int4: worker/layers/moe.py.)
    """
    num_experts = config.hf_value("n_routed_experts", defaults.num_experts)
    routing = deepseek_routing(config, num_experts, defaults.routing)
    width = config.hf_value("moe_intermediate_size", defaults.moe_intermediate_size)
    shared = config.hf_value("n_shared_experts", defaults.n_shared_experts) * width
    router = BiasedTopKRouter(config.hidden_size, num_experts, routing, ctx, dtype)
    return SparseMoeBlock(config.hidden_size, num_experts, routing.top_k, width, ctx, dtype, renormalize=True,
                          weights_in_dtype=False, quantization=quantization, router=router,
                          shared_experts_intermediate_size=shared)


def is_dense_first_layer(layer_index: int, first_k_dense_replace: int) -> bool:
    """Whether DeepSeek-style layer ``layer_index`` keeps a dense MLP: the first ``first_k_dense_replace`` do."""
    return layer_index < first_k_dense_replace
