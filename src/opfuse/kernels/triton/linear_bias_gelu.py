"""linear_bias_gelu (Triton): out = gelu(x @ weight.T + bias) as one GEMM with a fused epilogue.

    x ── tl.dot tiles (fp32 acc) ── +bias ── gelu (erf | tanh) ──► out      (see _gemm.py)

Traffic: read MK + NK (+N), write MN (x e); eager's addmm + gelu add read MN + write MN.
FLOPs: 2MNK (+ ~20 MN epilogue).
"""

from __future__ import annotations

import torch

from opfuse.kernels.checks import check_linear_bias_gelu
from opfuse.kernels.registry import register
from opfuse.kernels.triton._common import DEVICE_TYPE, act_of
from opfuse.kernels.triton._gemm import _gemm_epilogue_fwd_kernel, gemm_epilogue  # noqa: F401  (kernel: aot.py)


@register("linear_bias_gelu", "cuda")
def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(x @ weight.T + bias); x [..., K], weight [N, K], bias [N] -> [..., N]."""
    k, n = check_linear_bias_gelu(x, weight, bias, approximate, device_type=DEVICE_TYPE)
    act = act_of(approximate)

    x2 = x.reshape(-1, k)  # [M, K], any strides
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)  # [M, N]
    gemm_epilogue(x2, weight, bias, None, act, out)
    return out.view(*x.shape[:-1], n)
