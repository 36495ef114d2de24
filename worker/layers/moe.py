"""Mixture-of-experts feed-forward layer with tensor-parallel experts (Mixtral, Qwen-MoE, DeepSeek-style).

A sparse MoE block (Shazeer et al. 2017, arXiv:1701.06538; Mixtral: Jiang et al.
2024, arXiv:2401.04088) replaces the dense SwiGLU MLP of a decoder layer:

    logits  = x @ W_router.T                                  (T, E), replicated on every rank
    ids, w  = top_k(softmax(logits))                          (T, k) each; renormalised when asked
    y       = sum_j w[:, j] * down_e(silu(gate_e(x)) * up_e(x)),  e = ids[:, j]
    y      += sigmoid(x @ w_shared_gate) * shared_expert(x)   Qwen2-MoE only
    y      += shared_experts(x)                               DeepSeek V3, GLM-4.5, Ernie 4.5 (ungated)

Families that choose experts with a bias correction and expert groups (DeepSeek V3's
sigmoid routing) pass their router to :class:`SparseMoeBlock`: worker/layers/moe_routing.py.

Tensor parallelism: every rank holds a slice of *every* expert's intermediate
dimension, like the dense MLP (gate/up split by rows, down by columns), so each
rank computes a partial ``y`` for every token and the block ends in ONE all-reduce,
shared expert included (its gate is a per-token scalar, so scaling the partials
before the sum is the same as after). The router is replicated: every rank picks
the same experts.

Expert parallelism (``--enable-expert-parallel``, vLLM's flag; the layout of vLLM,
SGLang and GShard, Lepikhin et al. 2020, arXiv:2006.16668): rank ``r`` of the
tensor-parallel group holds ``E / tp`` WHOLE experts, ``[r * E / tp, (r + 1) * E / tp)``,
and computes only the routed rows of those experts; a row of another rank's expert
contributes zero here. Activations are replicated across the group, so every rank
already has every token and no all-to-all dispatch is needed: the sum of the
ranks' partials, the same single all-reduce, is ``y``. The shared expert and the
dense MLPs stay tensor-parallel. Each expert's GEMMs run at full width ``I``
(not ``I / tp``), and a rank reads only its experts' tensors from the checkpoint.

Stacked parameters of :class:`FusedMoE` (the names ``transformers`` 5 uses):
``gate_up_proj (E, 2 * I / tp, H)`` laid out ``[gate | up]`` per expert, and
``down_proj (E, H, I / tp)``. Checkpoints store one tensor per expert
(``experts.{e}.w1/w3/w2`` for Mixtral, ``experts.{e}.gate_proj/up_proj/down_proj``
for Qwen); :func:`expert_weight_map` names the parameter and the shard
``(e, "gate" | "up" | "down")`` each fills (``transformers`` 5 writes this layout
too, though it stacks the experts in memory).

Batch invariance: a token's experts must not depend on what else is in the step.
The router logits are computed in float64 and rounded to the activation dtype (the
correctly rounded value of each dot product up to float64 error, ~1e-16 relative,
whatever the GEMM's blocking), and ties in top-k are broken by the lower expert
index (a stable sort), so a token's choice is a function of its own hidden state.
The experts' GEMMs do run on groups whose size depends on the batch, so a token's
output may differ in the last bits, as every dense layer's does.

Expert computation (:mod:`worker.layers.moe_experts`): tokens are grouped by expert
(one sort), one GEMM pair per expert on its contiguous group on the CPU, a grouped
Triton kernel on CUDA.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.quantization import Quantization
from worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from worker.layers.linear import divide as _divide
from worker.layers.moe_combine import expert_act
from worker.layers.moe_experts import grouped_experts
from worker.layers.int4_weights import PackedPart
from worker.layers.moe_int4 import load_int4_expert, new_int4_experts
from worker.layers.moe_int8 import check_loadable, load_int8_expert, new_int8_experts, set_scale_shards
from worker.layers.moe_w8 import load_8bit_expert
from worker.layers.norm import SiluAndMul
from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.parallel_state import ParallelContext

#: The kinds of per-expert checkpoint tensors, in the order families name them.
EXPERT_PROJECTIONS = ("gate", "up", "down")
#: Checkpoint module names of (gate, up, down) per family.
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def expert_parallel_share(num_experts: int, tp_size: int) -> int:
    """Whole experts per rank with ``--enable-expert-parallel``: ``num_experts / tp_size``.

    Raises:
        ValueError: ``num_experts`` not divisible by ``tp_size`` (one line naming both fields).
    """
    if num_experts % tp_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size "
                         f"(tensor_parallel_size={tp_size}) of --enable-expert-parallel")
    return num_experts // tp_size


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x (T, H) @ weight (E, H).T [+ bias (E,)]`` -> ``(T, E)`` in ``x.dtype``, the same for a row alone or in any batch.

    Accumulated in float64 and rounded once to ``x.dtype``: the value ``transformers``'
    router GEMM approximates in ``x.dtype``, minus its blocking-dependent last bits
    (gpt-oss's router has a bias).
    """
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype)  # (T, E)


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``softmax`` over all experts in float32, the ``top_k`` largest, optionally renormalised.

    As ``transformers``' ``MixtralTopKRouter`` (always renormalised) and
    ``Qwen{2,3}MoeTopKRouter`` (renormalised when ``norm_topk_prob``). Equal
    probabilities rank the lower expert index first.

    Args:
        logits: ``(T, E)`` router logits, any float dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the ``top_k`` probabilities by their sum.

    Returns:
        ``(weights (T, top_k) float32, ids (T, top_k) int64)``, most probable first.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # (T, E) float32
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # stable: ties keep index order
    weights, ids = ranked[:, :top_k], order[:, :top_k]  # (T, top_k) each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def is_sparse_layer(layer_index: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers: list[int]) -> bool:
    """Whether Qwen-MoE decoder layer ``layer_index`` has a MoE block (else a dense MLP), as ``transformers`` decides.

    Sparse when not in ``mlp_only_layers``, ``num_experts > 0`` and ``(layer_index + 1)`` is a
    multiple of ``decoder_sparse_step``.

    Raises:
        ValueError: ``decoder_sparse_step < 1``.
    """
    if decoder_sparse_step < 1:
        raise ValueError(f"config.json decoder_sparse_step={decoder_sparse_step} must be >= 1")
    return layer_index not in mlp_only_layers and num_experts > 0 and (layer_index + 1) % decoder_sparse_step == 0


def expert_weight_map(checkpoint_name: str, names: tuple[str, str, str]) -> tuple[str, tuple[int, str]] | None:
    """``...experts.3.w1.weight`` -> (``...experts.gate_up_proj``, ``(3, "gate")``); None if not an expert tensor.

    Args:
        checkpoint_name: a checkpoint tensor's name.
        names: the family's checkpoint names of (gate, up, down), e.g. :data:`MIXTRAL_EXPERT_NAMES`.
    """
    parts = checkpoint_name.split(".")
    if "experts" not in parts:
        return None
    i = parts.index("experts")
    tail = parts[i + 1:]
    if len(tail) != 3 or not tail[0].isdigit() or tail[1] not in names or tail[2] != "weight":
        return None
    kind = EXPERT_PROJECTIONS[names.index(tail[1])]
    param = "down_proj" if kind == "down" else "gate_up_proj"
    return ".".join(parts[:i + 1] + [param]), (int(tail[0]), kind)


def expert_checkpoint_name(param_name: str, shard_id: object, names: tuple[str, str, str]) -> str | None:
    """Inverse of :func:`expert_weight_map` (for error messages); None if ``shard_id`` is not an expert's."""
    if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_PROJECTIONS):
        return None
    expert, kind = shard_id
    prefix = param_name.rsplit(".", 1)[0]
    return f"{prefix}.{expert}.{names[EXPERT_PROJECTIONS.index(kind)]}.weight"


class FusedMoE(nn.Module):
    """The experts' SwiGLU MLPs this rank holds, applied to the tokens routed to them.

    Tensor-parallel (default): a slice of every expert, ``gate_up_proj (E, 2 * I / tp, H)``,
    ``down_proj (E, H, I / tp)``. Expert-parallel (``ctx.enable_expert_parallel``): whole
    experts ``[first_expert, first_expert + num_local_experts)``, ``gate_up_proj
    (E / tp, 2 * I, H)``, ``down_proj (E / tp, H, I)`` (see the module docstring).

    Args:
        num_experts: ``E``.
        hidden_size: ``H``.
        intermediate_size: ``I``, one expert's full intermediate width; must divide by ``tp_size``
            (tensor-parallel only).
        ctx: the tensor-parallel group (and whether experts are split by expert).
        dtype: parameter and activation dtype.
        quantization: None (float experts); ``"int8"``: int8 expert weights with
            ``gate_up_proj_scale (E, 2 * I / tp)`` and ``down_proj_scale (E, H)`` float32
            (worker/layers/moe_int8.py); ``"int4"``: packed 4-bit codes with a float32 scale and
            offset per group (worker/layers/moe_int4.py), re-laid out at load for an 8-bit
            checkpoint's experts (worker/layers/moe_w8.py). Both are refused for a subclass whose
            loader fills float stacks only (``loads_int8`` False).
        bias: the experts carry biases (gpt-oss): ``gate_up_proj_bias (E, 2 * I / tp)`` and
            ``down_proj_bias (E, H)`` (the latter added by one rank only: the outputs are partials
            of a sum over ranks); a subclass with a checkpoint layout that stores them loads them
            (worker/layers/moe_stacked.py).
        activation: ``[gate | up] (rows, 2 * I) -> (rows, I)``; None: ``silu(gate) * up``.

    Shapes: ``forward(x (T, H), ids (T, k) int64, weights (T, k))`` -> this rank's
    partial ``(T, H)`` in ``x.dtype`` (the caller all-reduces); ``ids`` are global expert ids.

    Raises:
        ValueError: ``intermediate_size`` (tensor-parallel) or ``num_experts`` (expert-parallel)
            not divisible by ``tp_size``, or a quantization these experts cannot hold.
    """

    #: Whether :meth:`weight_loader` fills int8 and int4 experts (subclasses with their own layout set False).
    loads_int8 = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ctx: ParallelContext, *,
                 dtype: torch.dtype, quantization: Quantization | None = None, bias: bool = False,
                 activation: nn.Module | None = None) -> None:
        super().__init__()
        if quantization == "fp8":
            quantization = None  # an FP8 checkpoint's experts: dequantized at load (fp8 kept for linear layers only)
        if quantization not in (None, "int8", "int4"):
            raise ValueError(f"--quantization {quantization} is not supported for mixture-of-experts models "
                             "(expert weights); serve them unquantized or with --quantization int8 or int4")
        if quantization is not None:
            check_loadable(self, bias, quantization)
        if bias and ctx.enable_expert_parallel:  # the biases are laid out for the tensor-parallel split
            raise ValueError("--enable-expert-parallel is not supported for experts with biases (gpt-oss); "
                             "serve them tensor-parallel")
        self.ctx = ctx
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.expert_parallel = ctx.enable_expert_parallel
        if self.expert_parallel:
            self.num_local_experts = expert_parallel_share(num_experts, ctx.tp_size)
            self.intermediate_size_per_partition = intermediate_size  # whole experts
        else:
            self.num_local_experts = num_experts
            self.intermediate_size_per_partition = _divide(intermediate_size, ctx.tp_size, "moe_intermediate_size")
        #: This rank's first expert (global id); its experts are the next ``num_local_experts``.
        self.first_expert = ctx.tp_rank * self.num_local_experts if self.expert_parallel else 0
        #: Whether some routed rows name another rank's expert (expert-parallel over more than one rank).
        self.has_remote_experts = self.num_local_experts < num_experts
        local, held = self.intermediate_size_per_partition, self.num_local_experts
        #: ``quantization="int8"``: int8 weights with per-output-channel float32 scales (worker/layers/moe_int8.py).
        self.int8 = quantization == "int8"
        #: ``quantization="int4"``: packed codes with float32 (scale, offset) per group (worker/layers/moe_int4.py).
        self.int4 = quantization == "int4"
        #: The activation and float-weight dtype (experts a packed checkpoint stores float are held in it).
        self.float_dtype = dtype
        self.gate_up_proj_scale: nn.Parameter | None = None
        self.down_proj_scale: nn.Parameter | None = None
        #: Act-order int4 experts: each expert's input columns in packed order, ``(E, H)`` / ``(E, I)`` int64.
        self.gate_up_perm: torch.Tensor | None = None
        self.down_perm: torch.Tensor | None = None
        if self.int8:
            new_int8_experts(self, held, local, hidden_size, ctx.device)
        elif self.int4:
            new_int4_experts(self, held, local, hidden_size, ctx.device)
        else:
            self.gate_up_proj = new_parameter((held, 2 * local, hidden_size), dtype, ctx.device, self.weight_loader)
            self.down_proj = new_parameter((held, hidden_size, local), dtype, ctx.device, self.weight_loader)
        # Every expert's tensors are expected (the loader checks the checkpoint has them all);
        # weight_loader reads only this rank's.
        self.gate_up_proj.shard_ids = tuple((e, k) for e in range(num_experts) for k in ("gate", "up"))
        self.down_proj.shard_ids = tuple((e, "down") for e in range(num_experts))
        if self.int8 or self.int4:
            set_scale_shards(self, held)
        self.act = activation if activation is not None else expert_act
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_proj_bias = new_parameter((num_experts, 2 * local), dtype, ctx.device, self.weight_loader)
            self.down_proj_bias = new_parameter((num_experts, hidden_size), dtype, ctx.device, self.weight_loader)
            self.gate_up_proj_bias.shard_ids = self.down_proj_bias.shard_ids = (None,)
        #: Tokens routed to each expert since the last :meth:`take_routed_counts`, ``(E,)`` int64;
        #: counted on rank 0 only, padding rows of a replayed CUDA graph included (the runner
        #: subtracts those: worker/model_runner.py).
        self.register_buffer("routed_counts", torch.zeros(num_experts, dtype=torch.int64, device=ctx.device),
                             persistent=False)

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy this rank's part of expert ``e``'s gate/up rows or down columns; ``shard_id = (e, kind)``.

        Tensor-parallel: a slice of every expert. Expert-parallel: the whole tensor of a
        held expert; another rank's expert is only shape-checked, never read. A 4-bit
        checkpoint's packed tensors (int4 experts) are checked when unpacked.
        """
        local, full = self.intermediate_size_per_partition, self.intermediate_size
        start = 0 if self.expert_parallel else self.ctx.tp_rank * local
        expert, kind = shard_id  # type: ignore[misc]
        if not self.int4:
            check_shape(source, (self.hidden_size, full) if kind == "down" else (full, self.hidden_size))
        slot = expert - self.first_expert  # index in this rank's stack
        if not 0 <= slot < self.num_local_experts:
            return  # another rank's expert
        if self.int4 and isinstance(source, PackedPart) and source.fmt.bits == 8:  # an 8-bit checkpoint's expert
            load_8bit_expert(self, param, source, shard_id, slot, start, local)  # type: ignore[arg-type]
            return
        if self.int4:
            load_int4_expert(self, param, source, shard_id, slot, start, local)  # type: ignore[arg-type]
            return
        if self.int8:
            load_int8_expert(self, param, source, shard_id, slot, start, local)  # type: ignore[arg-type]
            return
        if kind == "down":
            copy_into(param.data[slot], read_narrow(source, 1, start, local))
        else:
            offset = 0 if kind == "gate" else local
            copy_into(param.data[slot, offset:offset + local], read_narrow(source, 0, start, local))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.ctx.is_rank0:  # the rank that reports them (StepResult.expert_token_counts)
            flat = ids.reshape(-1)  # (T * k,)
            self.routed_counts.index_add_(0, flat, torch.ones_like(flat))  # (E,); no host sync, graph-safe
        if self.has_remote_experts:
            ids = self.local_ids(ids)
        return grouped_experts(x, self.gate_up_proj, self.down_proj, ids, weights, gate_up_bias=self.gate_up_proj_bias,
                               down_bias=self.down_proj_bias, act=self.act, has_remote=self.has_remote_experts,
                               gate_up_scale=self.gate_up_proj_scale, down_scale=self.down_proj_scale,
                               gate_up_perm=self.gate_up_perm, down_perm=self.down_perm)  # (T, H), partial

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids ``(T, k)`` -> this rank's stack index, ``num_local_experts`` for another rank's expert.

        That one id past the stack marks a routed row the experts path skips (its output is zero).
        """
        local = ids - self.first_expert  # (T, k)
        held = (local >= 0) & (local < self.num_local_experts)
        return torch.where(held, local, self.num_local_experts)  # (T, k) int64

    def take_routed_counts(self) -> torch.Tensor:
        """The ``(E,)`` int64 counts since the last call (on the layer's device), and reset them."""
        counts = self.routed_counts.clone()
        self.routed_counts.zero_()
        return counts


class SharedExpertMLP(nn.Module):
    """An always-on expert (Qwen2-MoE's gated one, DeepSeek's shared experts): a SwiGLU MLP whose down
    projection is left unreduced (a partial sum)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, ctx, bias=False,
                                                       dtype=dtype, quantization=quantization)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx, bias=False, dtype=dtype,
                                           quantization=quantization, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # (T, H), this rank's partial


class ReplicatedGate(nn.Module):
    """A linear map held whole on every rank: the router ``(E, H)`` or the shared-expert gate ``(1, H)``.

    ``bias``: with a bias ``(output_size,)`` (gpt-oss's router); else ``self.bias`` is None.
    """

    def __init__(self, hidden_size: int, output_size: int, ctx: ParallelContext, dtype: torch.dtype, *,
                 bias: bool = False) -> None:
        super().__init__()
        self.weight = new_parameter((output_size, hidden_size), dtype, ctx.device)
        self.weight.shard_ids = (None,)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = new_parameter((output_size,), dtype, ctx.device)
            self.bias.shard_ids = (None,)


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) a gated shared expert; ends in one all-reduce.

    Args:
        hidden_size: ``H``.
        num_experts: ``E`` (``num_local_experts`` for Mixtral, ``num_experts`` for Qwen).
        top_k: experts per token (``num_experts_per_tok``).
        intermediate_size: one expert's width (``intermediate_size`` for Mixtral,
            ``moe_intermediate_size`` for Qwen).
        ctx: the tensor-parallel group.
        dtype: parameter and activation dtype.
        renormalize: renormalise the top-k probabilities (Mixtral: always; Qwen: ``norm_topk_prob``).
        weights_in_dtype: round the routing weights to ``dtype`` before scaling the
            experts' outputs (Qwen's routers do, Mixtral's keeps them in float32).
        shared_expert_intermediate_size: width of Qwen2-MoE's gated shared expert; 0 for none.
        quantization: the experts' and shared experts' (None, ``"int8"`` or ``"int4"``: :class:`FusedMoE`); the
            router and the shared-expert gate stay in ``dtype``.
        router_bias: the router carries a bias (gpt-oss's ``router.bias``).
        experts: the experts module, when a family builds its own (biases, an activation, a
            checkpoint layout: :class:`FusedMoE`'s options); None: a plain :class:`FusedMoE`.
        router: a router module (``forward(x) -> (weights (T, k), ids (T, k))``, parameters
            ``weight`` and more) replacing the softmax router, e.g. the biased sigmoid router of
            DeepSeek V3 (:class:`worker.layers.moe_routing.BiasedTopKRouter`); then ``top_k``,
            ``renormalize``, ``weights_in_dtype`` and ``router_bias`` are the router's business.
        shared_experts_intermediate_size: width of DeepSeek's always-on, ungated shared experts
            (``n_shared_experts * moe_intermediate_size``); 0 for none. Its partial joins the
            experts' before the block's one all-reduce.

    Shapes: ``x (T, H) -> (T, H)``, ``x.dtype``, all-reduced over ranks.

    Checkpoint names under the block: ``gate.weight`` (and a router's own, e.g.
    ``gate.e_score_correction_bias``); ``experts.{e}.<gate|up|down>.weight``; with a gated shared
    expert ``shared_expert.{gate,up,down}_proj.weight`` and ``shared_expert_gate.weight``; with
    ungated shared experts ``shared_experts.{gate,up,down}_proj.weight``.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 ctx: ParallelContext, dtype: torch.dtype, *, renormalize: bool, weights_in_dtype: bool,
                 shared_expert_intermediate_size: int = 0, quantization: Quantization | None = None,
                 router_bias: bool = False, experts: FusedMoE | None = None, router: nn.Module | None = None,
                 shared_experts_intermediate_size: int = 0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.ctx = ctx
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_dtype = weights_in_dtype
        self.softmax_router = router is None
        self.gate = ReplicatedGate(hidden_size, num_experts, ctx, dtype, bias=router_bias) if router is None else router
        self.experts = experts if experts is not None else FusedMoE(num_experts, hidden_size, intermediate_size, ctx,
                                                                    dtype=dtype, quantization=quantization)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(hidden_size, shared_expert_intermediate_size, ctx, dtype,
                                                 quantization)
            self.shared_expert_gate = ReplicatedGate(hidden_size, 1, ctx, dtype)
        self.shared_experts = None
        if shared_experts_intermediate_size:
            self.shared_experts = SharedExpertMLP(hidden_size, shared_experts_intermediate_size, ctx, dtype,
                                                  quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.softmax_router:
            gate = cast(ReplicatedGate, self.gate)
            logits = router_logits(x, gate.weight, gate.bias)  # (T, E)
            weights, ids = select_experts(logits, self.top_k, self.renormalize)  # (T, k) each
            if self.weights_in_dtype:
                weights = weights.to(x.dtype)  # (T, k), as transformers' Qwen routers return them
        else:
            weights, ids = self.gate(x)  # (T, k) each
        y = self.experts(x, ids, weights)  # (T, H), this rank's partial
        if self.shared_expert is not None:
            scale = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))  # (T, 1), replicated
            y = y + scale * self.shared_expert(x)  # (T, H), still a partial: the scale is per token
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)  # (T, H), a partial of the same sum
        return self.ctx.all_reduce(y)  # (T, H), summed over ranks


def expert_layers(model: nn.Module) -> list[tuple[int, FusedMoE]]:
    """The model's :class:`FusedMoE` modules with their decoder layer's index (``...layers.{i}...``), in order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            parts = name.split(".")
            found.append((int(parts[parts.index("layers") + 1]), module))
    return found


def take_routed_counts(layers: list[tuple[int, FusedMoE]]) -> torch.Tensor | None:
    """Every layer's ``(E,)`` counts since the last call, stacked ``(L, E)`` int64 on the device (reset); None if none."""
    if not layers:
        return None
    return torch.stack([moe.take_routed_counts() for _, moe in layers])  # (L, E)


def count_triples(layers: list[tuple[int, FusedMoE]], counts: torch.Tensor | None) -> tuple[int, ...]:
    """``counts (L, E)`` of ``layers`` as flat ``(layer, expert, num_tokens)`` triples of the nonzero counts.

    One device-to-host copy of an ``(n, 3)`` int64 tensor.
    """
    if counts is None:
        return ()
    where = counts.nonzero()  # (n, 2): (row of layers, expert)
    index = torch.tensor([i for i, _ in layers], dtype=torch.int64, device=counts.device)
    triples = torch.stack([index[where[:, 0]], where[:, 1], counts[where[:, 0], where[:, 1]]], dim=1)  # (n, 3)
    return tuple(triples.reshape(-1).tolist())
