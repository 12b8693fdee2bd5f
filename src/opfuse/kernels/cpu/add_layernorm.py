"""add_layernorm: out = LayerNorm(x + residual) * weight + bias, optionally also s = x + residual.

    x ─┐
       add ── s ──┬── (emit_sum) ──────────────────────► sum
    r ─┘          └── shift ── mean/var ── normalise ──► out

Traffic (float32): read 2MN (+2N), write MN (+MN with emit_sum). Eager runs add and
layer_norm as two kernels: read 2MN, write MN, read MN, write MN (+ the stats pass).
Each row is staged in the output row (L1-resident) between the four row passes.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from opfuse.kernels.cpu import _math
from opfuse.kernels.checks import check_add_layernorm
from opfuse.kernels.cpu._launch import f32_rows, f32_vec, launch, to_torch
from opfuse.kernels.registry import register


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_add_shift(x, r, y, s, emit_sum):  # x, r: [N] in; y: [N] shifted sum out; s: [N] sum out
    # y_j = (x_j - x_0) + (r_j - r_0): each difference is exact for rows far from zero
    # (Sterbenz), so y carries the sum's deviations without the float32 rounding of x + r.
    x0 = x[0]
    r0 = r[0]
    if emit_sum:
        for j in range(x.shape[0]):  # read 2N, write 2N
            s[j] = x[j] + r[j]
            y[j] = (x[j] - x0) + (r[j] - r0)
    else:
        for j in range(x.shape[0]):  # read 2N, write N
            y[j] = (x[j] - x0) + (r[j] - r0)


@njit(parallel=True, error_model="numpy", cache=True)
def _add_layernorm_kernel(x, r, w, b, eps, out, s, emit_sum):
    # x, r: [M, N] f32; w, b: [N] f32; out: [M, N] f32; s: [M, N] f32 (is `out` when not emit_sum)
    for i in prange(x.shape[0]):
        y = out[i]
        _row_add_shift(x[i], r[i], y, s[i], emit_sum)
        mean = _math.row_mean(y)
        rstd = _math.row_rstd(y, mean, eps)
        _math.row_normalize(y, mean, rstd, w, b)


@register("add_layernorm", "cpu")
def add_layernorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    emit_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LayerNorm(x + residual) over the last dim; returns (out, x + residual or None)."""
    n = check_add_layernorm(x, residual, weight, bias, device_type="cpu")

    x2, r2 = f32_rows(x, n), f32_rows(residual.expand(x.shape), n)  # [M, N] (a row-broadcast residual: one copy)
    out = np.empty_like(x2)  # [M, N]
    s = np.empty_like(x2) if emit_sum else out  # [M, N]; untouched unless emit_sum
    launch(_add_layernorm_kernel, x2.size)(x2, r2, f32_vec(weight, n), f32_vec(bias, n), np.float32(eps), out, s, bool(emit_sum))

    out_t = to_torch(out, tuple(x.shape), x.dtype)
    sum_t = to_torch(s, tuple(x.shape), x.dtype) if emit_sum else None
    return out_t, sum_t
