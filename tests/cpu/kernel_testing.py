"""Shared helpers of the CPU kernel tests: seeded inputs built in float64, and a
comparison with the float64 oracle under the per-dtype TOLERANCE of kernels/reference.py."""

from __future__ import annotations

import pytest
import torch

from opfuse.kernels.cpu._gemm import onednn_bf16
from opfuse.kernels.reference import TOLERANCE


def randn(*shape: int, dtype=torch.float32, seed: int = 0, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype, f"output dtype {actual.dtype} != expected dtype {dtype}"
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.double(), expected, **TOLERANCE[dtype])


#: Hardware tier: tests of oneDNN's bf16 GEMM regions (AVX-512 or newer; an AVX2-only CPU
#: has no bf16 inner product, and the precision pass keeps those regions float32 there).
needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16(), reason="oneDNN has no bf16 inner product on this CPU "
                                       "(needs AVX-512: avx512bw/vl/dq or newer)")
