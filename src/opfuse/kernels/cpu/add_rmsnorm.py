"""add_rmsnorm: s = x + residual (the next residual), out = rmsnorm(s), in one pass.

    x ─┐
       add ── round to x.dtype ── s ──┬──────────────────────────────► s
    r ─┘                              └── rstd, s * rstd, round, * w ──► out

As HF Llama's decoder layer (``residual + hidden_states`` in the model dtype, then
``LlamaRMSNorm``): the sum is rounded to x's dtype before the statistics, so both outputs
are what eager computes; out has dtype promote(x, weight), s has x's dtype. Returns
(out, s), the order of add_layernorm_sum. Row passes and rounding from rmsnorm.py.

Traffic (float32): read 2MN (+N), write 2MN. Eager: add (read 2MN, write MN) then RMSNorm
(read ~5MN, write ~4MN).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, prange

from opfuse.kernels.cpu import _math
from opfuse.kernels.checks import check_add_rmsnorm
from opfuse.kernels.cpu._launch import by_address, f32_rows, f32_vec, launch, to_torch
from opfuse.kernels.cpu.rmsnorm import ROUND_CODE, ROUND_NONE, row_rms_apply, row_rms_rstd, row_round
from opfuse.kernels.registry import register


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_add(x, r, s):  # x, r: [N] f32 in; s: [N] f32 out; read 2N, write N
    for j in range(s.shape[0]):
        s[j] = x[j] + r[j]


@njit(parallel=True, error_model="numpy", cache=True)
def _add_rmsnorm_kernel(x, r, w, eps, out, s, round_to):
    # x, r: [M, N] f32; w: [N] f32; out, s: [M, N] f32; round_to: ROUND_* of x's dtype
    for i in prange(x.shape[0]):
        _row_add(x[i], r[i], s[i])  # read 2N, write N
        row_round(s[i], round_to)  # s as eager stores it (L1)
        rstd = row_rms_rstd(s[i], eps)  # read N (L1)
        row_rms_apply(s[i], rstd, w, out[i], round_to)  # read 2N (L1), write N



@njit(error_model="numpy", cache=True)
def _add_rmsnorm_at(xp, rp, wp, eps, outp, sp, m, n):
    # _add_rmsnorm_kernel on float32 tensors given by address (x, r, out, s: [M, N]; w: [N]), serial
    x, r, w = carray(_math.f32_at(xp), (m, n)), carray(_math.f32_at(rp), (m, n)), carray(_math.f32_at(wp), (n,))
    out, s = carray(_math.f32_at(outp), (m, n)), carray(_math.f32_at(sp), (m, n))
    e = np.float32(eps)
    for i in range(m):
        _row_add(x[i], r[i], s[i])
        row_rms_apply(s[i], row_rms_rstd(s[i], e), w, out[i], ROUND_NONE)


@register("add_rmsnorm", "cpu")
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); x, residual [..., N], weight [N]."""
    n = check_add_rmsnorm(x, residual, weight, device_type="cpu")
    if by_address(x, residual, weight):
        dense = torch.contiguous_format  # float32 like x, never torch's default dtype
        out, s = torch.empty_like(x, memory_format=dense), torch.empty_like(x, memory_format=dense)
        _add_rmsnorm_at(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), s.data_ptr(),
                        x.numel() // n, n)
        return out, s

    x2, r2 = f32_rows(x, n), f32_rows(residual, n)  # [M, N]
    out = np.empty_like(x2)  # [M, N]
    s = np.empty_like(x2)  # [M, N]
    launch(_add_rmsnorm_kernel, x2.size)(x2, r2, f32_vec(weight, n), np.float32(eps), out, s, ROUND_CODE[x.dtype])
    out_t = to_torch(out, tuple(x.shape), torch.promote_types(x.dtype, weight.dtype))
    return out_t, to_torch(s, tuple(x.shape), x.dtype)
