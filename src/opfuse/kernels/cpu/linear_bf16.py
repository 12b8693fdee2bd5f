"""linear_bf16: y = x @ weight.T (+ bias) with a bf16 weight, float32 activations and sums.

    x [M, K] f32 ──┐
                   ├── M ≤ GEMV_ROWS, avx512_bf16, K % 32 = 0: GEMV on vdpbf16ps (x rounded
    W [N, K] bf16 ─┤   to bf16 once, exact products, float32 sums; one 64-byte weight load
                   │   serves up to 4 rows of x) ──► y [M, N] f32 (+ bias)
                   ├── M ≤ GEMV_ROWS otherwise: numba GEMV, weight streamed as bf16 bits
                   │   (widened to float32 in registers, exact), float32 sums, x not rounded
                   └── else: oneDNN bf16 inner product (x rounded to bf16, float32
                       accumulation, one rounding of the result) ──► y (+ bias in float32);
                       ATen's bf16 GEMM where oneDNN has none (AVX2-only CPUs)

The decode-step form of ``precision="bf16"`` (:mod:`opfuse.precision`): a one-row GEMM is
a weight stream, and bf16 halves the bytes. oneDNN's bf16 inner product at M = 1 measured
slower than float32 here (Zen 5, caches evicted: 312–333 vs 106–179 µs for 512×512 …
1376×512), the widening GEMV 2.4–3.4x faster than MKL's float32 GEMV (31 vs 106 µs at
512×512, 1.04 vs 2.53 ms for a 32000×512 LM head). The widening costs two instructions per
16 weights per row of x, so at four rows it was compute-bound (Zen 4, 32000×512, M = 4: 3.9
ms, slower than float32's 3.7). The vdpbf16ps GEMV does 32 multiply-adds per instruction on
weights loaded once: Zen 4, one thread, caches evicted, µs (widening → vdpbf16ps): 1376×512
M = 1 125 → 71, M = 4 216 → 115; 512×1376 113 → 72, 291 → 119; 32000×512 1988 → 1105 (29.6
GB/s), 3738 → 1746. It rounds x to bf16 as the oneDNN path does; the precision pass measures
each region's error with the kernel the plan runs, so that rounding is in the budget. At
M ≤ GEMV_ROWS on the widening path only ``W`` is rounded.

Traffic: read 2NK (weight) + 4MK + 4N, write 4MN bytes; FLOPs 2MNK.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit

from opfuse.kernels.checks import check_linear_bf16
from opfuse.kernels.cpu import _bf16dot, _math
from opfuse.kernels.cpu._gemm import onednn_bf16
from opfuse.kernels.cpu._launch import by_address, f32
from opfuse.kernels.cpu.linear_gemv import GEMV_ROWS, run_gemv
from opfuse.kernels.registry import register

_Z = np.float32(0.0)
_SHIFT = np.uint32(16)


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True)
def _gemv_bf16_kernel(x, w, b, y):
    # x: [M, K] f32; w: [N, K] uint16 (bf16 bits); b: [N] f32; y: [M, N] f32 out.
    # One dot product per (row, output), the weight row widened to float32 in registers
    # (bf16 bits << 16 is the exact float32); 2-D indexing with the reduction in this
    # function's own fast-math scope (reassoc: 16-wide partial sums) vectorises: 24 µs for
    # 1376×512 hot, where a prange version of the same loops took 480 µs and a per-row
    # helper on sliced rows 185 µs. Serial: a one-thread weight stream is what decode runs
    # (multi-threaded GEMVs stay on the float32 path unless measured faster).
    for n in range(w.shape[0]):
        for m in range(x.shape[0]):
            acc = _Z
            for k in range(x.shape[1]):
                acc += x[m, k] * _math.f32_from_bits(np.uint32(w[n, k]) << _SHIFT)
            y[m, n] = acc + b[n]


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True)
def _gemv_bf16_at(xp, wp, bp, yp, m, k, n):
    # _gemv_bf16_kernel on tensors given by address: x [M, K] f32, w [N, K] bf16 bits, y
    # [M, N] f32; bias [N] f32 at bp, or none when bp is 0. The same loops, so the same sums.
    x, w, y = carray(_math.f32_at(xp), (m, k)), carray(_math.u16_at(wp), (n, k)), carray(_math.f32_at(yp), (m, n))
    b = carray(_math.f32_at(bp), (n,)) if bp != 0 else np.zeros(n, np.float32)
    _gemv_bf16_kernel(x, w, b, y)


@njit(error_model="numpy", cache=True)
def _gemv_dp_at(xp, wp, bp, yp, m, k, n):
    # y [M, N] f32 = bf16(x) [M, K] · w [N, K] bf16 bits (+ bias [N] f32 at bp, none when bp is
    # 0), K a multiple of 32; tensors given by address. x rounded to bf16 once (nearest even),
    # then per weight row one 64-byte load serves up to 4 rows of x (_bf16dot.GEMV_r:
    # vdpbf16ps, exact products, float32 sums).
    x, w, y = carray(_math.f32_at(xp), (m, k)), carray(_math.u16_at(wp), (n, k)), carray(_math.f32_at(yp), (m, n))
    xb = np.empty((m, k), np.uint16)
    for r in range(m):
        for c in range(k):
            xb[r, c] = _bf16dot.to_bf16(x[r, c])
    kb = k // 32
    for j in range(n):
        r = 0
        while r + 4 <= m:
            _bf16dot.GEMV_4(xb, r, w, j, y, kb)
            r += 4
        if m - r == 3:
            _bf16dot.GEMV_3(xb, r, w, j, y, kb)
        elif m - r == 2:
            _bf16dot.GEMV_2(xb, r, w, j, y, kb)
        elif m - r == 1:
            _bf16dot.GEMV_1(xb, r, w, j, y, kb)
    if bp != 0:
        b = carray(_math.f32_at(bp), (n,))
        for r in range(m):
            for j in range(n):
                y[r, j] += b[j]


@register("linear_bf16", "cpu")
def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ weight [N, K] bfloat16 (dense, contiguous) ᵀ + bias [N] float32
    or None -> [..., N] float32. Raises ValueError (named) for other dtypes, layouts or shapes."""
    k, n = check_linear_bf16(x, weight, bias)
    m = x.numel() // k
    if m <= GEMV_ROWS and _bf16dot.AVAILABLE and k % 32 == 0:  # bf16 x: vdpbf16ps (serial; the weight: dense bf16)
        xc, bc = f32(x), None if bias is None else f32(bias)  # no copy when already float32 and contiguous
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        _gemv_dp_at(xc.data_ptr(), weight.data_ptr(), 0 if bc is None else bc.data_ptr(), y.data_ptr(), m, k, n)
        return y
    if m <= GEMV_ROWS and by_address(x) and (bias is None or by_address(bias)):  # the weight: checked dense bf16
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        _gemv_bf16_at(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), m, k, n)
        return y
    x2 = f32(x).reshape(-1, k)
    if m > GEMV_ROWS:
        xb = x2.to(torch.bfloat16)
        y = (torch.ops.mkldnn._linear_pointwise(xb, weight.detach(), None, "none", [], "") if onednn_bf16()
             else torch.nn.functional.linear(xb, weight.detach())).float()  # ATen's bf16 GEMM: no oneDNN bf16 here
        return (y if bias is None else y + bias.detach()).view(*x.shape[:-1], n)
    w = weight.detach().view(torch.int16).numpy().view(np.uint16)
    return run_gemv(_gemv_bf16_kernel, x2, w, bias, n).view(*x.shape[:-1], n)
