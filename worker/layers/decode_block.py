"""A Llama decoder stack's decode step on the CPU in one compiled call (two a layer with tensor parallelism).

On a float32 (or weight-only int8) CPU step whose rows are all decodes read by the
compiled paged kernel, a layer runs as ``torch.ops.tpserve_cpu.attention_block``
(norm, qkv projection, RoPE and cache write, paged attention, o projection) and
``mlp_block`` (residual add and norm, gate/up projection, SiLU-and-mul, down
projection), with the tensor-parallel all-reduces between them
(:func:`decode_block_forward`); on one rank, :class:`DecodeStack` runs every layer,
both halves and the residual adds, in one call (worker/kernels/cpu_decode_block.cpp). Where every
projection is float32, int8, fp8, group-wise 8-bit or int4 (and the step few enough rows for their kernels'
decode paths), that call runs the whole step in one OpenMP parallel region instead of the ops
(worker/kernels/cpu_decode_region.cpp: no dispatch, allocation or fork and join between them; the
same bits). On a tensor-parallel rank whose group shares memory on one host (the compiled collectives of
worker/comm/shm_allreduce.py), :class:`DecodeStack` runs the region too, its all-reduces inside it; a step the
region does not take (more rows than its formats' decode paths) runs the halves. Steps with LoRA adapter rows
take the region as well, each projection's adapter tiles split between its threads.
They run the very kernels the module path (:class:`~worker.models.llama.LlamaDecoderLayer`'s
submodules) calls, in the same order, so the hidden states are bit-identical to it;
what goes is the Python between them, some twenty calls a layer. Measured on the 95M benchmark model
(30 layers), the bare batch-1 step: docs/design/kernels.md, "Compiled CPU kernels". An 8-bit KV cache
(worker/kv_quant.py) is read and written by the same ops, each layer's scale pools and key offset passed.

With ``--enable-lora`` (worker/layers/lora.py) the decision is made once per step: a step
with no adapter row (``LoRAStep.row_slots`` None) calls exactly the ops above, with no LoRA
argument; a step with adapter rows passes the rows' slot indices and every projection's
stacked slots, and each projection adds its adapter rows' low-rank sums in the same call
(``lora_add_``, worker/kernels/cpu_lora.cpp).

Prefill and mixed steps, other devices and dtypes, and layers that differ from
Llama's or Qwen3's (soft-capping, MoE) keep the module path.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from worker.attention import KERNEL_HEAD_SIZES, AttentionMetadata
from worker.comm.shm_allreduce import SharedMemoryComm
from worker.kernels import cpu_kernels_available
from worker.layers.lora import LoRAWeights
from worker.layers.matmul import MAX_KERNEL_ROWS, kernel_for_prefill


def decode_block_supported(attention: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer with ``attention`` on ``device`` in ``dtype`` can take the compiled decode layer.

    The caller checks the layer's classes first: an attention in
    ``worker.models.llama.DECODE_BLOCK_ATTENTIONS`` (Llama's, Qwen3's) and Llama's MLP.
    Building the kernels on first use is part of the check (False where they cannot be built).
    """
    attn = attention.attn  # its PagedAttention
    return (device.type == "cpu" and dtype == torch.float32 and attn.logit_softcap is None
            and attn.head_size in KERNEL_HEAD_SIZES and cpu_kernels_available())


def disable_decode_blocks(model: nn.Module) -> None:
    """Send every decode step of ``model`` through the module path (LoRA adapters: the compiled layer has no
    low-rank path)."""
    for module in model.modules():
        if getattr(module, "decode_block", False):
            setattr(module, "decode_block", False)  # noqa: B010 - a plain attribute, not a submodule
        if getattr(module, "decode_stack", None) is not None:
            setattr(module, "decode_stack", None)  # noqa: B010


def step_takes_decode_block(h: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this step's ``h (T, hidden)`` is all decode rows read by the compiled paged kernel, few
    enough that the module path's linears take the compiled kernel too (worker/layers/matmul.py)."""
    num_tokens = h.shape[0]
    return (meta.decode_query_start_loc is not None and meta.num_decodes == num_tokens
            and (num_tokens <= MAX_KERNEL_ROWS or kernel_for_prefill()))


def _layer_args(layer: nn.Module) -> tuple[tuple, tuple, tuple]:
    """The layer's own arguments of the compiled ops (weights, scales, biases, sizes):
    ``attention_block``'s, ``mlp_block``'s, and the row-parallel biases ``(o_proj, down_proj)``."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv_proj, o_proj, gate_up, down = attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
    norm1, norm2, attn = layer.input_layernorm, layer.post_attention_layernorm, attention.attn
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)  # QK-norm (Qwen3)
    qk_norm = (None, None, 0.0) if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
    return ((norm1.weight, norm1.eps, qkv_proj.weight, qkv_proj.weight_scale, qkv_proj.bias, attention.num_heads,
             attention.num_kv_heads, attn.scale, attn.sliding_window or 0, o_proj.weight, o_proj.weight_scale,
             *qk_norm),
            (norm2.weight, norm2.eps, gate_up.weight, gate_up.weight_scale, gate_up.bias, down.weight,
             down.weight_scale),
            (o_proj.bias, down.bias))


def _lora_args(layer: nn.Module) -> tuple[tuple, tuple] | None:
    """The layer's adapter slots as the compiled ops take them: ``(qkv a, b, o a, b, parts)`` and
    ``(gate_up a, b, down a, b, parts)`` (worker/layers/lora.py's pools, by reference, and the fused layer's
    parts' widths); None without LoRA."""
    attention, mlp = layer.self_attn, layer.mlp
    loras = [attention.qkv_proj.lora, attention.o_proj.lora, mlp.gate_up_proj.lora, mlp.down_proj.lora]
    if any(lora is None for lora in loras):
        return None
    qkv, o, gate_up, down = loras
    return (qkv.a, qkv.b, o.a, o.b, qkv.part_widths), (gate_up.a, gate_up.b, down.a, down.b, gate_up.part_widths)


def lora_row_slots(layer: nn.Module) -> torch.Tensor | None:
    """This step's rows' adapter slot indices (``(T,)`` int64, -1: none) when ``layer`` has adapter slots
    and the step has an adapter row; None otherwise (the step runs the no-LoRA ops)."""
    lora = cast("LoRAWeights | None", layer.self_attn.qkv_proj.lora)
    return None if lora is None else lora.step.row_slots


def _step_args(meta: AttentionMetadata) -> tuple:
    """The step's arguments that follow the caches (RoPE's ``cos, sin`` come before them)."""
    return (meta.slot_mapping, meta.decode_block_tables, meta.decode_query_start_loc, meta.decode_context_lens)


def decode_block_forward(layer: nn.Module, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor,
                         kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` on a tensor-parallel rank, for a step :func:`step_takes_decode_block`
    accepts: ``h (T, hidden)`` float32 -> ``(T, hidden)``; writes the step's keys and values into ``kv_cache``.

    Two calls, each followed by the module path's all-reduce (and the row-parallel layer's bias): a
    collective. The layer's own arguments are gathered on its first decode step and kept (the
    parameters are loaded in place and never replaced). :class:`DecodeStack` takes the whole step instead on one
    rank, and on a rank of a one-host group with the compiled collectives where its region takes the step.
    """
    args = layer.__dict__.get("_decode_block_args")
    if args is None:
        args = layer.__dict__["_decode_block_args"] = _layer_args(layer)
    attention_args, mlp_args, _ = args
    kv_scales = cast(tuple, layer.self_attn.attn.kv_scales or ())  # an 8-bit cache's (k_scale, v_scale, k_offset)
    row_slots = lora_row_slots(layer)
    if row_slots is not None:  # adapter rows this step: each projection adds their low-rank sums
        lora = layer.__dict__.get("_decode_block_lora")
        if lora is None:
            lora = layer.__dict__["_decode_block_lora"] = _lora_args(layer)
        if lora is None:
            raise ValueError("a step with adapter rows reached a decode block layer without adapter slots")
        attention_args = (*attention_args, *(kv_scales or (None, None, None)), row_slots, *lora[0])
        mlp_args = (*mlp_args, row_slots, *lora[1])
        kv_scales = ()
    o = torch.ops.tpserve_cpu.attention_block(h, *rope, *kv_cache, *_step_args(meta), *attention_args,
                                              *kv_scales)  # (T, hidden), this rank's part
    o = layer.self_attn.o_proj.reduce(o)  # (T, hidden): summed over ranks, plus o_proj's bias
    h, m = torch.ops.tpserve_cpu.mlp_block(h, o, *mlp_args)  # h + o; this rank's part of the MLP
    return h + layer.mlp.down_proj.reduce(m)  # (T, hidden)


class DecodeStack:
    """Every layer of a one-rank Llama stack (or pipeline stage) in one compiled call per decode step; on a
    tensor-parallel rank whose group shares memory on one host, every layer in the parallel region, the
    all-reduces included, where the region takes the step.

    ``torch.classes.tpserve_cpu.DecodeLayers`` keeps each layer's own arguments, gathered on the
    first call (the parameters are loaded in place and never replaced); each step passes only
    its own: ``h``, RoPE, the caches, slots and block tables, and, on a step with adapter rows,
    their slot indices (the layers' adapter pools are given on the first such step). The same kernels in the same order as
    the modules, so bit-identical to them (tests/worker/test_decode_block.py).

    Tensor parallelism (``shm``): the region sums each layer's two partial products over the ranks through the
    group's shared-memory collectives, on its thread 0 between two barriers, then adds the row-parallel bias: the
    same bits as the layers' halves around ``ctx.all_reduce`` (tests/worker/test_decode_region_tp.py). A step it
    does not take (more rows than its kernels' decode paths, a tensor larger than a slot) returns None, and the
    caller runs the halves.

    Args:
        layers: the stack's ``LlamaDecoderLayer`` s, each with ``decode_block`` True.
        shm: the tensor-parallel group's compiled shared-memory collectives (``SharedMemoryComm.compiled``), or
            None at one rank.
    """

    def __init__(self, layers: nn.ModuleList, shm: SharedMemoryComm | None = None) -> None:
        self._layers = list(layers)  # a plain list: the modules stay registered once, in the model
        self._shm = shm
        self._compiled = None
        self._lora = False  # whether the layers' adapter slots were given to the compiled stack
        # The step's cache arguments, kept between steps: gathering them walks every layer's modules (some
        # 60 us of Python a step on the 30-layer benchmark shapes). Rebuilt when the runner gives a new cache:
        # init_kv_cache allocates a new list and, for an 8-bit cache, new scale pools.
        self._first_attention = self._layers[0].self_attn.attn
        self._caches_of: tuple[object, object] | None = None  # (the kv_caches list, layer 0's kv_scales)
        self._caches: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor | None:
        """``h (T, hidden)`` float32 through every layer -> ``(T, hidden)``, for a step
        :func:`step_takes_decode_block` accepts; writes each layer's keys and values into its cache. None: a
        tensor-parallel step the region does not take, nothing computed (the caller runs the layers)."""
        if self._compiled is None:
            self._compiled = torch.classes.tpserve_cpu.DecodeLayers()
            for layer in self._layers:
                attention_args, mlp_args, (o_bias, down_bias) = _layer_args(layer)
                self._compiled.add_layer(*attention_args, o_bias, *mlp_args, down_bias)
            if self._shm is not None:
                self._compiled.set_group(*self._shm.compiled_group())
        k_caches, v_caches, kv_scales = self._step_caches(kv_caches)
        row_slots = lora_row_slots(self._layers[0])  # decided once for the whole step
        if row_slots is not None and not self._lora:  # the layers' adapter pools, given once
            for i, layer in enumerate(self._layers):
                lora = _lora_args(layer)
                assert lora is not None  # LoRAAdapters gives every target layer of the model its slots
                (qkv_a, qkv_b, o_a, o_b, qkv_parts), (gate_up_a, gate_up_b, down_a, down_b, gate_up_parts) = lora
                self._compiled.add_lora(i, qkv_a, qkv_b, o_a, o_b, gate_up_a, gate_up_b, down_a, down_b, qkv_parts,
                                        gate_up_parts)
            self._lora = True
        if self._shm is not None:
            if not self._compiled.region_ready():
                return None
            # Every rank decides alike (the same rows, formats, flags and slot size), so the ranks take the
            # region's collectives, or the halves', together.
            shm = self._shm
            out = self._compiled.forward_tp(h, *rope, k_caches, v_caches, *_step_args(meta), kv_scales,
                                            shm.next_collective, row_slots)  # (T, hidden), or empty: not taken
            if out.numel() == 0:
                return None
            shm.skip(2 * len(self._layers))  # o's and the MLP's all-reduce, each layer
            return out
        if row_slots is None:  # no adapter row: the no-LoRA stack
            return self._compiled.forward(h, *rope, k_caches, v_caches, *_step_args(meta), kv_scales)  # (T, hidden)
        return self._compiled.forward_lora(h, *rope, k_caches, v_caches, *_step_args(meta), kv_scales,
                                           row_slots)  # (T, hidden)

    def _step_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The layers' K caches, V caches and (8-bit caches) scale pools and key offsets, as the compiled
        stack takes them: the previous step's lists while ``kv_caches`` and layer 0's scales are the same
        objects (tests/worker/test_decode_block.py: after a new cache the stack writes and reads the new one)."""
        scales = self._first_attention.kv_scales
        if self._caches_of is None or self._caches_of[0] is not kv_caches or self._caches_of[1] is not scales:
            self._caches = ([k for k, _ in kv_caches], [v for _, v in kv_caches],
                            [t for layer in self._layers for t in (layer.self_attn.attn.kv_scales or ())])
            self._caches_of = (kv_caches, scales)
        return self._caches
