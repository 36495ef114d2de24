"""The experts of a MoE layer on CUDA: a grouped GEMM in Triton over rows sorted by expert.

The routed rows of a step (row ``t * k + j``: token ``t``'s ``j``-th choice) are
sorted by expert and each expert's group is padded to a multiple of ``BLOCK_M`` (16 or 64)
(:func:`align_rows`, all in device ops: no host read, so a decode step stays
capturable in a CUDA graph, and its shapes depend on ``T * k`` only). One program
then multiplies ``BLOCK_M`` rows of one expert by a ``BLOCK_N`` tile of that
expert's weight: every weight tile is read once per block of its expert's rows,
and an expert no token chose costs nothing (its blocks do not exist). The layout
is vLLM's fused_moe (``moe_align_block_size``; Kwon et al. 2023) and MegaBlocks'
(Gale et al. 2022, arXiv:2211.15841) block-sparse view of the experts; the code is ours.

Two launches per layer: ``gate_up`` (rows read their token's activations), then,
after ``silu(gate) * up``, ``down`` (rows read their own activations). A token's ``k``
outputs are scaled by their routing weights and summed after, as on the CPU path.

Expert parallelism (worker/layers/moe.py): rows of another rank's expert carry id ``E``;
they form one more group whose blocks are marked unused (``-1``), so no program
computes them, and the down output starts zeroed so that they add nothing.

Float32 weights multiply in IEEE float32 (no TF32), so the CPU interpreter
(``TRITON_INTERPRET=1``, tests/worker/conftest.py) and the GPU agree with a float32
reference; bfloat16/float16 accumulate in float32.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from worker.layers.moe_combine import combine, expert_act
from worker.layers.moe_int4 import dequantize_int4_experts, unpermute_columns
from worker.layers.moe_int8 import dequantize_experts
from worker.layers.moe_w8 import dequantize_w8_experts

#: Rows of one expert per program (tl.dot needs at least 16): 16 for decode-sized steps, where
#: an expert gets a few rows and padding to 64 would waste the work, 64 once the average group
#: fills it (prefill), so each weight tile is read once per 64 rows.
BLOCK_M_SMALL, BLOCK_M_LARGE = 16, 64
BLOCK_N = 64
BLOCK_K = 32


def block_rows(num_rows: int, num_experts: int) -> int:
    """``BLOCK_M`` for a step of ``num_rows`` routed rows over ``num_experts`` (a function of shapes only)."""
    return BLOCK_M_LARGE if num_rows >= BLOCK_M_LARGE * num_experts else BLOCK_M_SMALL


@functools.cache
def _kernel():
    """The jitted kernel, built on first use."""
    import triton

    from worker.kernels import _triton_moe_gemm

    return triton.jit(_triton_moe_gemm.grouped_gemm_kernel)


def align_rows(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed rows sorted by expert, each expert's group padded to ``block_m`` rows.

    Args:
        ids: ``(T, k)`` int64 expert of each choice.
        num_experts: ``E``.
        block_m: rows per block.

    Returns:
        ``(sorted_rows (P,) int32, block_expert (P / block_m,) int32)`` with
        ``P = ceil((T * k + E * (block_m - 1)) / block_m) * block_m`` (a bound fixed by
        the shape): block ``b`` holds rows ``sorted_rows[b * block_m:][:block_m]`` of expert
        ``block_expert[b]`` (``-1``: unused); padding rows hold ``T * k``.
    """
    flat = ids.reshape(-1)  # (n,)
    n = flat.shape[0]
    device = flat.device
    order = torch.argsort(flat, stable=True)  # (n,) rows by expert, token order within one
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    padded_end = torch.cumsum(padded, 0)  # (E,)
    start = torch.cumsum(counts, 0) - counts  # (E,) first sorted row of each expert
    sorted_expert = flat[order]  # (n,)
    position = padded_end[sorted_expert] - padded[sorted_expert] + torch.arange(n, device=device) - start[sorted_expert]
    total = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_rows = torch.full((total,), n, dtype=torch.int32, device=device)
    sorted_rows[position] = order.to(torch.int32)
    block_start = torch.arange(0, total, block_m, device=device)  # (P / block_m,)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # expert whose padded range holds it
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_rows, block_expert


def grouped_gemm(a: torch.Tensor, weight: torch.Tensor, sorted_rows: torch.Tensor, block_expert: torch.Tensor,
                 num_rows: int, a_row_divisor: int, block_m: int, *, zeroed: bool = False) -> torch.Tensor:
    """``out[r] = a[r // a_row_divisor] @ weight[e(r)].T`` for every routed row ``r < num_rows``.

    Args:
        a: ``(M, K)`` activations, last dim contiguous.
        weight: ``(E, N, K)`` contiguous.
        sorted_rows, block_expert: from :func:`align_rows` with ``block_m``.
        num_rows: ``T * k``.
        a_row_divisor: ``k`` when rows read their token's activations, 1 when their own.
        zeroed: start from zeros, so that rows in no used block read as zero (else undefined).

    Returns:
        ``(num_rows, N)`` in ``a.dtype``.

    Raises:
        ValueError: CPU tensors outside Triton's interpreter, or mismatched dims.
    """
    if a.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("a Triton kernel on CPU tensors needs TRITON_INTERPRET=1 before triton is imported")
    if a.shape[1] != weight.shape[2] or a.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"a {tuple(a.shape)} and weight {tuple(weight.shape)} do not fit, or are not contiguous")
    num_experts, n_out, k_in = weight.shape
    out = (torch.zeros if zeroed else torch.empty)(num_rows, n_out, dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return out
    grid = (block_expert.shape[0], -(-n_out // BLOCK_N))
    _kernel()[grid](
        a, weight, out, sorted_rows, block_expert,
        num_rows, n_out, k_in, a_row_divisor, a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        IEEE=a.dtype == torch.float32)
    return out


def grouped_experts_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                           weights: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
                           down_bias: torch.Tensor | None = None, act: nn.Module = expert_act,
                           has_remote: bool = False, gate_up_scale: torch.Tensor | None = None,
                           down_scale: torch.Tensor | None = None, gate_up_perm: torch.Tensor | None = None,
                           down_perm: torch.Tensor | None = None) -> torch.Tensor:
    """worker/layers/moe_experts.py's ``grouped_experts`` with the grouped kernel: ``(T, H)`` in ``x.dtype``.

    Int8 experts (``gate_up_scale (E, 2 * I)`` and ``down_scale (E, H)`` float32 given), int4 ones
    (uint8 packed codes with ``(E, N, K / G, 2)`` scales and offsets, or a CPU stack's tile layout) and an
    8-bit checkpoint's grouped ones (uint8 ``(E, N, K)``, a code a byte): the kernel takes float weights, so
    the layer's stack is dequantized for this call (worker/layers/moe_int8.py, moe_int4.py, moe_w8.py: a
    transient in ``x.dtype``, one layer at a time; no host read, so still capturable); act-order int4
    experts' columns (``gate_up_perm``, ``down_perm``) are put back in the checkpoint's order.

    The biases (gpt-oss) are added to the GEMMs' outputs by each routed row's expert
    (``bias[ids]``: a gather, no host read, so a decode step stays capturable). With
    ``has_remote``, ids equal to ``E = gate_up.shape[0]`` (another rank's expert) add zero.
    """
    if gate_up_scale is not None and down_scale is not None:
        widen = (dequantize_experts if gate_up.dtype == torch.int8 else
                 dequantize_w8_experts if gate_up.shape[-1] == x.shape[-1] else dequantize_int4_experts)
        gate_up = unpermute_columns(widen(gate_up, gate_up_scale, x.dtype), gate_up_perm)  # (E, 2 * I, H)
        down = unpermute_columns(widen(down, down_scale, x.dtype), down_perm)  # (E, H, I)
    num_tokens, top_k = ids.shape
    num_rows = num_tokens * top_k
    num_experts = gate_up.shape[0]
    block_m = block_rows(num_rows, num_experts)
    sorted_rows, block_expert = align_rows(ids, num_experts + has_remote, block_m)
    if has_remote:  # the group of id E: other ranks' rows, computed by no program
        block_expert = torch.where(block_expert == num_experts, -1, block_expert)
    h = grouped_gemm(x, gate_up, sorted_rows, block_expert, num_rows, top_k, block_m)  # (T * k, 2 * I)
    row_expert = ids.reshape(-1)  # (T * k,) expert of routed row t * k + j
    remote = None
    if has_remote and (gate_up_bias is not None or down_bias is not None):
        remote = row_expert == num_experts  # (T * k,) rows of another rank's expert
        row_expert = row_expert.clamp(max=num_experts - 1)  # any valid row for the gather; zeroed below
    if gate_up_bias is not None:
        h = h + gate_up_bias[row_expert]  # (T * k, 2 * I)
    h = act(h)  # (T * k, I); other ranks' rows undefined, never read
    out = grouped_gemm(h, down, sorted_rows, block_expert, num_rows, 1, block_m, zeroed=has_remote)  # (T * k, H)
    if down_bias is not None:
        out = out + down_bias[row_expert]  # (T * k, H)
        if remote is not None:
            out = out.masked_fill(remote[:, None], 0.0)  # another rank's expert adds nothing, bias included
    return combine(out.view(num_tokens, top_k, -1), weights)  # (T, H)
