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

* a **row-padded Wᵀ** (``blas``: the [N, K] view, strides (1, ld) with ld > N, of a
  contiguous [K, ld] buffer, :func:`blas_layout`): OpenBLAS's SGEMM (numpy's own BLAS,
  ``np.matmul`` into the result) run on one thread. The padded leading dimension is what
  marks the layout (and keeps power-of-two rows off the same cache sets); any BLAS reads it.

Measured on the 2-core AMD EPYC Zen 2 machines (AVX2, float32, one thread, GFLOP/s):
numpy's OpenBLAS 0.3.31 (its Haswell kernels) ran 87–100 against 69–78 for MKL through
ATen and 63–92 for oneDNN prepacked, at 128×768×768 … 1024×1536×384.

OpenBLAS runs on **one thread only**: with its own thread pool busy next to torch's OpenMP
pool, every later torch op ran 1.7x (measured here: 1.35 → 2.31 ms for a GEMM + GELU +
LayerNorm at two threads; 4–5x on earlier machines). :func:`blas_mm` sets numpy's
OpenBLAS to one thread for the call (``threadpoolctl``; ~2 µs) and restores the user's
setting, and :mod:`opfuse.gemm` offers the backend only while torch runs one thread.

Arrays are float32; ``x`` [M, K] (any strides); results C-contiguous [M, N].
"""

from __future__ import annotations

import threading
from functools import cache

import numpy as np
import torch

from opfuse.kernels.cpu.linear_gemv import _gemv_at

#: Floats of padding per row of a ``blas`` weight's [K, N + BLAS_PAD] buffer (64 bytes).
BLAS_PAD = 16
#: At most this many rows, :func:`blas_mm` streams the padded Wᵀ with opfuse's GEMV
#: (:func:`opfuse.kernels.cpu.linear_gemv.gemv_wt`): OpenBLAS's one-row GEMV measured
#: 1.5–1.9x slower here (113 / 719 / 728 against 75 / 375 / 411 µs at 768×768, 768×3072,
#: 3072×768), and MKL's on the padded operand up to 1.34x slower than on the row-major
#: weight, so a dynamic plan whose range starts at one row (served requests) lost the
#: backend at that end; from 4 rows on OpenBLAS and MKL are within ±15%.
BLAS_MIN_ROWS = 2
_BLAS_LOCK = threading.Lock()  # numpy's OpenBLAS thread count is process-wide


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


@cache
def openblas():
    """threadpoolctl's controller of numpy's OpenBLAS (the library file numpy's wheel ships,
    ``numpy.libs/libscipy_openblas*``), or None when numpy's BLAS is another library (MKL,
    Accelerate, a system OpenBLAS) or threadpoolctl cannot find it: then the ``blas``
    backend is unavailable (scipy's own OpenBLAS copy has its own thread count, so only
    numpy's is ever used)."""
    try:
        from threadpoolctl import ThreadpoolController
        found = ThreadpoolController().select(internal_api="openblas").lib_controllers
    except Exception:  # noqa: BLE001  (an odd install: no blas backend, never an error)
        return None
    return next((c for c in found if "numpy" in str(getattr(c, "filepath", ""))), None)


def blas_layout(weight: torch.Tensor, pad: int = BLAS_PAD) -> torch.Tensor:
    """The ``blas`` layout of a float32 [N, K] weight: a contiguous [K, N + pad] buffer
    holding Wᵀ in its first N columns (K·(N + pad)·4 bytes). Its [N, K] operand is
    :func:`blas_view`."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    buf = torch.zeros(k, n + pad, dtype=torch.float32)
    buf[:, :n] = w.t()
    return buf


def blas_view(buf: torch.Tensor, n: int) -> torch.Tensor:
    """The [N, K] weight operand (strides (1, N + pad)) of a :func:`blas_layout` buffer."""
    return buf.as_strided((n, buf.shape[0]), (1, buf.shape[1]))


def is_blas(weight: torch.Tensor) -> bool:
    """``weight`` [N, K] float32 is a row-padded Wᵀ view (:func:`blas_layout`)."""
    return (weight.layout == torch.strided and weight.dim() == 2 and weight.dtype == torch.float32
            and weight.stride(0) == 1 and weight.stride(1) > weight.shape[0] > 1)


def blas_mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K] float32 (any strided layout) ᵀ with numpy's
    OpenBLAS on one thread, into ``out`` [M, N] (C-contiguous) or a new tensor. At M ≤
    :data:`BLAS_MIN_ROWS` a row-padded Wᵀ (:func:`is_blas`, its buffer whole) is streamed
    by opfuse's GEMV; ATen's GEMM reads other few-row operands, and every operand where
    numpy has no OpenBLAS. Read MK + NK, write MN; 2MNK FLOPs."""
    ctl = openblas()
    rows, (n, k) = x.shape[0], weight.shape
    if (rows <= BLAS_MIN_ROWS and is_blas(weight) and weight.storage_offset() == 0
            and weight.untyped_storage().nbytes() >= 4 * k * weight.stride(1)):
        from opfuse.kernels.cpu.linear_gemv import gemv_wt
        ld = weight.stride(1)
        buf = weight.as_strided((k, ld), (ld, 1))  # the whole [K, ld] buffer (its [K, N] slice: 2.4x slower)
        return gemv_wt(x if x.is_contiguous() else x.contiguous(), buf, n, out)
    if ctl is None or rows <= BLAS_MIN_ROWS:
        return torch.mm(x, weight.t(), out=out) if out is not None else torch.mm(x, weight.t())
    xn = x.detach().numpy() if x.is_contiguous() else x.detach().contiguous().numpy()
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    wn = weight.detach().t().numpy()  # [K, N] view, the buffer's strides
    with _BLAS_LOCK:
        before = ctl.get_num_threads()
        if before != 1:
            ctl.set_num_threads(1)
        try:
            np.matmul(xn, wn, out=out.numpy())
        finally:
            if before != 1:
                ctl.set_num_threads(before)
    return out


def operand(weight: torch.Tensor) -> torch.Tensor:
    """Detached float32 [N, K] weight, without a copy when it is row-major, the transposed
    view of a row-major [K, N] buffer (both are BLAS operands as they are), a row-padded
    Wᵀ (:func:`is_blas`) or prepacked."""
    w = weight.detach()
    if w.is_mkldnn:
        return w  # float32 (opfuse.gemm) or bfloat16 (opfuse.precision), prepacked
    if is_blas(w):
        return w
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
    if is_blas(weight):
        y = blas_mm(x, weight, out)
        return y if bias is None else y.add_(bias)  # + MN read and write
    if bias is None:
        return torch.mm(x, weight.t(), out=out) if out is not None else torch.mm(x, weight.t())
    return torch.addmm(bias, x, weight.t(), out=out) if out is not None else torch.addmm(bias, x, weight.t())


#: Rows up to which :func:`few_rows` streams the weight: a fused SwiGLU on a 2752×512 weight,
#: one thread, hot, µs (GEMV vs MKL through ATen, Zen 4): M = 1 93 vs 142, M = 4 251 vs 311,
#: M = 8 437 vs 437.
FEW_ROWS = 4


def few_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] float32 (C-contiguous, M ≤ :data:`FEW_ROWS`) @ a dense row-major float32
    weight [N, K] ᵀ with opfuse's weight-stream GEMV
    (:func:`opfuse.kernels.cpu.linear_gemv._gemv_at`, the kernel a decode step's plain GEMMs
    run) as a new [M, N] float32 tensor; None where it does not apply (more rows, another
    layout or dtype, more than one thread): the caller then runs :func:`linear`. For a fused
    op's GEMM called at a few rows (a dynamic plan's short calls) on the ``aten`` layout,
    where ATen's GEMM is MKL's GEMV, which skips its AVX-512 paths on AMD. Read 4NK + 4MK,
    write 4MN bytes."""
    m, k = x.shape
    if (m > FEW_ROWS or weight.is_mkldnn or weight.dtype is not torch.float32 or weight.dim() != 2
            or weight.shape[1] != k or not weight.is_contiguous() or x.dtype is not torch.float32
            or not x.is_contiguous() or torch.get_num_threads() != 1):
        return None
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    _gemv_at(x.data_ptr(), weight.data_ptr(), 0, y.data_ptr(), m, k, n)
    return y


def accumulate(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """c[M,N] + x[M,K] @ weight[N,K]^T: into ``c`` in place (BLAS beta = 1: C read and
    written once) and returned, or with a prepacked weight as oneDNN's binary-add post-op
    (a new [M, N] tensor, C read once). Read MK + NK + MN, write MN."""
    if weight.is_mkldnn:
        if weight.dtype == torch.bfloat16:  # c stays float32: + the bf16 GEMM's result
            return c.add_(torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, None, "none", [], ""))
        return torch.ops.mkldnn._linear_pointwise.binary(x, c, weight, None, "add")
    if is_blas(weight):
        return c.add_(blas_mm(x, weight))  # numpy's matmul has no beta: + MN written and read
    return c.addmm_(x, weight.t())
