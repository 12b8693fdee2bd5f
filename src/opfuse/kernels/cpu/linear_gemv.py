"""linear_gemv: y = x @ weight.T (+ bias) for a few rows, float32, the weight streamed once.

    x [M, K] f32 ──┐
                   ├── M ≤ GEMV_ROWS: numba, one float32 dot product per (row, output), the
    W [N, K] f32 ──┘   weight row-major as the model holds it ──► y [M, N] f32 (+ bias)
                       (M > GEMV_ROWS: ATen's addmm / mm, eager's GEMM)

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
from numba import njit

from opfuse.kernels.checks import check_linear_gemv
from opfuse.kernels.cpu import _math
from opfuse.kernels.cpu._launch import f32
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


@register("linear_gemv", "cpu")
def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ weight [N, K] float32 (contiguous) ᵀ + bias [N] float32 or None
    -> [..., N] float32. Raises ValueError (named) for other dtypes, layouts or shapes."""
    k, n = check_linear_gemv(x, weight, bias)
    x2 = f32(x).reshape(-1, k)
    m = x2.shape[0]
    w = weight.detach()
    if m > GEMV_ROWS:
        y = torch.mm(x2, w.t()) if bias is None else torch.addmm(bias.detach(), x2, w.t())
        return y.view(*x.shape[:-1], n)
    return run_gemv(_gemv_kernel, x2, w.numpy(), bias, n).view(*x.shape[:-1], n)


def run_gemv(kernel, x2: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``kernel(x, w, b, y)`` (a weight-stream kernel of this file or of
    :mod:`opfuse.kernels.cpu.linear_bf16`) on x2 [M, K] float32 and the weight's numpy view,
    bias [N] (zeros when None); returns y [M, N] float32."""
    y = torch.empty((x2.shape[0], n), dtype=torch.float32)
    b = np.zeros(n, dtype=np.float32) if bias is None else f32(bias).numpy()
    kernel(x2.numpy(), w, b, y.numpy())
    return y
