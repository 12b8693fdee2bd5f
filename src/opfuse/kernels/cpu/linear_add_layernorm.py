"""linear_add_layernorm: out = LayerNorm(x @ weight.T + bias + residual) * ln_weight + ln_bias,
optionally also s = x @ weight.T + bias + residual (pre-LN models: the next residual).

    residual ─┐
              seed: (r - r[0]) + bias ── y ── y += x @ weight.T (BLAS, beta=1) ── y
    bias ─────┘       (numba, one pass)                                            │
        ┌──────────────────────────────────────────────────────────────────────────┘
        └── per row: shift ── mean/var ── normalise ──► out
                     └── (emit_sum) y + r[0] ─────────► sum

The GEMM accumulates into a seed that already holds residual + bias (linear_residual's
trick, C = r + b with beta = 1), so the linear's output and the residual sum never make
a round trip through memory of their own. The seed is the residual *shifted by its first
element* (r_j - r_0 is exact for rows far from zero, Sterbenz), so rows like
1234 + 1e-3·randn keep their spread through the float32 GEMM accumulation; the LayerNorm
pass then uses the shifted two-pass statistics of ``_math`` (row_shift / row_mean /
row_rstd / row_normalize) and the emitted sum adds r_0 back once.

Traffic (float32): seed read MN (+N), write MN; GEMM read MK + NK + MN, write MN; norm
read MN (+2N), write MN (+ read/write MN with emit_sum; rows are L1-resident between the
row passes). Eager: addmm (read MK + NK + N, write MN), add (read 2MN, write MN),
layer_norm (read MN, write MN + stats).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from opfuse.kernels.checks import check_linear_add_layernorm
from opfuse.kernels.cpu import _gemm, _math
from opfuse.kernels.cpu._launch import f32, f32_rows, f32_vec, launch
from opfuse.kernels.registry import register


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_seed_shifted(r, b, y):  # r, b: [N] in; y: [N] out; read 2N, write N
    r0 = r[0]
    for j in range(r.shape[0]):
        y[j] = (r[j] - r0) + b[j]  # no reassoc: the exact difference is kept
    return r0


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_unshift(y, r0):  # y: [N] in place; read N, write N
    for j in range(y.shape[0]):
        y[j] = y[j] + r0


@njit(parallel=True, error_model="numpy", cache=True)
def _seed_kernel(r, b, y, r0):
    # r: [M, N] f32 residual; b: [N] f32; y: [M, N] f32 <- (r - r[:, :1]) + b; r0: [M] f32 <- r[:, 0]
    for i in prange(r.shape[0]):
        r0[i] = _row_seed_shifted(r[i], b, y[i])


@njit(parallel=True, error_model="numpy", cache=True)
def _layernorm_kernel(y, r0, w, b, eps, out, emit_sum):
    # y: [M, N] f32 shifted sum (GEMM accumulated); r0: [M] f32; w, b: [N] f32;
    # out: [M, N] f32 <- LayerNorm(y); with emit_sum, y <- y + r0 (the residual sum)
    for i in prange(y.shape[0]):
        o = out[i]
        _math.row_shift(y[i], o)  # read N, write N
        mean = _math.row_mean(o)  # read N
        rstd = _math.row_rstd(o, mean, eps)  # read N
        _math.row_normalize(o, mean, rstd, w, b)  # read 3N, write N
        if emit_sum:
            _row_unshift(y[i], r0[i])  # read N, write N


@register("linear_add_layernorm", "cpu")
def linear_add_layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor | None,
    eps: float,
    emit_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LayerNorm(x @ weight.T + bias + residual) over N; returns (out, the sum or None).
    x [..., K], weight [N, K], bias [N] or None, residual [..., N], ln_weight [N], ln_bias [N] or None."""
    k, n = check_linear_add_layernorm(x, weight, bias, residual, ln_weight, ln_bias, device_type="cpu")

    x2 = f32(x).reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)  # [M, N] shifted sum
    r0 = np.empty(m, dtype=np.float32)  # [M] each row's shift
    launch(_seed_kernel, y.numel())(f32_rows(residual, n), f32_vec(bias, n), y.numpy(), r0)  # read MN, write MN
    _gemm.matmul_accumulate(x2, _gemm.operand(weight), y)  # BLAS, beta=1: read MK + NK + MN, write MN
    out = np.empty((m, n), dtype=np.float32)  # [M, N]
    launch(_layernorm_kernel, y.numel())(y.numpy(), r0, f32_vec(ln_weight, n), f32_vec(ln_bias, n), np.float32(eps),
                                         out, bool(emit_sum))  # read MN, write MN (+ MN, MN)

    shape = (*x.shape[:-1], n)
    out_t = torch.from_numpy(out).view(shape).to(x.dtype)
    sum_t = y.view(shape).to(x.dtype) if emit_sum else None
    return out_t, sum_t
