"""linear_residual (Triton): out = x @ weight.T + bias + residual, residual added in the epilogue.

    x ── tl.dot tiles (fp32 acc) ── +bias ── +residual ──► out      (see _gemm.py)

Traffic: read MK + NK (+N) + MN, write MN (x e); eager's addmm + add read 2MN and write
a fresh MN on top of the GEMM's own write. FLOPs: 2MNK.
"""

from __future__ import annotations

import torch

from opfuse.kernels.checks import check_linear_residual
from opfuse.kernels.registry import register
from opfuse.kernels.triton._common import ACT_NONE, DEVICE_TYPE
from opfuse.kernels.triton._gemm import gemm_epilogue


@register("linear_residual", "cuda")
def linear_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """x @ weight.T + bias + residual; x [..., K], weight [N, K], bias [N] or None, residual [..., N]."""
    k, n = check_linear_residual(x, weight, bias, residual, device_type=DEVICE_TYPE)

    x2 = x.reshape(-1, k)  # [M, K]
    r2 = residual.reshape(-1, n)  # [M, N], any strides
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)  # [M, N]
    gemm_epilogue(x2, weight, bias, r2, ACT_NONE, out)
    return out.view(*x.shape[:-1], n)
