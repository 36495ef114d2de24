"""A float LM head kept in its checkpoint's 16 bits on a CPU: the bits of the float32 head, half its bytes.

CPU ranks compute in float32 (``--dtype float32``), so a checkpoint's bfloat16 or float16 tensors are widened
at load, doubling the bytes a decode step reads. For the LM head, the largest matrix with a real vocabulary
(worker/lm_head_int8.py says how large), that matters most where the layers are small: a published 4-bit
checkpoint (GPTQ, AWQ, compressed-tensors) keeps its head as published, in bfloat16 or float16, and a
float32 copy of it is then most of what an int4 step reads. Every bfloat16 or float16 value is exactly a
float32 one, so the head can stay 16-bit and be widened as it is read: ``linear_w16`` (cpu_linear.cpp) runs
``linear_f32``'s paths in ``linear_f32``'s order on the widened values, so the logits are the float32 head's,
bit for bit, with no rounding added.

When: a float head (not held as int8) on a CPU with float32 activations and the compiled kernels, whose
values on this rank all survive the round trip through bfloat16 (else float16): a bfloat16 or float16
checkpoint's, whatever ``config.json`` says, and never a float32 one with finer values (the check is on the
values, so nothing is ever rounded). A tied embedding shares the matrix and gathers its rows widened.
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_kernels_available
from worker.layers.embedding import ParallelLMHead

#: Rows checked at once (``check_rows`` makes a float32 copy of these many rows: 4,096 x 8,192 is 128 MiB).
_CHECK_ROWS = 4096


def takes_w16_head(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a float head may be kept 16-bit on this rank (the values decide: :func:`sixteen_bit_dtype`)."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available()


def sixteen_bit_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """``torch.bfloat16`` or ``torch.float16`` if every value of the float32 ``weight (V, H)`` is exactly one of
    that type (bfloat16 first: its widening is a shift), else None. Checked ``_CHECK_ROWS`` rows at a time."""
    for dtype in (torch.bfloat16, torch.float16):
        if all(torch.equal(part, part.to(dtype).to(torch.float32)) for part in weight.split(_CHECK_ROWS)):
            return dtype
    return None


def keep_lm_head_16bit(model: torch.nn.Module) -> tuple[torch.dtype | None, int]:
    """Hold this rank's float32 LM head in the 16-bit type its values come from, in place (a tied embedding shares
    the parameter). Returns (the type, or None where the head stays float32 or is absent; the bytes released)."""
    for head in (m for m in model.modules() if isinstance(m, ParallelLMHead)):
        if head.int8 or head.weight.dtype != torch.float32:
            continue
        dtype = sixteen_bit_dtype(head.weight.detach())
        if dtype is None:
            return None, 0
        released = head.weight.numel() * 2
        head.weight.data = head.weight.data.to(dtype)  # exact: every value is one of ``dtype``
        return dtype, released
    return None, 0
