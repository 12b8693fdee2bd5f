"""CPU GEMM entry point of the fused kernels: one place where the weight's layout picks the
library, so every fused op runs its GEMM on the backend :mod:`opfuse.gemm` measured fastest
for its shape.

A weight operand ``weight`` [N, K] (a Linear's layout) comes in one of three layouts, each
a row of ``opfuse.gemm.BACKENDS``:

* row-major [N, K] (``aten``, eager's): ATen's BLAS with the weight read transposed;
* the [N, K] view of a contiguous [K, N] buffer (``wt``): ATen's BLAS, non-transposed
  operand (:func:`operand` keeps these strides);
* a oneDNN prepacked weight (``packed``: ``torch.ops.mkldnn._reorder_linear_weight``, an
  opaque ``torch._mkldnn`` tensor of shape [N, K]): oneDNN's inner product
  (``torch.ops.mkldnn._linear_pointwise``, bias and residual add as its post-ops), the
  blocked layout made once at optimize time instead of on every call;
* a oneDNN prepacked **bfloat16** weight (:mod:`opfuse.precision`, ``precision="bf16"``):
  ``x`` rounded to bf16, oneDNN's bf16 inner product with float32 accumulation (+ the
  float32 bias inside it), the result rounded once to bf16 and returned as float32, so
  the fused op's epilogue (LayerNorm statistics, GELU, SwiGLU, residual) stays float32.

Measured (float32, one thread): on the 2-core AMD EPYC Zen 5 machines MKL does not run its
AVX-512 paths and oneDNN was 2.2–2.4x faster (247–276 vs 104–121 GFLOP/s at 128×768×768 …
512×768×768, prepacked +3–7%); on the Intel Ice Lake machines MKL with a pre-transposed
weight was as fast or faster. Hence measured per machine and shape, never assumed.

Arrays are float32; ``x`` [M, K] (any strides); results C-contiguous [M, N]. Mixing
OpenBLAS's (numpy's) thread pool with torch's OpenMP pool slowed every later torch op 4–5x
on these machines, so numpy's BLAS is never used.
"""

from __future__ import annotations

from functools import cache

import torch


@cache
def onednn_bf16() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 inner product (``torch.ops.mkldnn.
    _is_mkldnn_bf16_supported()``: AVX-512 or newer; native with ``avx512_bf16`` /
    ``amx_bf16``, emulated on plain AVX-512). On an AVX2-only CPU (the Zen 2 machines) the
    primitive cannot be created ("could not create a primitive descriptor"), so every bf16
    GEMM region stays float32 there and :func:`opfuse.kernels.cpu.linear_bf16.linear_bf16`
    runs its many-row form through ATen."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def operand(weight: torch.Tensor) -> torch.Tensor:
    """Detached float32 [N, K] weight, without a copy when it is row-major, the transposed
    view of a row-major [K, N] buffer (both are BLAS operands as they are) or prepacked."""
    w = weight.detach()
    if w.is_mkldnn:
        return w  # float32 (opfuse.gemm) or bfloat16 (opfuse.precision), prepacked
    if w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous():
        return w.to(torch.float32)  # keeps the column-major strides (preserve_format)
    return w.to(dtype=torch.float32, memory_format=torch.contiguous_format)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x[M,K] @ weight[N,K]^T (+ bias[N]) as a C-contiguous [M, N] float32 tensor: ``out``
    (BLAS writes into it) when given, else a new one. ``weight`` from :func:`operand`.
    Read MK + NK (+ N), write MN (+ MN to copy oneDNN's result into ``out``)."""
    if weight.is_mkldnn:
        if weight.dtype == torch.bfloat16:
            y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, bias, "none", [], "")
            return y.float() if out is None else out.copy_(y)
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return y if out is None else out.copy_(y)
    if bias is None:
        return torch.mm(x, weight.t(), out=out) if out is not None else torch.mm(x, weight.t())
    return torch.addmm(bias, x, weight.t(), out=out) if out is not None else torch.addmm(bias, x, weight.t())


def accumulate(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """c[M,N] + x[M,K] @ weight[N,K]^T: into ``c`` in place (BLAS beta = 1: C read and
    written once) and returned, or with a prepacked weight as oneDNN's binary-add post-op
    (a new [M, N] tensor, C read once). Read MK + NK + MN, write MN."""
    if weight.is_mkldnn:
        if weight.dtype == torch.bfloat16:  # c stays float32: + the bf16 GEMM's result
            return c.add_(torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, None, "none", [], ""))
        return torch.ops.mkldnn._linear_pointwise.binary(x, c, weight, None, "add")
    return c.addmm_(x, weight.t())
