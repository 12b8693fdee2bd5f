"""add_layernorm_bf16: the SkipLayerNorm of a bf16 plan, out = LayerNorm(x + residual)·w + b,
from a bf16 GEMM's output x, written twice: float32 (the residual stream) and bf16 (the next
GEMM's input).

    x (bf16) ─┐
              add ── shift ── mean/var ── normalise ──┬──► out   [..., N] float32
    r (f32) ──┘                                      └──► out_b [..., N] bf16 (round to nearest even)

In a bf16 plan the same step ran as four ATen ops: x → float32, + residual, layer_norm, → bf16
(read 2 + 8 + 4 + 4, write 4 + 4 + 4 + 2 bytes per element); here read 2 + 4, write 4 + 2.
The statistics are float32 with the row shift of :mod:`opfuse.kernels.cpu.add_layernorm`
(y_j = (x_j − x_0) + (r_j − r_0), exact differences; mean and variance of y; Welford-free
two-pass, as the float32 kernel). NaN stays NaN in both outputs (bf16 0x7FC0).

``add_layernorm_bf16_`` is the in-place form a plan uses where neither input is read again
(:func:`opfuse.precision.inplace_add_layernorm_bf16`): the float32 result overwrites the
residual, the bf16 one x, row by row (each row is read whole into the float32 row before
either is written: the same kernel, the same bits). No output buffers are allocated and the
written lines are the ones just read, so the write-allocate reads of two fresh buffers go
(read 2 + 4, write 4 + 2 bytes per element either way; measured on the Intel Xeon with AMX,
BERT-base 1×128 bf16 plan, one thread: 38.8 vs 39.8 ms per forward, 40.4 vs 41.6 ms with
the caches evicted before each).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, prange

from opfuse.kernels.checks import check_add_layernorm_bf16, check_add_layernorm_bf16_inplace
from opfuse.kernels.cpu import _math
from opfuse.kernels.cpu._launch import by_address, f32_vec, launch
from opfuse.kernels.registry import register

_BF16_NAN = np.uint16(0x7FC0)


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_add_shift(x, r, i, y):  # x: [M, N] uint16 bf16 bits, r: [M, N] f32, row i; y: [N] out
    x0 = _math.bf16_to_f32(x[i, 0])
    r0 = r[i, 0]
    for j in range(y.shape[0]):  # read 2N + 4N, write 4N
        y[j] = (_math.bf16_to_f32(x[i, j]) - x0) + (r[i, j] - r0)


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_write(y, mean, rstd, w, b, out, ob, i):
    # out[i, j] = (y_j − mean)·rstd·w_j + b_j (float32), ob[i, j] = its bf16 bits (NaN → the
    # quiet NaN); y is a scratch row, apart from out and ob, so the loop vectorises in the
    # in-place form too (out = r and ob = x there: written only after the row is read whole)
    for j in range(y.shape[0]):
        v = (y[j] - mean) * rstd * w[j] + b[j]
        out[i, j] = v
        u = _math.f32_to_bf16(v)
        ob[i, j] = u if v == v else _BF16_NAN


_BLOCK = 16  # rows per parallel task (one scratch row each)


@njit(error_model="numpy", cache=True)
def _rows(x, r, w, b, eps, out, ob, lo, hi, y):
    # rows lo..hi-1 of the kernel below; y: [N] f32 scratch row
    for i in range(lo, hi):
        _row_add_shift(x, r, i, y)
        mean = _math.row_mean(y)
        rstd = _math.row_rstd(y, mean, eps)
        _row_write(y, mean, rstd, w, b, out, ob, i)


@njit(parallel=True, error_model="numpy", cache=True)
def _add_layernorm_bf16_kernel(x, r, w, b, eps, out, ob):
    # x: [M, N] uint16 (bf16 bits); r: [M, N] f32; w, b: [N] f32; out: [M, N] f32; ob: [M, N] uint16.
    # The shifted row goes to a scratch row, not to out: in the in-place form out is r, and a
    # loop reading r[i] while writing it ran scalar (LLVM's overlap check fails at run time):
    # 98 against 60 µs for the functional form at 128×768 (Zen 4, one thread)
    m = x.shape[0]
    for blk in prange((m + _BLOCK - 1) // _BLOCK):
        _rows(x, r, w, b, eps, out, ob, blk * _BLOCK, min(m, (blk + 1) * _BLOCK), np.empty(x.shape[1], np.float32))


@njit(error_model="numpy", cache=True)
def _add_layernorm_bf16_at(xp, rp, wp, bp, eps, m, n):
    # the in-place kernel on tensors given by address (serial): x [M, N] bf16 bits, r [M, N]
    # f32 (both overwritten), w [N] f32, b [N] f32 at bp or none when bp is 0
    x, r = carray(_math.u16_at(xp), (m, n)), carray(_math.f32_at(rp), (m, n))
    w = carray(_math.f32_at(wp), (n,))
    b = carray(_math.f32_at(bp), (n,)) if bp != 0 else np.zeros(n, np.float32)
    _rows(x, r, w, b, eps, r, x, 0, m, np.empty(n, np.float32))


@register("add_layernorm_bf16", "cpu")
def add_layernorm_bf16(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] bf16, residual [..., N] float32 (same shape), weight / bias [N] -> (out
    [..., N] float32, out [..., N] bf16): LayerNorm(x + residual) over the last dim, eps in
    the variance (torch.nn.functional.layer_norm's formula). Raises ValueError (named) for
    other dtypes, shapes or devices (:func:`opfuse.kernels.checks.check_add_layernorm_bf16`)."""
    n = check_add_layernorm_bf16(x, residual, weight, bias, device_type="cpu")
    xb = x.detach().contiguous().view(torch.int16).numpy().reshape(-1, n).view(np.uint16)
    r2 = residual.detach().contiguous().numpy().reshape(-1, n)
    out = torch.empty(x.shape, dtype=torch.float32)
    ob = torch.empty(x.shape, dtype=torch.bfloat16)
    launch(_add_layernorm_bf16_kernel, xb.size)(
        xb, r2, f32_vec(weight, n), f32_vec(bias, n), np.float32(eps), out.numpy().reshape(-1, n),
        ob.view(torch.int16).numpy().reshape(-1, n).view(np.uint16))
    return out, ob


@register("add_layernorm_bf16_", "cpu")
def add_layernorm_bf16_(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> None:
    """:func:`add_layernorm_bf16` in place: x [..., N] bf16 contiguous becomes the bf16
    output, residual [..., N] float32 contiguous the float32 one (module docstring). Raises
    ValueError (named) as :func:`add_layernorm_bf16`, and for non-contiguous x or residual
    (:func:`opfuse.kernels.checks.check_add_layernorm_bf16_inplace`)."""
    n = check_add_layernorm_bf16_inplace(x, residual, weight, bias, device_type="cpu")
    if by_address(residual, weight) and (bias is None or by_address(bias)):  # x: checked contiguous bf16
        # no numpy views of the four tensors: between the GEMMs of a forward (caches evicted)
        # the views and weight conversions cost ~85 µs a call against ~5 µs timed alone
        _add_layernorm_bf16_at(x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                               0 if bias is None else bias.data_ptr(), np.float32(eps), x.numel() // n, n)
        return
    xb = x.detach().view(torch.int16).numpy().reshape(-1, n).view(np.uint16)
    r2 = residual.detach().numpy().reshape(-1, n)
    launch(_add_layernorm_bf16_kernel, xb.size)(xb, r2, f32_vec(weight, n), f32_vec(bias, n), np.float32(eps), r2, xb)
