"""linear_residual: out = x @ weight.T + bias + residual, residual folded into the GEMM.

    residual ─┐
              +bias (numba, one pass) ── out ── out += x @ weight.T (BLAS, beta=1) ──► out
    bias ─────┘

Traffic (float32): read MN (+N) + write MN for the seed, then BLAS accumulates in place
(beta = 1), so no pass over the output after the GEMM. Eager: addmm, then add, which reads
2MN and writes a fresh MN.
"""

from __future__ import annotations

import torch
from numba import njit, prange

from opfuse.kernels.cpu import _gemm, _math
from opfuse.kernels.checks import check_linear_residual
from opfuse.kernels.cpu._launch import f32, f32_rows, f32_vec, launch
from opfuse.kernels.registry import register


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_add(r, b, y):  # r, b: [N] in; y: [N] out; read 2N, write N
    for j in range(r.shape[0]):
        y[j] = r[j] + b[j]


@njit(parallel=True, error_model="numpy", cache=True)
def _linear_residual_kernel(r, b, out):
    # r: [M, N] f32 residual; b: [N] f32; out: [M, N] f32 <- r + b (GEMM accumulates later)
    for i in prange(r.shape[0]):
        _row_add(r[i], b, out[i])


@register("linear_residual", "cpu")
def linear_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """x @ weight.T + bias + residual; x [..., K], weight [N, K], bias [N] or None, residual [..., N]."""
    k, n = check_linear_residual(x, weight, bias, residual, device_type="cpu")

    x2 = f32(x).reshape(-1, k)  # [M, K]
    out = torch.empty((x2.shape[0], n), dtype=torch.float32)  # [M, N]
    launch(_linear_residual_kernel, out.numel())(f32_rows(residual, n), f32_vec(bias, n), out.numpy())  # read MN, write MN
    out = _gemm.accumulate(x2, _gemm.operand(weight), out)  # beta=1 / add post-op: read MK + NK + MN, write MN
    return out.view(*x.shape[:-1], n).to(x.dtype)
