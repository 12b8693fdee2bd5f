"""linear_bias_gelu: out = gelu(x @ weight.T + bias).

    x ── GEMM (BLAS, into out) ── +bias, gelu (numba, in place) ──► out

The GEMM goes to BLAS (the measured-faster backend, see _gemm.py, into a preallocated float32 output); the epilogue is one
in-place pass. Traffic of the epilogue (float32): read MN (+N), write MN. Eager: addmm
then gelu adds one extra read MN + write MN of a fresh tensor.
"""

from __future__ import annotations

import torch
from numba import njit, prange

from opfuse.kernels.cpu import _gemm, _math
from opfuse.kernels.checks import check_linear_bias_gelu
from opfuse.kernels.cpu._launch import f32, f32_vec, launch
from opfuse.kernels.registry import register

@njit(parallel=True, error_model="numpy", cache=True)
def _linear_bias_gelu_kernel(h, b, use_tanh):
    # h: [M, N] f32, GEMM result, overwritten by gelu(h + b); b: [N] f32
    for i in prange(h.shape[0]):
        _math.row_bias_gelu(h[i], b, use_tanh)  # read N + N, write N


@register("linear_bias_gelu", "cpu")
def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(x @ weight.T + bias); x [..., K], weight [N, K], bias [N] -> [..., N]."""
    k, n = check_linear_bias_gelu(x, weight, bias, approximate, device_type="cpu")

    x2 = f32(x).reshape(-1, k)  # [M, K]
    out = _gemm.linear(x2, _gemm.operand(weight))  # [M, N]; read MK + NK, write MN
    launch(_linear_bias_gelu_kernel, out.numel())(out.numpy(), f32_vec(bias, n), approximate == "tanh")
    return out.view(*x.shape[:-1], n).to(x.dtype)
