"""linear_residual (Triton): out = x @ weight.T + bias + residual, residual added in the epilogue.

    x ── tl.dot tiles (fp32 acc) ── +bias ── +residual ──► out      (see _gemm.py)

Traffic: read MK + NK (+N) + MN, write MN (x e); eager's addmm + add read 2MN and write
a fresh MN on top of the GEMM's own write. FLOPs: 2MNK.
"""

from __future__ import annotations

import torch

from opfuse.kernels.registry import register
from opfuse.kernels.triton._common import ACT_NONE, check_same, check_shape, check_tensor
from opfuse.kernels.triton._gemm import gemm_epilogue


@register("linear_residual", "cuda")
def linear_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """x @ weight.T + bias + residual; x [..., K], weight [N, K], bias [N] or None, residual [..., N]."""
    op = "linear_residual"
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight, ndim_min=2)
    check_tensor(op, "residual", residual)
    if bias is not None:
        check_tensor(op, "bias", bias)
    k = x.shape[-1]
    n = weight.shape[0]
    check_shape(op, "weight", weight, (n, k))
    if bias is not None:
        check_shape(op, "bias", bias, (n,))
    check_shape(op, "residual", residual, (*x.shape[:-1], n))
    check_same(op, x=x, weight=weight, residual=residual)

    x2 = x.reshape(-1, k)  # [M, K]
    r2 = residual.reshape(-1, n)  # [M, N], any strides
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)  # [M, N]
    gemm_epilogue(x2, weight, bias, r2, ACT_NONE, out)
    return out.view(*x.shape[:-1], n)
