"""Vocab-parallel input embedding and LM head (Megatron-LM, arXiv:1909.08053, section 3).

The vocabulary is padded to ``padded_vocab_size``, a multiple of ``tp_size``,
and rank ``r`` holds rows ``[r * V_p, (r + 1) * V_p)`` of the embedding matrix
(``V_p = padded_vocab_size / tp_size``); padding rows are zero.

* ``VocabParallelEmbedding``: each rank embeds the token ids that fall in its
  rows, writes zeros for the others, and an all-reduce sums the partial
  embeddings into the full one.
* ``ParallelLMHead``: each rank computes the logits of its vocabulary slice in
  float32 (:func:`logits_float32`: the sampler's inputs are not rounded to the
  weights' half precision); they are gathered on rank 0 and the padding columns
  dropped. With tied word embeddings the head shares the embedding's weight parameter.

Int8 head (:meth:`ParallelLMHead.hold_int8`, worker/lm_head_int8.py says when): the head's
rows as int8 codes with one float32 scale per vocabulary row (``w ~= q * s``, the int8 linear
layers' per-channel scheme, worker/layers/int8_weights.py), multiplied by the compiled int8
kernel in float32; a tied embedding gathers the same codes and scales its rows (no float copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.int4_weights import PackedPart, unpacked_part
from worker.kernels import cpu_kernels_available
from worker.layers.int8_matmul import int8_linear
from worker.layers.matmul import linear
from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.parallel_state import ParallelContext


#: Device type -> whether ``torch.mm(..., out_dtype=torch.float32)`` runs there (CUDA
#: and meta in recent PyTorch; not the CPU), probed once per device type.
_MM_FLOAT32_OUT: dict[str, bool] = {}


def _has_mm_float32_out(device: torch.device) -> bool:
    if device.type not in _MM_FLOAT32_OUT:
        probe = torch.zeros(1, 1, dtype=torch.bfloat16, device=device)
        try:
            torch.mm(probe, probe, out_dtype=torch.float32)
            _MM_FLOAT32_OUT[device.type] = True
        except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError
            _MM_FLOAT32_OUT[device.type] = False
    return _MM_FLOAT32_OUT[device.type]


def logits_float32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` accumulated and returned in float32, whatever the weights' dtype.

    Args:
        hidden: ``(N, H)`` in the weights' dtype.
        weight: ``(V, H)``, float32, bfloat16 or float16.

    Returns:
        ``(N, V)`` float32. Float32 weights: :func:`worker.layers.matmul.linear` (on the CPU
        the compiled kernel; 64 rows of the embedded model's 1,024-token head: 0.13-0.18 ms
        against MKL's 0.19-0.20 on one AVX-512 core). Half-precision weights on CUDA: one GEMM with a float32
        output (``torch.mm(..., out_dtype=torch.float32)``; cuBLAS accumulates in
        float32), so logits are not rounded to 8 (bf16) or 11 (fp16) bits of mantissa
        and no float32 copy of the weight is made. Where that GEMM is missing (the
        CPU), both operands are upcast: exact, at the cost of a float32 copy of the
        weight per call (half precision on a CPU is a test configuration); with float32
        ``hidden`` and the compiled kernels, ``linear_w16`` widens the weight as it reads it
        instead: the bits of the float32 weight's product, at half its bytes (a checkpoint's
        16-bit head kept as stored, worker/lm_head_w16.py).
    """
    if weight.dtype == torch.float32:
        return linear(hidden, weight)  # (N, V): on the CPU the compiled kernel, as the decoder's projections
    if (hidden.dtype == torch.float32 and hidden.device.type == "cpu" and hidden.dim() == 2
            and cpu_kernels_available()):  # a 16-bit head kept as stored (worker/lm_head_w16.py)
        return torch.ops.tpserve_cpu.linear_w16(hidden.contiguous(), weight, None)  # (N, V): linear's bits
    if _has_mm_float32_out(weight.device):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # (N, V)
    return F.linear(hidden.float(), weight.float())  # (N, V)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks.

    Args:
        vocab_size: number of token ids (unpadded).
        embedding_size: width of one embedding (``hidden_size``).
        ctx: the tensor-parallel group.
        dtype: parameter dtype.

    Shapes: ``input_ids (T,) int64 -> (T, embedding_size)`` in ``dtype``.
    """

    qweight: torch.Tensor  # (V_p, embedding_size) int8, after hold_int8 (a buffer)
    weight_scale: torch.Tensor  # (V_p,) float32, after hold_int8 (a buffer)

    def __init__(self, vocab_size: int, embedding_size: int, ctx: ParallelContext, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.padded_vocab_size = -(-vocab_size // ctx.tp_size) * ctx.tp_size
        self.vocab_size_per_partition = self.padded_vocab_size // ctx.tp_size
        self.vocab_start = ctx.tp_rank * self.vocab_size_per_partition
        self.vocab_end = self.vocab_start + self.vocab_size_per_partition
        shape = (self.vocab_size_per_partition, embedding_size)
        self.weight = new_parameter(shape, dtype, ctx.device, self.weight_loader)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]
        self.dtype = dtype
        self.int8 = False  # hold_int8: the rows are ``qweight * weight_scale[:, None]``

    def hold_int8(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        """Replace the float rows by int8 codes ``qweight (V_p, E)`` and float32 ``scales (V_p,)``
        (``w[v] = qweight[v] * scales[v]``); the float parameter is released.

        Raises:
            ValueError: shapes other than this rank's ``(vocab_size_per_partition, embedding_size)``.
        """
        rows = (self.vocab_size_per_partition, self.embedding_size)
        if tuple(qweight.shape) != rows or qweight.dtype != torch.int8 or tuple(scales.shape) != rows[:1]:
            raise ValueError(f"int8 rows must be {list(rows)} int8 with ({rows[0]},) scales, got "
                             f"{list(qweight.shape)} {qweight.dtype} and {list(scales.shape)}")
        del self.weight
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scales)
        self.int8 = True

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids (T,) int64`` local row indices -> ``(T, embedding_size)`` in ``dtype``."""
        if not self.int8:  # 16-bit rows (worker/lm_head_w16.py, worker/layers_w16.py) widen exactly to ``dtype``
            return F.embedding(ids, self.weight).to(self.dtype)  # (T, embedding_size)
        # Dequantized in float32 and then cast, as the int8 layers' reference (q * s) is written.
        return (F.embedding(ids, self.qweight).float() * self.weight_scale[ids].unsqueeze(-1)).to(self.dtype)

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy rows ``[vocab_start, min(vocab_end, vocab_size))``; zero the padding rows."""
        check_shape(source, (self.vocab_size, self.embedding_size))
        num_real_rows = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        if num_real_rows:
            copy_into(param.data[:num_real_rows], read_narrow(source, 0, self.vocab_start, num_real_rows))
        param.data[num_real_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self._rows(input_ids)  # (T, embedding_size)
        in_slice = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # (T,) bool
        local_ids = torch.where(in_slice, input_ids - self.vocab_start, 0)  # (T,) int64, valid row indices
        x = self._rows(local_ids)  # (T, embedding_size)
        x = x * in_slice.unsqueeze(-1).to(x.dtype)  # (T, embedding_size), zero where another rank owns the id
        return self.ctx.all_reduce(x)  # (T, embedding_size), the full embedding


class ParallelLMHead(VocabParallelEmbedding):
    """Logits ``hidden @ E.T`` with ``E`` split by vocabulary rows, gathered on rank 0.

    ``forward(hidden (N, embedding_size)) -> (N, vocab_size)`` float32 on rank 0,
    None on the other ranks. Every rank must call it. Held as int8 (:meth:`hold_int8`), the
    logits are ``hidden @ (q * s).T`` from the compiled int8 kernel (float32 accumulation: each
    logit one row's dot product, so every tensor-parallel degree gives tp 1's bits).
    """

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """:meth:`VocabParallelEmbedding.weight_loader`; a GPTQ checkpoint's packed head (``lm_head: true``,
        GPTQModel) is unpacked once its tensors are read and dequantized at load (``s * (q - z)`` per group,
        worker/layers/int4_formats.py, in float32): the head stays a float layer.

        Raises:
            ValueError: a corrupt packed head (names the tensor).
        """
        if isinstance(source, PackedPart):
            if getattr(self, "int4_pending", None) is None:
                self.int4_pending: dict = {}  # parts kept until the head's tensors are all read (unpacked_part)
            full = unpacked_part(self, source, (self.vocab_size, self.embedding_size), shard_id)
            if full is None:
                return
            self.dequantized_from = source.fmt  # for the loader's log line
            source = full.dequantize()  # (vocab_size, embedding_size) float32
        super().weight_loader(param, source, shard_id)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share ``embedding``'s weight (tied word embeddings); the two must match in shape."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie LM head {list(self.weight.shape)} to embedding {list(embedding.weight.shape)}"
            )
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        if self.int8:  # float32 activations on a CPU with the kernels (worker/lm_head_int8.py)
            local_logits = int8_linear(hidden, self.qweight, self.weight_scale)  # (N, vocab_size_per_partition)
        else:
            local_logits = logits_float32(hidden, self.weight)  # (N, vocab_size_per_partition) float32
        logits = self.ctx.gather_to_rank0(local_logits, dim=-1)  # (N, padded_vocab_size) on rank 0
        if logits is None:
            return None
        return logits[:, : self.vocab_size]  # (N, vocab_size): padding columns dropped
