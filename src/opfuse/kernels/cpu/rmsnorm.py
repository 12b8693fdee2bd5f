"""rmsnorm: out = weight * cast(x * rsqrt(mean(x^2, -1) + eps), x.dtype), as HF ``LlamaRMSNorm``.

    x ── sum of squares (blocked, float64 carry) ── rstd
    x ── x * rstd ── round to x.dtype ── * weight ──► out

HF Llama computes the normalised value in float32, casts it to the input dtype, then
multiplies by the weight in the promoted dtype. The cast is reproduced here bit-exactly
(round-to-nearest-even to float16 / bfloat16 on the float32 bits), so the result dtype is
``promote(x.dtype, weight.dtype)`` and differs from eager only through the statistics' order
of summation. No mean is subtracted, so there is no cancellation: each float32 block of
``_BLOCK`` squares is summed with fastmath (8-wide partial sums) and the block sums are
carried in float64, keeping rows up to 8192 wide at ~1e-7 relative error.

Traffic (float32): read MN (+N), write MN; each row is read twice (stats, apply) from L1/L2.
Eager (HF): pow, mean, add, rsqrt, mul, cast, mul = read ~5MN, write ~4MN of fresh tensors.
The row passes here are shared with add_rmsnorm.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, prange

from opfuse.kernels.cpu import _math
from opfuse.kernels.checks import check_rmsnorm
from opfuse.kernels.cpu._launch import by_address, f32_rows, f32_vec, launch, to_torch
from opfuse.kernels.registry import register

_JIT = dict(error_model="numpy", cache=True)

# Rounding of a float32 value to the I/O dtype (kept as float32): code per dtype.
ROUND_NONE, ROUND_F16, ROUND_BF16 = 0, 1, 2
ROUND_CODE: dict[torch.dtype, int] = {torch.float32: ROUND_NONE, torch.float16: ROUND_F16, torch.bfloat16: ROUND_BF16}

_BLOCK = 256  # squares summed in float32 per block: 256 / 32 partial sums = 8 adds deep
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_ABS_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)  # |bits| above this: NaN (kept as is)
_BF16_HALF = np.uint32(0x7FFF)  # round-to-nearest-even on the 16 dropped bits
_BF16_KEEP = np.uint32(0xFFFF0000)
_F16_HALF = np.uint32(0x0FFF)  # ... on the 13 dropped mantissa bits (float16 normals)
_F16_KEEP = np.uint32(0xFFFFE000)
_F16_MIN_NORMAL = np.float32(2.0**-14)
_F16_SUBNORMAL_MAGIC = np.float32(0.75)  # ulp(0.75) = 2^-24 = float16 subnormal step
_F16_OVERFLOW = np.float32(65520.0)  # rounds to inf in float16
_INF = np.float32(np.inf)


@njit(fastmath=_math._APPLY, **_JIT)
def round_bf16(v):
    """float32 -> nearest bfloat16 (ties to even), returned as float32. NaN passes through."""
    u = _math.f32_bits(v)
    if (u & _ABS_MASK) > _INF_BITS:
        return v
    return _math.f32_from_bits((u + _BF16_HALF + ((u >> 16) & 1)) & _BF16_KEEP)


@njit(fastmath=_math._APPLY, **_JIT)
def round_f16(v):
    """float32 -> nearest float16 (ties to even, subnormals, overflow to inf), as float32."""
    if v != v:  # NaN (any payload: 0x7FFFFFFF would carry into the sign bit below)
        return v
    a = abs(v)
    if a < _F16_MIN_NORMAL:  # subnormal grid 2^-24: (v + 0.75) - 0.75 rounds exactly (no reassoc)
        return (v + _F16_SUBNORMAL_MAGIC) - _F16_SUBNORMAL_MAGIC
    if a >= _F16_OVERFLOW:
        return np.copysign(_INF, v)
    u = _math.f32_bits(v)
    return _math.f32_from_bits((u + _F16_HALF + ((u >> 13) & 1)) & _F16_KEEP)


@njit(fastmath=_math._APPLY, **_JIT)
def row_round(y, round_to):  # y: [N] f32 in place; read N, write N (no-op for ROUND_NONE)
    if round_to == ROUND_F16:
        for j in range(y.shape[0]):
            y[j] = round_f16(y[j])
    elif round_to == ROUND_BF16:
        for j in range(y.shape[0]):
            y[j] = round_bf16(y[j])


@njit(fastmath=_math._REDUCE, **_JIT)
def row_sum_squares(x):  # x: [N] f32; read N
    n = x.shape[0]
    acc = 0.0  # float64 carry of the float32 block sums
    for b0 in range(0, n, _BLOCK):
        part = _F0
        for j in range(b0, min(b0 + _BLOCK, n)):
            part += x[j] * x[j]
        acc += part
    return acc


@njit(**_JIT)
def row_rms_rstd(x, eps):  # x: [N] f32; read N
    # No fast-math on the rsqrt: as eager (x.pow(2).mean() in float32), squares that
    # overflow give a variance of inf and 1/sqrt(inf) = 0 (a row of zeros, not NaN).
    return _F1 / np.sqrt(np.float32(row_sum_squares(x) / x.shape[0]) + eps)


@njit(fastmath=_math._APPLY, **_JIT)
def row_rms_apply(x, rstd, w, y, round_to):  # x: [N] f32, w: [N] f32, y: [N] f32 out; read 2N, write N
    if round_to == ROUND_NONE:
        for j in range(y.shape[0]):
            y[j] = w[j] * (x[j] * rstd)
    elif round_to == ROUND_F16:
        for j in range(y.shape[0]):
            y[j] = w[j] * round_f16(x[j] * rstd)
    else:
        for j in range(y.shape[0]):
            y[j] = w[j] * round_bf16(x[j] * rstd)


@njit(parallel=True, **_JIT)
def _rmsnorm_kernel(x, w, eps, out, round_to):
    # x: [M, N] f32; w: [N] f32; out: [M, N] f32; round_to: ROUND_* of x's dtype
    for i in prange(x.shape[0]):
        rstd = row_rms_rstd(x[i], eps)  # read N
        row_rms_apply(x[i], rstd, w, out[i], round_to)  # read 2N, write N


@njit(**_JIT)
def _rmsnorm_at(xp, wp, eps, outp, m, n):
    # _rmsnorm_kernel on float32 tensors given by address (x, out: [M, N]; w: [N]), serial
    x, w, out = carray(_math.f32_at(xp), (m, n)), carray(_math.f32_at(wp), (n,)), carray(_math.f32_at(outp), (m, n))
    e = np.float32(eps)
    for i in range(m):
        row_rms_apply(x[i], row_rms_rstd(x[i], e), w, out[i], ROUND_NONE)


@register("rmsnorm", "cpu")
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; x [..., N], weight [N] -> [..., N] of promote(x, weight) dtype."""
    n = check_rmsnorm(x, weight, device_type="cpu")
    if by_address(x, weight):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)  # float32 like x, not the default dtype
        _rmsnorm_at(x.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), x.numel() // n, n)
        return out
    x2 = f32_rows(x, n)  # [M, N]
    out = np.empty_like(x2)  # [M, N]
    launch(_rmsnorm_kernel, x2.size)(x2, f32_vec(weight, n), np.float32(eps), out, ROUND_CODE[x.dtype])
    return to_torch(out, tuple(x.shape), torch.promote_types(x.dtype, weight.dtype))
