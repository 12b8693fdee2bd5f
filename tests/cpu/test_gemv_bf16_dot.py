"""linear_bf16's one-to-eight-row GEMV on AVX512-BF16 (``vdpbf16ps``: x rounded to bf16
once, exact products, float32 sums) against float64 on the bf16-rounded operands, on
awkward shapes; where it cannot run (K not a multiple of 32) the widening GEMV (W rounded
only) runs; strided, bf16 and biased inputs; the precision pass's decode plan stays within
its budget."""

import pytest
import torch

from opfuse.kernels.cpu import _bf16dot
from opfuse.kernels.cpu.linear_bf16 import linear_bf16

pytestmark = pytest.mark.skipif(not _bf16dot.AVAILABLE, reason="vdpbf16ps needs avx512_bf16")


def _rel(out, ref):
    return float((out.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("k, n", [(32, 1), (64, 33), (512, 256), (1376, 5), (96, 1023)])
@pytest.mark.parametrize("bias", [False, True])
def test_against_float64_on_rounded_operands(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 7 + n)
    x, w = torch.randn(1, rows, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    out = linear_bf16(x, w, b)
    ref = x.bfloat16().double() @ w.double().T + (b.double() if bias else 0)
    assert out.dtype == torch.float32 and out.shape == (1, rows, n)
    assert _rel(out, ref) < 1e-5  # exact products, float32 sums: only the summation order differs
    wide = x.double() @ w.double().T + (b.double() if bias else 0)
    assert _rel(out, wide) > 1e-6  # x was rounded: not the widening GEMV's result


def test_k_not_a_multiple_of_32_keeps_x_in_float32():
    x, w = torch.randn(3, 100), torch.randn(7, 100).bfloat16()
    ref = x.double() @ w.double().T
    assert _rel(linear_bf16(x, w, None), ref) < 1e-5


def test_strided_bf16_and_contiguous_inputs_give_the_same_bits():
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(40, 64, generator=g).bfloat16(), torch.randn(80, generator=g)[::2]
    x = torch.randn(4, 3, 64, generator=g)[:, 1, :]  # rows 192 elements apart
    assert not x.is_contiguous() and not b.is_contiguous()
    base = linear_bf16(x.contiguous(), w, b.contiguous())
    assert torch.equal(linear_bf16(x, w, b), base)
    xb = x.bfloat16()  # already bf16: the same rounding
    assert torch.equal(linear_bf16(xb.float(), w, b), base)


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_x_reaches_the_outputs_as_in_float32(bad):
    x, w = torch.randn(2, 64), torch.randn(9, 64).bfloat16()
    x[1, 5] = float(bad)
    out = linear_bf16(x, w, None)
    ref = x @ w.float().T
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    assert torch.allclose(out[0], ref[0], rtol=2e-2, atol=2e-2)
