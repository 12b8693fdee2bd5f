"""Property tests with non-finite and huge inputs: every CPU kernel op whose input can
carry ±inf, NaN or finite values near the float32 range gives NaN and ±inf at the
positions where the eager ATen spelling it replaces does, and finite values that agree
with eager — or, where eager's own float32 statistics overflow, with the float64 oracle
(eager LayerNorm of a row holding 3e19 returns the bias, off by ~2, and NaN for a
one-element row; the kernel scales such rows and is ~1e-7 from float64 there). RMSNorm
follows eager (HF's x.pow(2).mean() in float32): an overflowing row is zeros, as eager's.

Huge finite values go only into the norm ops' inputs: inside a GEMM, products near the
float32 range overflow to ±inf or NaN depending on the summation order, which differs
between BLAS libraries (eager's own result changes with the library there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opfuse.kernels import ops as _ops  # noqa: F401  (registers torch.ops.opfuse.*)
from opfuse.kernels import reference as ref
from opfuse.kernels.reference import TOLERANCE

OP = torch.ops.opfuse
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
DIMS = st.sampled_from([1, 2, 3, 7, 16, 33])
NON_FINITE = [float("inf"), float("-inf"), float("nan")]
HUGE = [3e19, -3e19, 1e30, -2e37, 3e38]


def planted(draw, shape, dtype, specials, huge_per_row=False):
    """randn of ``shape`` with 0–3 drawn elements replaced by drawn ``specials``, and with
    ``huge_per_row`` at most one drawn :data:`HUGE` value per row (the issue's case: one
    finite element >= 2e19 in a row of ordinary values)."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    flat = t.view(-1)
    for _ in range(draw(st.integers(0, 3))):
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from(specials))
    if huge_per_row:
        rows = t.view(-1, shape[-1])
        for i in range(rows.shape[0]):
            if draw(st.booleans()):
                rows[i, draw(st.integers(0, shape[-1] - 1))] = draw(st.sampled_from(HUGE))
    return t


def agrees(actual, eager, exact, dtype):
    """Element by element, ``actual`` matches eager's float32 result or the float64
    oracle's: NaN where it is NaN, the same ±inf, or a finite value within the dtype
    tolerance. Eager alone decides wherever the oracle is not given; where eager's own
    statistics overflow (eager LayerNorm of a row holding 3e19 is the bias, and NaN for a
    one-element row; the oracle is finite) the kernel may give the exact value instead."""
    assert actual.dtype == eager.dtype and actual.shape == eager.shape
    a = actual.double()
    tol = TOLERANCE[dtype]

    def match(b):
        b = b.double()
        both_nan = a.isnan() & b.isnan()
        same_inf = a.isinf() & (a == b)
        near = a.isfinite() & b.isfinite() & ((a - b).abs() <= tol["atol"] + tol["rtol"] * b.abs())
        return both_nan | same_inf | near

    ok = match(eager) | (match(exact) if exact is not None else torch.zeros_like(a, dtype=torch.bool))
    bad = ~ok
    assert not bool(bad.any()), (f"{int(bad.sum())} elements differ from eager and the oracle: "
                                 f"got {a[bad][:4].tolist()}, eager {eager.double()[bad][:4].tolist()}")


def hf_rms(x, w, eps):
    """HF LlamaRMSNorm: statistics in float32, cast back, times the weight."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@SETTINGS
@given(st.data())
def test_norms_non_finite_and_huge(data):
    d = data.draw
    dtype, rows, n = d(DTYPES), d(st.sampled_from([1, 2, 5])), d(DIMS)
    x = planted(d, (rows, n), dtype, NON_FINITE, huge_per_row=True)
    r = planted(d, (rows, n), dtype, NON_FINITE)
    w, b = (torch.rand(n, dtype=torch.float64) + 0.5).to(dtype), torch.randn(n, dtype=torch.float64).to(dtype)
    eps = 1e-5
    s = x + r
    agrees(OP.add_layernorm(x, r, w, b, eps), F.layer_norm(s, (n,), w, b, eps),
           ref.add_layernorm(x, r, w, b, eps, False)[0], dtype)
    out, total = OP.add_layernorm_sum(x, r, w, b, eps)
    agrees(out, F.layer_norm(s, (n,), w, b, eps), ref.add_layernorm(x, r, w, b, eps, False)[0], dtype)
    agrees(total, s, None, dtype)
    form = d(st.sampled_from(["none", "tanh"]))
    agrees(OP.layernorm_gelu(x, w, b, eps, form), F.gelu(F.layer_norm(x, (n,), w, b, eps), approximate=form),
           ref.layernorm_gelu(x, w, b, eps, form), dtype)
    agrees(OP.rmsnorm(x, w, 1e-6), hf_rms(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6), dtype)
    out, total = OP.add_rmsnorm(x, r, w, 1e-6)
    agrees(out, hf_rms(s, w, 1e-6), ref.add_rmsnorm(x, r, w, 1e-6)[0], dtype)
    agrees(total, s, None, dtype)


@SETTINGS
@given(st.data())
def test_gemm_epilogues_non_finite(data):
    d = data.draw
    dtype, m, k, n = d(DTYPES), d(st.sampled_from([1, 3, 8])), d(DIMS), d(DIMS)
    x = planted(d, (m, k), dtype, NON_FINITE)
    w = (torch.randn(n, k, dtype=torch.float64) / k ** 0.5).to(dtype)
    b = torch.randn(n, dtype=torch.float64).to(dtype)
    r = planted(d, (m, n), dtype, NON_FINITE)
    form = d(st.sampled_from(["none", "tanh"]))
    lin = F.linear(x, w, b)
    agrees(OP.linear_bias_gelu(x, w, b, form), F.gelu(lin, approximate=form), ref.linear_bias_gelu(x, w, b, form), dtype)
    agrees(OP.linear_residual(x, w, b, r), lin + r, ref.linear_residual(x, w, b, r), dtype)
    lw, lb = (torch.rand(n, dtype=torch.float64) + 0.5).to(dtype), torch.randn(n, dtype=torch.float64).to(dtype)
    agrees(OP.linear_add_layernorm(x, w, b, r, lw, lb, 1e-5), F.layer_norm(lin + r, (n,), lw, lb, 1e-5),
           ref.linear_add_layernorm(x, w, b, r, lw, lb, 1e-5, False)[0], dtype)
    wgu = (torch.randn(2 * n, k, dtype=torch.float64) / k ** 0.5).to(dtype)
    gu = F.linear(x, wgu)
    agrees(OP.swiglu(x, wgu, n), F.silu(gu[..., :n]) * gu[..., n:], ref.swiglu(x, wgu, n), dtype)
    agrees(OP.geglu(x, wgu, n, form), F.gelu(gu[..., :n], approximate=form) * gu[..., n:],
           ref.geglu(x, wgu, n, form), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_of_minus_inf_is_nan_like_eager(dtype):
    """The case found by a user: SwiGLU with ±inf in its input returned ±inf where eager
    returns NaN (silu(-inf) = -inf / (1 + e^inf) = NaN)."""
    x = torch.tensor([[float("inf")], [-float("inf")], [-100.0]], dtype=dtype)
    w = torch.ones(2, 1, dtype=dtype)  # gate = up = x
    gu = F.linear(x, w)
    eager = F.silu(gu[:, :1]) * gu[:, 1:]  # [inf, silu(-inf) * -inf = NaN, -0 * -100 = 0]
    out = OP.swiglu(x, w, 1)
    assert eager[1].isnan().all() and eager[0].isinf().all() and eager[2].isfinite().all()
    assert torch.equal(out.isnan(), eager.isnan()) and torch.equal(out.isinf(), eager.isinf())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_row_with_huge_finite_value_stays_finite(dtype):
    """add+LayerNorm with one element ≥ 2e19 (its float32 square overflows) returned a whole
    row of NaN where eager is finite; now every row is finite and equals the float64
    oracle (eager's own statistics overflow there: it returns the bias, or NaN)."""
    torch.manual_seed(0)
    x, r = torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype)
    x[0, 5], x[1, 9], x[2, 0] = 3e19, -1e30, 3e38
    w, b = torch.rand(64).to(dtype) + 0.5, torch.randn(64).to(dtype)
    out = OP.add_layernorm(x, r, w, b, 1e-5)
    eager = F.layer_norm(x + r, (64,), w, b, 1e-5)  # row 0 finite (the bias), rows 1-2 NaN: mean^2 overflows
    assert out.isfinite().all() and eager[0].isfinite().all()
    torch.testing.assert_close(out.double(), ref.add_layernorm(x, r, w, b, 1e-5, False)[0], **TOLERANCE[dtype])


@pytest.mark.parametrize("r_shape", [(1, 5, 24), (5, 24), (24,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_layernorm_row_broadcast_residual_vs_float64(r_shape, dtype):
    """A residual that broadcasts over the leading dims (position embeddings) is expanded
    row-wise; the sum and the LayerNorm equal the float64 oracle of the broadcast add."""
    torch.manual_seed(0)
    x, r = torch.randn(3, 5, 24).to(dtype), torch.randn(*r_shape).to(dtype)
    w, b = (torch.rand(24) + 0.5).to(dtype), torch.randn(24).to(dtype)
    exp, exp_sum = ref.add_layernorm(x, r, w, b, 1e-5, True)
    out, total = OP.add_layernorm_sum(x, r, w, b, 1e-5)
    torch.testing.assert_close(out.double(), exp, **TOLERANCE[dtype])
    torch.testing.assert_close(total.double(), exp_sum, **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="does not broadcast"):
        OP.add_layernorm(x, r[..., :1].expand(*r.shape[:-1], 1).contiguous(), w, b, 1e-5)
