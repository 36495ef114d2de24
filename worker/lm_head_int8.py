"""The LM head in int8 when the server quantizes a float checkpoint (``--quantization int8|int4``) on a CPU.

Decode streams every weight once a step, and the LM head is one of them: ``vocab x hidden``, held
in float32 on a CPU (4 bytes a weight) while ``--quantization int4`` leaves the decoder's layers at
about half a byte. In the models CPUs serve it is the largest matrix: a fifth to a third of the
parameters of Llama 3.2 1B (128,256 x 2,048), Qwen2.5 0.5B (151,936 x 896) or Gemma 3 1B
(262,144 x 1,152), so in float32 it would be most of the bytes an int4 decode step reads.
llama.cpp's quantizer keeps its ``output.weight`` at 6-8 bits for the same reason (Q6_K beside
Q4_0 layers, Q8_0 beside Q8_0); here it is int8 with one scale per vocabulary row, the int8
layers' per-channel scheme (worker/layers/int8_weights.py), whatever the layers' width: 8 bits
keep the logits, which every token's probability comes from, closer than 4 would.

When: ``--quantization int8`` or ``int4`` on a checkpoint whose layers load as float (a float one, or FP8
dequantized at load), float32 activations on a CPU with the compiled kernels
(``torch.ops.tpserve_cpu.linear_int8`` multiplies it, accumulating in float32: the logits stay float32). A
published quantized checkpoint (GPTQ, AWQ, compressed-tensors) keeps its float head as published (on a CPU in
its 16 bits: worker/lm_head_w16.py); CUDA and half-precision activations keep a float head (int8_linear there
would dequantize the whole head per call).

Tied word embeddings: the head and the embedding are one matrix, so the embedding gathers the same
int8 rows and scales them (``q[v] * s[v]`` in float32, then ``dtype``): the model served is the
checkpoint with that matrix rounded once, on every pipeline stage that holds it, and no float copy
is kept. An untied model's embedding stays float (a gather of one row a token: no time to save).
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_kernels_available
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.int8_weights import quantize_rows


def takes_int8_head(quantization: str | None, stored: str | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the LM head is held in int8 (the rule in the module docstring).

    Args:
        quantization: ``--quantization`` (or the checkpoint's own kind).
        stored: what the checkpoint stores quantized (``ModelConfig.quantization``): None for a float,
            FP8 or MXFP4 checkpoint (those load as float layers).
        device: the rank's device; dtype: the activations' dtype.
    """
    return (quantization in ("int8", "int4") and stored is None and device.type == "cpu"
            and dtype == torch.float32 and cpu_kernels_available())


def hold_lm_head_int8(model: torch.nn.Module, tied: bool) -> int:
    """Round this rank's LM head (and, ``tied``, the embedding it shares) to int8 rows, in place.

    Each rank quantizes its own vocabulary rows (a row's scale is its own): every tensor-parallel
    degree serves the same codes. Returns the float bytes released (0: no head nor tied embedding here).

    Raises:
        ValueError: a NaN or an infinity in the head's weights (a corrupt checkpoint).
    """
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeddings = [m for m in model.modules() if type(m) is VocabParallelEmbedding] if tied else []
    released = 0
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(float weight) -> its codes and scales
    for module in (*heads, *embeddings):
        weight = module.weight  # (V_p, E), shared by a tied head and embedding
        if id(weight) not in done:
            try:
                done[id(weight)] = quantize_rows(weight.detach())  # (V_p, E) int8, (V_p,) float32
            except ValueError as error:  # non-finite weights: name the tensor, as the loader does
                name = "the embedding the LM head ties" if tied else "the LM head's"
                raise ValueError(f"{name} weights (int8 per vocabulary row): {error}") from error
            released += weight.numel() * weight.element_size()
        module.hold_int8(*done[id(weight)])
    return released
