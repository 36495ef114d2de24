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
own values on this rank (the LM head: worker/lm_head_w16.py, the same rule). Not the layers whose weights other
code reads as float32 (multi-head latent attention's ``kv_b_proj``, Mamba's ``in_proj``), nor MoE experts' stacks.

When: :func:`takes_w16_layers` (a CPU, float32 activations, the compiled kernels; the LM head's condition).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.lm_head_w16 import sixteen_bit_dtype, takes_w16_head

#: The projections that may be held 16-bit: their weights are read by ``worker.layers.matmul.linear`` and the
#: compiled decode stack only.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def takes_w16_layers(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this rank's float projections may be kept 16-bit (the values then decide, layer by layer): a CPU,
    float32 activations and the compiled kernels, as for the LM head."""
    return takes_w16_head(device, dtype)


def keep_layers_16bit(model: nn.Module) -> tuple[dict[torch.dtype, int], int]:
    """Hold each float32 projection of ``model`` (:data:`PROJECTIONS`) whose values are all bfloat16 (else
    float16) values in that type, in place (exact: nothing is rounded). Returns (layers kept per type, bytes
    released on this rank)."""
    kept: dict[torch.dtype, int] = {}
    released = 0
    for module in model.modules():
        for name in PROJECTIONS:
            layer = module._modules.get(name)
            if (not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) or layer.weight_scale is not None
                    or layer.weight.dtype != torch.float32):
                continue
            dtype = sixteen_bit_dtype(layer.weight.detach())
            if dtype is None:
                continue
            layer.weight.data = layer.weight.data.to(dtype)  # the float32 copy is freed
            kept[dtype] = kept.get(dtype, 0) + 1
            released += layer.weight.numel() * 2
    return kept, released
