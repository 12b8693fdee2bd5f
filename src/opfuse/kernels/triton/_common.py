"""Shared pieces of the Triton kernels: accepted devices, GELU math, config helpers.

Launchers accept CUDA tensors; under ``TRITON_INTERPRET=1`` (set before triton is
imported) they also accept CPU tensors (``DEVICE_TYPE``, passed to the argument checks of
``opfuse.kernels.checks``), so the CPU test tier runs the same kernel code
in Triton's interpreter (see shared/design/KERNELS.md).

Math rules (the interpreter has no libdevice, and both must agree):
  * erf-GELU  0.5 z (1 + erf(z / sqrt 2)) with ``tl.math.erf``;
  * tanh-GELU 0.5 z (1 + tanh(u)), u = sqrt(2/pi)(z + 0.044715 z^3), with
    tanh(u) = 2 sigmoid(2u) - 1, so 0.5 (1 + tanh(u)) = sigmoid(2u) exactly;
    the two forms are different functions and are never swapped.
  * statistics and accumulation in float32 whatever the I/O dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Device types the launchers accept; the first is the one an error names.
DEVICE_TYPE: tuple[str, ...] = ("cuda", "cpu") if INTERPRET else ("cuda",)

# Epilogue activations (constexpr ACT of the GEMM / norm kernels).
ACT_NONE, ACT_GELU_ERF, ACT_GELU_TANH = 0, 1, 2
APPROXIMATE = {"none": ACT_GELU_ERF, "tanh": ACT_GELU_TANH}

# A row kernel keeps the whole (padded) row in registers; beyond this it would spill.
MAX_ROW_BLOCK = 32768


def act_of(approximate: str) -> int:
    """ACT for an ``approximate`` already validated by the op's check."""
    return APPROXIMATE[approximate]


def row_block(op: str, n: int) -> int:
    """Power-of-2 block holding a whole row of ``n`` elements (masked tail)."""
    block = triton.next_power_of_2(max(n, 1))
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"opfuse.{op}: rows of {n} elements exceed the single-block limit {MAX_ROW_BLOCK}")
    return block


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel: ~8 elements per thread up to 16 warps."""
    return max(1, min(16, block // 256))


def ieee_fp32(dtype: torch.dtype) -> bool:
    """float32 dots in full precision unless torch itself allows TF32 (eager's choice)."""
    return dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32


def dot_f32(dtype: torch.dtype) -> bool:
    """Up-cast bfloat16 dot operands to float32 under the interpreter only: its ``tl.dot``
    multiplies the raw bf16 bit patterns (garbage). On the GPU this is always False."""
    return INTERPRET and dtype == torch.bfloat16


@triton.jit
def gelu(z, ACT: tl.constexpr):
    """z: float32 block. ACT_NONE -> z, ACT_GELU_ERF -> erf form, ACT_GELU_TANH -> tanh form."""
    if ACT == 1:
        return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACT == 2:
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        return z * tl.sigmoid(2.0 * u)  # 0.5 z (1 + tanh u) = z sigmoid(2u)
    else:
        return z


@triton.jit
def row_stats(y, valid, N):
    """LayerNorm statistics of a shifted float32 row block ``y`` (masked lanes 0):
    returns (d, inv, var_scaled) with d = y - mean, and var = mean(d^2) = var_scaled / inv^2
    (see :func:`rstd_of`).

    Overflow-safe like the CPU kernels (``kernels/cpu/_math.row_rstd``): the mean sums
    y_j / N, and when max|d| = m reaches 1e18 (the float32 squares of values >= ~1.8e19
    overflow) the squares are taken of d/m, so a finite row gives finite values, as
    eager's LayerNorm does; otherwise inv = 1 and nothing changes."""
    mean = tl.sum(y * (1.0 / N), axis=0)
    d = tl.where(valid, y - mean, 0.0)
    m = tl.max(tl.abs(d), axis=0)
    inv = tl.where((m > 1e18) & (m < float("inf")), 1.0 / m, 1.0)
    ds = d * inv
    return d, inv, tl.sum(ds * ds, axis=0) / N


@triton.jit
def rstd_of(inv, var_scaled, eps):
    """1/sqrt(var + eps) from :func:`row_stats`' scale and scaled variance."""
    return inv / tl.sqrt(var_scaled + eps * inv * inv)
