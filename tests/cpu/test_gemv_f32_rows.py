"""linear_gemv's float32 weight stream on AVX-512F rows (:mod:`opfuse.kernels.cpu._f32dot`:
512-bit loads, one FMA accumulator per row of x, K's tail and the bias in numba) against
float64 on awkward shapes (K below, at and past a 16-lane block, one to eight rows, one
output); the launcher's by-address and copying paths give the same bits; NaN and inf stay
in their row and column; the kernel is the one linear_gemv and the gated-MLP GEMV run."""

import numpy as np
import pytest
import torch

from opfuse.kernels.cpu import _f32dot, linear_gemv as lg
from opfuse.kernels.cpu._gemm import few_rows

pytestmark = pytest.mark.skipif(not _f32dot.AVAILABLE, reason="the 512-bit rows need AVX-512F")


def _rel(out, ref):
    return float((out.double() - ref).abs().max() / max(1e-30, float(ref.abs().max())))


def test_the_rows_are_the_kernel_this_cpu_runs():
    assert lg.GEMV_KERNEL is lg._gemv_zmm_kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("k, n", [(1, 3), (15, 2), (16, 1), (17, 5), (47, 33), (512, 64), (1376, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_against_float64(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 31 + k + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = np.full((rows, n), np.nan, np.float32)  # every output must be written
    lg._gemv_zmm_kernel(x.numpy(), w.numpy(), np.zeros(n, np.float32) if b is None else b.numpy(), y)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert _rel(torch.from_numpy(y), ref) < 2e-6


@pytest.mark.parametrize("rows", [2, 3, 8])  # (one row of the slice is contiguous)
def test_by_address_and_copied_inputs_give_the_same_bits(one_thread, rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(40, 80, generator=g), torch.randn(80, generator=g)[::2]
    x = torch.randn(rows, 3, 80, generator=g)[:, 1, :]  # rows 240 elements apart: copied, then run_gemv
    assert not x.is_contiguous() and not b.is_contiguous()
    direct = lg.linear_gemv(x.contiguous(), w, b.contiguous())  # _gemv_at on the addresses
    assert torch.equal(lg.linear_gemv(x, w, b), direct)
    ref = x.double() @ w.double().T + b.double()
    assert _rel(direct, ref) < 2e-6


def test_the_gated_mlp_gemv_runs_the_same_rows(one_thread):
    x, w = torch.randn(2, 512), torch.randn(96, 512)
    out = few_rows(x, w)
    assert out is not None and torch.equal(out, lg.linear_gemv(x, w, None))


@pytest.mark.parametrize("column", [5, 37])  # in a 16-lane block; in K's tail
@pytest.mark.parametrize("where", ["x", "w"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_values_stay_in_their_row_and_column(where, bad, column):
    x, w = torch.randn(3, 40), torch.randn(6, 40)
    (x if where == "x" else w)[1, column] = float(bad)
    out = lg.linear_gemv(x, w, None)
    ref = x.double() @ w.double().T
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    finite = ref.isfinite()
    assert finite.sum() >= 10 and torch.allclose(out.double()[finite], ref[finite], rtol=1e-5, atol=1e-5)
