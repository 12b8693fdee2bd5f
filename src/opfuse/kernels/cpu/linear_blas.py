"""linear_blas: y = x @ weight.T (+ bias) on OpenBLAS (numpy's own BLAS), float32, one thread.

    x [M, K] f32 ──┐
                   ├── OpenBLAS SGEMM (np.matmul into y; ATen's GEMM where numpy has no
    W [N, K] f32 ──┘   OpenBLAS) ──► y [M, N] f32 ──► + bias [N] (one pass over y)

The ``blas`` GEMM backend of :mod:`opfuse.gemm` for plain ``aten.linear`` sites, on the
row-padded Wᵀ that backend folds (its fused sites run their GEMM through
:func:`opfuse.kernels.cpu._gemm.linear` on the same layout). ``weight`` is read in the
layout it comes in: that padded view, row-major [N, K] (BLAS reads it transposed) or any
[N, K] view BLAS takes as it is. On the Zen 2 machines (AVX2, one
thread) numpy's OpenBLAS ran 87–100 GFLOP/s against MKL's 69–78 through ATen; chosen by
measurement like the other backends.

Traffic: read 4MK + 4NK (+ 4N), write 4MN (+ 4MN read and written for the bias) bytes;
FLOPs 2MNK.
"""

from __future__ import annotations

import torch

from opfuse.kernels.checks import check_linear_blas
from opfuse.kernels.cpu import _gemm
from opfuse.kernels.cpu._launch import f32
from opfuse.kernels.registry import register


@register("linear_blas", "cpu")
def linear_blas(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ weight [N, K] float32 (strided, any strides) ᵀ + bias [N] float32
    or None -> [..., N] float32 (C-contiguous). Raises ValueError (named) for other dtypes,
    layouts or shapes."""
    k, n = check_linear_blas(x, weight, bias)
    x2 = f32(x).reshape(-1, k)
    y = _gemm.blas_mm(x2, weight.detach())
    if bias is not None:
        y.add_(bias.detach())
    return y.view(*x.shape[:-1], n)
