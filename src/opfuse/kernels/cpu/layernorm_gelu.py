"""layernorm_gelu: out = gelu(LayerNorm(x) * weight + bias), one pass over x.

    x ── shift ── mean/var ── normalise·w+b ── gelu ──► out
                                   (erf form for "none", tanh form for "tanh")

Traffic (float32): read MN (+2N), write MN. Eager: layer_norm reads MN, writes MN, then
gelu reads MN, writes MN, so fusion halves the traffic; the GELU polynomial (~25 flops per
element, no libm call) makes this compute-bound on AVX2.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from opfuse.kernels.cpu import _math
from opfuse.kernels.checks import check_layernorm_gelu
from opfuse.kernels.cpu._launch import f32_rows, f32_vec, launch, to_torch
from opfuse.kernels.registry import register

@njit(parallel=True, error_model="numpy", cache=True)
def _layernorm_gelu_kernel(x, w, b, eps, use_tanh, out):
    # x: [M, N] f32; w, b: [N] f32; out: [M, N] f32
    for i in prange(x.shape[0]):
        y = out[i]  # [N], the row is staged here: L1-resident across the passes below
        _math.row_shift(x[i], y)  # read N, write N
        mean = _math.row_mean(y)  # read N (L1)
        rstd = _math.row_rstd(y, mean, eps)  # read N (L1)
        _math.row_normalize_gelu(y, mean, rstd, w, b, use_tanh)  # read N (L1) + 2N, write N


@register("layernorm_gelu", "cpu")
def layernorm_gelu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    approximate: str,
) -> torch.Tensor:
    """gelu(LayerNorm(x)) over the last dim; approximate in {"none", "tanh"}."""
    n = check_layernorm_gelu(x, weight, bias, approximate, device_type="cpu")

    x2 = f32_rows(x, n)  # [M, N]
    out = np.empty_like(x2)  # [M, N]
    launch(_layernorm_gelu_kernel, x2.size)(x2, f32_vec(weight, n), f32_vec(bias, n), np.float32(eps), approximate == "tanh", out)
    return to_torch(out, tuple(x.shape), x.dtype)
