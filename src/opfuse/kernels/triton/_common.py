"""Shared pieces of the Triton kernels: launcher validation, GELU math, config helpers.

Launchers accept CUDA tensors; under ``TRITON_INTERPRET=1`` (set before triton is
imported) they also accept CPU tensors, so the CPU test tier runs the same kernel code
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

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Epilogue activations (constexpr ACT of the GEMM / norm kernels).
ACT_NONE, ACT_GELU_ERF, ACT_GELU_TANH = 0, 1, 2
APPROXIMATE = {"none": ACT_GELU_ERF, "tanh": ACT_GELU_TANH}

# A row kernel keeps the whole (padded) row in registers; beyond this it would spill.
MAX_ROW_BLOCK = 32768


def act_of(op: str, approximate: str) -> int:
    try:
        return APPROXIMATE[approximate]
    except KeyError:
        raise ValueError(f"opfuse.{op}: approximate must be one of {tuple(APPROXIMATE)}, got {approximate!r}") from None


def check_tensor(op: str, name: str, t: object, ndim_min: int = 1) -> torch.Tensor:
    """Raise ValueError unless ``t`` is a CUDA tensor (or CPU under the interpreter) of a
    supported float dtype with at least ``ndim_min`` dims."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"opfuse.{op}: {name} must be a Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" and not (INTERPRET and t.device.type == "cpu"):
        raise ValueError(f"opfuse.{op}: {name} is on device {t.device}, expected cuda")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"opfuse.{op}: {name} has unsupported dtype {t.dtype} (expected float32, float16 or bfloat16)")
    if t.dim() < ndim_min:
        raise ValueError(f"opfuse.{op}: {name} must have at least {ndim_min} dims, got shape {tuple(t.shape)}")
    return t


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"opfuse.{op}: {name} shape {tuple(t.shape)} != expected {tuple(expected)}")


def check_same(op: str, **tensors: torch.Tensor | None) -> None:
    """Same dtype and same device for every non-None tensor."""
    present = {n: t for n, t in tensors.items() if t is not None}
    if len({t.dtype for t in present.values()}) > 1:
        raise ValueError(f"opfuse.{op}: dtype mismatch { {n: t.dtype for n, t in present.items()} }")
    if len({t.device for t in present.values()}) > 1:
        raise ValueError(f"opfuse.{op}: device mismatch { {n: str(t.device) for n, t in present.items()} }")


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
