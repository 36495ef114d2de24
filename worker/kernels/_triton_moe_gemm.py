"""The Triton source of worker/kernels/triton_moe.py's grouped expert GEMM (that module documents it).

Kept apart, undecorated, so that importing the wrapper costs no Triton import, and
the same function can be jitted for the GPU or for Triton's CPU interpreter.
"""

import triton.language as tl


def grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_rows_ptr, block_expert_ptr,
    num_rows, N, K, a_row_divisor,
    stride_a, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Program (m, n): the BLOCK_M routed rows sorted_rows[m * BLOCK_M:][:BLOCK_M], all of one
    # expert (block_expert[m]; -1: a block past the last expert's group, nothing to do), times
    # columns [n * BLOCK_N, +BLOCK_N) of that expert's weight (N, K). A row r >= num_rows is
    # padding. Row r reads activation row r // a_row_divisor and writes output row r.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(sorted_rows_ptr + offs_m)
        row_ok = rows < num_rows
        a_rows = tl.where(row_ok, rows // a_row_divisor, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_a + (k0 + offs_k)[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # (BLOCK_K, BLOCK_N): W.T's tile
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")  # float32 as float32, not TF32
            else:
                acc += tl.dot(a, w)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
