"""A 16-bit checkpoint's decoder projections kept in their 16 bits on a CPU: the float32 layers' bits, half their bytes.

Most checkpoints are published in bfloat16 (some in float16). CPU ranks compute in float32 (``--dtype float32``,
the default there), and widening every weight at load doubled what the model holds and what a decode step reads:
an 8B bfloat16 model took 32 GB instead of 16, and on the 2-core host a decode step's time is mostly reading
weights. Every bfloat16 or float16 value is exactly a float32 one, so a projection whose values all survive the
round trip through bfloat16 (else float16) is held in that type and widened as it is read, in registers, by the
compiled kernels: ``linear_w16`` (cpu_linear.cpp: ``linear_f32``'s paths in ``linear_f32``'s order on the same
values) in the module path and the compiled decode stack's ops, and the same streamed GEMV in its one-region step
(cpu_decode_region.cpp, ``kBf16`` / ``kF16``). A prefill-sized product (more rows than the kernel takes,
worker/layers/matmul.py) multiplies a float32 copy widened for that call, as the float32 layer would be multiplied.
So every logit is the float32-widened model's, bit for bit, whatever the path (tests/worker/test_layers_w16.py).

Which layers: the decoder's dense projections that only the matmul reads (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj`` of the tensor-parallel linear layers, float, not quantized), each decided by its
own values on this rank (the LM head: worker/lm_head_w16.py, the same rule), and an untied model's input
embedding (memory only: a gather, widened row by row; Llama 3 8B's is 128,256 x 4,096, 2.1 GB in float32). Not
the layers whose weights other code reads as float32 (multi-head latent attention's ``kv_b_proj``, Mamba's
``in_proj``), nor MoE experts' stacks.

When: :func:`takes_w16_layers` (a CPU, float32 activations, the compiled kernels; the LM head's condition). A
checkpoint that stores a projection's tensors in one 16-bit type gets that projection allocated in it before
loading (:func:`allocate_16bit_projections`: the float32 copy never exists, so the load's peak memory halves too);
any other float projection is loaded in float32 and kept 16-bit afterwards where its values allow
(:func:`keep_layers_16bit`).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from worker.layers.embedding import VocabParallelEmbedding
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.lm_head_w16 import sixteen_bit_dtype, takes_w16_head

#: The projections that may be held 16-bit: their weights are read by ``worker.layers.matmul.linear`` and the
#: compiled decode stack only.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def takes_w16_layers(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this rank's float projections may be kept 16-bit (the values then decide, layer by layer): a CPU,
    float32 activations and the compiled kernels, as for the LM head."""
    return takes_w16_head(device, dtype)


def projections(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose weight may be held 16-bit, by that weight's parameter name in ``model``
    (``model.layers.0.self_attn.qkv_proj.weight``): the projections of :data:`PROJECTIONS` (tensor-parallel
    linear layers, not quantized), and an untied model's input embedding (a gather: its rows widen exactly in
    ``VocabParallelEmbedding._rows``; a tied one is the LM head's matrix, worker/lm_head_w16.py's)."""
    found: dict[str, nn.Module] = {}
    untied = not getattr(model, "tie_word_embeddings", True)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if untied and type(module) is VocabParallelEmbedding and not module.int8:
            found[f"{prefix}weight"] = module
        for name in PROJECTIONS:
            layer = module._modules.get(name)
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) and layer.weight_scale is None:
                found[f"{prefix}{name}.weight"] = layer
    return found


def weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The weights of :func:`projections`, by parameter name."""
    return {name: cast(nn.Parameter, module.weight) for name, module in projections(model).items()}


#: safetensors' header names of the 16-bit float types.
_STORED = {"BF16": torch.bfloat16, "F16": torch.float16}


def allocate_16bit_projections(model: nn.Module, stored: dict[str, set[str]]) -> None:
    """Before the checkpoint is read: each projection whose checkpoint tensors are all stored in one 16-bit type
    (``stored``: parameter name -> the safetensors dtypes of the tensors it receives) gets its weight allocated in
    that type, so that loading copies the stored values as they are (exact) and the model never holds the float32
    copy: the load's peak is the 16-bit size (an 8B bfloat16 model 16 GB, not 32). In place; the parameter
    objects (and their ``weight_loader``) stay."""
    for param_name, weight in weights(model).items():
        kinds = stored.get(param_name, set())
        if len(kinds) == 1 and (kind := next(iter(kinds))) in _STORED and weight.dtype == torch.float32:
            weight.data = torch.empty(weight.shape, dtype=_STORED[kind], device=weight.device)


def keep_layers_16bit(model: nn.Module) -> tuple[dict[torch.dtype, int], int, bool]:
    """After loading: hold each float32 projection of ``model`` whose values are all bfloat16 (else float16) values
    in that type, in place (exact: nothing is rounded; a float32 checkpoint exported from bfloat16, say). Returns
    the weights held 16-bit per type, these and those :func:`allocate_16bit_projections` allocated, the bytes they
    hold less than float32 would on this rank, and whether an untied input embedding is among them."""
    kept: dict[torch.dtype, int] = {}
    released = 0
    embedding = False
    for name, weight in weights(model).items():
        if weight.dtype == torch.float32:
            dtype = sixteen_bit_dtype(weight.detach())
            if dtype is None:
                continue
            weight.data = weight.data.to(dtype)  # the float32 copy is freed
        if weight.dtype in (torch.bfloat16, torch.float16):
            kept[weight.dtype] = kept.get(weight.dtype, 0) + 1
            released += weight.numel() * 2
            embedding = embedding or not name.endswith("_proj.weight")
    return kept, released, embedding
