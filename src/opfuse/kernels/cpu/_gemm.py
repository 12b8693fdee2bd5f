"""CPU GEMM entry point of the fused kernels (one place to choose the BLAS).

Measured on this project's 2-core AMD EPYC machines (float32, one thread): ATen's
``torch.mm`` and numpy's OpenBLAS both ran at ~34 GFLOP/s on Transformer shapes, and
mixing OpenBLAS's thread pool with torch's OpenMP pool slowed every later torch op
4–5x, so ATen's BLAS is used. (A comparison that lets OpenBLAS use its default thread
count while torch uses one shows a misleading 2x.)

Arrays are float32; ``out`` C-contiguous [M, N]; ``x`` [M, K]; ``weight`` [N, K] (a
Linear's layout, used transposed without a copy). ``weight`` may also be the [N, K] view
of a contiguous [K, N] buffer (the ``wt`` layout chosen per shape by ``opfuse.gemm``):
:func:`operand` keeps that layout, so BLAS gets a non-transposed operand.
"""

from __future__ import annotations

import torch


def operand(weight: torch.Tensor) -> torch.Tensor:
    """Detached float32 [N, K] weight, without a copy when it is row-major or the
    transposed view of a row-major [K, N] buffer (both are BLAS operands as they are)."""
    w = weight.detach()
    if w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous():
        return w.to(torch.float32)  # keeps the column-major strides (preserve_format)
    return w.to(dtype=torch.float32, memory_format=torch.contiguous_format)


def matmul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out[M,N] = x[M,K] @ weight[N,K]^T; read MK + NK, write MN."""
    torch.mm(x, weight.t(), out=out)


def matmul_accumulate(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out[M,N] += x[M,K] @ weight[N,K]^T (BLAS beta = 1: C read and written once)."""
    out.addmm_(x, weight.t())
