"""linear_gemv: y = x @ weight.T (+ bias) for a few rows, float32, the weight streamed once.

    x [M, K] f32 ──┐
                   ├── M ≤ GEMV_ROWS: numba, one float32 dot product per (row, output), the
    W [N, K] f32 ──┘   weight row-major as the model holds it ──► y [M, N] f32 (+ bias)
                       (M > GEMV_ROWS: ATen's addmm / mm, eager's GEMM)

Where numba compiles for AVX-512F the dot products run on :mod:`opfuse.kernels.cpu._f32dot`'s
512-bit rows (one weight row's 64-byte loads shared by up to four rows of x,
``llvm.fma.v16f32``): the 40 weights of a Llama decode step (46 MB, streamed in turn, one
thread, Zen 4) ran 3.65 ms (25.4 GB/s) against 4.53 ms (20.5 GB/s) for the vectorised numba
loop, and a 32000×512 LM head 2.45 against 3.28 ms (OpenBLAS's GEMV on Wᵀ: 2.96).

A second kernel, :func:`gemv_wt`, streams a row-padded Wᵀ [K, ld] (the ``blas`` backend's
layout, :func:`opfuse.kernels.cpu._gemm.blas_layout`) for one or two rows: y += x[k]·Wᵀ[k]
four rows of Wᵀ at a time (an axpy per row, y in L1). On the Zen 2 machines (one thread,
caches evicted) it ran 209 / 516 / 600 µs at 768×768, 3072×768 (N×K) and 768×3072 where
MKL's GEMV on the same padded operand took 267 / 577 / 755 (and on the row-major weight
271 / 857 / 565), so a dynamic plan whose range starts at one row keeps the backend.

A decode step's GEMMs are weight streams (M = batch rows): the time is the weight's bytes
over the memory bandwidth, plus the call. Measured on the Zen 5 machines (one thread,
caches evicted), where MKL skips its AVX-512 paths: 114 vs 164 µs at 1376×512 and 2.0 vs
2.5 ms for a 32000×512 LM head against MKL's GEMV. A backend of :mod:`opfuse.gemm` (``gemv``),
chosen by measurement like the others.

Traffic: read 4NK + 4MK + 4N, write 4MN bytes; FLOPs 2MNK.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit

from opfuse.kernels.checks import check_linear_gemv
from opfuse.kernels.cpu import _f32dot, _math
from opfuse.kernels.cpu._launch import by_address, f32
from opfuse.kernels.registry import register

GEMV_ROWS = 8  # rows up to which the weight-stream kernel runs; above, ATen's GEMM
_Z = np.float32(0.0)


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True)
def _gemv_kernel(x, w, b, y):
    # x: [M, K] f32; w: [N, K] f32 row-major; b: [N] f32; y: [M, N] f32 out. 2-D indexing in
    # this function's fast-math scope (reassoc: 16-wide partial sums) vectorises the dot
    # product; serial (see opfuse.kernels.cpu.linear_bf16). Read 4NK + 4MK, write 4MN.
    for n in range(w.shape[0]):
        for m in range(x.shape[0]):
            acc = _Z
            for k in range(x.shape[1]):
                acc += x[m, k] * w[n, k]
            y[m, n] = acc + b[n]


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True)
def _gemv_zmm_kernel(x, w, b, y):
    # _gemv_kernel's contract (x [M, K], w [N, K], b [N], y [M, N] f32, C-contiguous) on
    # AVX-512F: per weight row, _f32dot.GEMV_r over the first 16·(K // 16) columns (one
    # 64-byte weight load for up to 4 rows of x, one 16-lane FMA accumulator per row), then
    # K's tail and the bias. Read 4NK + 4MK, write 4MN.
    m = x.shape[0]
    kk = x.shape[1]
    kb = kk // _f32dot.LANES
    for n in range(w.shape[0]):
        r = 0
        while r + 4 <= m:
            _f32dot.GEMV_4(x, r, w, n, y, kb)
            r += 4
        if m - r == 3:
            _f32dot.GEMV_3(x, r, w, n, y, kb)
        elif m - r == 2:
            _f32dot.GEMV_2(x, r, w, n, y, kb)
        elif m - r == 1:
            _f32dot.GEMV_1(x, r, w, n, y, kb)
        for r in range(m):
            acc = y[r, n]
            for k in range(kb * _f32dot.LANES, kk):
                acc += x[r, k] * w[n, k]
            y[r, n] = acc + b[n]


#: The float32 weight-stream kernel this CPU runs: the 512-bit rows where numba targets
#: AVX-512F, else the vectorised loop.
GEMV_KERNEL = _gemv_zmm_kernel if _f32dot.AVAILABLE else _gemv_kernel


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _gemv_wt_kernel(x, wt, y):
    # x: [M, K] f32; wt: [K, ld] f32 C-contiguous (Wᵀ, row-padded, ld ≥ N); y: [M, N] f32 out.
    # Four rows of Wᵀ per pass over y (y's row in L1, the weight streamed once). Read
    # 4K·ld + 4MK, write 4MN (y read and written K/4 times in L1).
    n = y.shape[1]
    kk = x.shape[1]
    for m in range(x.shape[0]):
        for j in range(n):
            y[m, j] = _Z
        k = 0
        while k + 4 <= kk:
            a0 = x[m, k]
            a1 = x[m, k + 1]
            a2 = x[m, k + 2]
            a3 = x[m, k + 3]
            for j in range(n):
                y[m, j] += a0 * wt[k, j] + a1 * wt[k + 1, j] + a2 * wt[k + 2, j] + a3 * wt[k + 3, j]
            k += 4
        while k < kk:
            a0 = x[m, k]
            for j in range(n):
                y[m, j] += a0 * wt[k, j]
            k += 1


def gemv_wt(x2: torch.Tensor, buf: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] float32 (C-contiguous) @ W [N, K]ᵀ from its row-padded Wᵀ buffer ``buf``
    [K, ld ≥ N] float32 C-contiguous -> ``out`` or a new [M, N] float32 tensor (C-contiguous).
    For a few rows (a weight stream); the caller checks shapes. 2MNK FLOPs."""
    y = torch.empty((x2.shape[0], n), dtype=torch.float32) if out is None else out
    _gemv_wt_kernel(x2.detach().numpy(), buf.detach().numpy(), y.numpy())
    return y


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True)
def _gemv_at(xp, wp, bp, yp, m, k, n):
    # GEMV_KERNEL on float32 tensors given by address: x [M, K], w [N, K], y [M, N]; bias
    # [N] at bp, or none when bp is 0. The same loops, so the same sums.
    x, w, y = carray(_math.f32_at(xp), (m, k)), carray(_math.f32_at(wp), (n, k)), carray(_math.f32_at(yp), (m, n))
    b = carray(_math.f32_at(bp), (n,)) if bp != 0 else np.zeros(n, np.float32)
    GEMV_KERNEL(x, w, b, y)


@register("linear_gemv", "cpu")
def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ weight [N, K] float32 (contiguous) ᵀ + bias [N] float32 or None
    -> [..., N] float32. Raises ValueError (named) for other dtypes, layouts or shapes."""
    k, n = check_linear_gemv(x, weight, bias)
    m = x.numel() // k
    if m <= GEMV_ROWS and by_address(x) and (bias is None or by_address(bias)):  # the weight: checked dense float32
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        _gemv_at(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), m, k, n)
        return y
    x2 = f32(x).reshape(-1, k)
    m = x2.shape[0]
    w = weight.detach()
    if m > GEMV_ROWS:
        y = torch.mm(x2, w.t()) if bias is None else torch.addmm(bias.detach(), x2, w.t())
        return y.view(*x.shape[:-1], n)
    return run_gemv(GEMV_KERNEL, x2, w.numpy(), bias, n).view(*x.shape[:-1], n)


def run_gemv(kernel, x2: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``kernel(x, w, b, y)`` (a weight-stream kernel of this file or of
    :mod:`opfuse.kernels.cpu.linear_bf16`) on x2 [M, K] float32 and the weight's numpy view,
    bias [N] (zeros when None); returns y [M, N] float32."""
    y = torch.empty((x2.shape[0], n), dtype=torch.float32)
    b = np.zeros(n, dtype=np.float32) if bias is None else f32(bias).numpy()
    kernel(x2.numpy(), w, b, y.numpy())
    return y
