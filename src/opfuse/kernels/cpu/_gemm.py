"""CPU GEMM entry point of the fused kernels (one place to choose the BLAS).

Measured on this project's 2-core AMD EPYC machines (float32, one thread): ATen's
``torch.mm`` and numpy's OpenBLAS both ran at ~34 GFLOP/s on Transformer shapes, and
mixing OpenBLAS's thread pool with torch's OpenMP pool slowed every later torch op
4–5x, so ATen's BLAS is used. (A comparison that lets OpenBLAS use its default thread
count while torch uses one shows a misleading 2x.)

Arrays are float32; ``out`` C-contiguous [M, N]; ``x`` [M, K]; ``weight`` [N, K] (a
Linear's layout, used transposed without a copy).
"""

from __future__ import annotations

import torch


def matmul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out[M,N] = x[M,K] @ weight[N,K]^T; read MK + NK, write MN."""
    torch.mm(x, weight.t(), out=out)


def matmul_accumulate(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out[M,N] += x[M,K] @ weight[N,K]^T (BLAS beta = 1: C read and written once)."""
    out.addmm_(x, weight.t())
