"""The launchers' by-address fast path (opfuse.kernels.cpu._launch.by_address): one-row
float32 contiguous calls hand the kernels their tensors' addresses instead of numpy views.
Its results must be bit-identical to the numpy-view path (the same kernels' loops) and to
within float32 round-off of float64; other inputs keep the old path; the memoised argument
checks still refuse bad input every time."""

import pytest
import torch

from opfuse.kernels.cpu import _bf16dot, _launch, add_rmsnorm, linear_bf16, linear_gemv, rmsnorm, rope


def _both(monkeypatch, modules, call):
    """(fast-path result, numpy-view result) of ``call()``: the second with by_address off."""
    fast = call()
    for m in modules:
        monkeypatch.setattr(m, "by_address", lambda *t: False)
    slow = call()
    monkeypatch.undo()
    return fast, slow


def _same(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype and x.is_contiguous()
        assert torch.equal(x, y)


@pytest.mark.parametrize("shape", [(1, 1, 512), (2, 3, 64), (1, 1, 7)])
def test_norms_by_address_equal_the_view_path_and_float64(monkeypatch, shape):
    x, r, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    fast, slow = _both(monkeypatch, [rmsnorm], lambda: rmsnorm.rmsnorm(x, w, 1e-6))
    _same(fast, slow)
    xd = x.double()
    ref = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert float((fast.double() - ref).abs().max()) < 1e-5 * float(ref.abs().max())
    fast, slow = _both(monkeypatch, [add_rmsnorm], lambda: add_rmsnorm.add_rmsnorm(x, r, w, 1e-6))
    _same(fast, slow)
    assert torch.equal(fast[1], x + r)


@pytest.mark.parametrize("rows, k, n, bias", [(1, 512, 256, False), (3, 64, 33, True), (8, 31, 5, True)])
def test_gemvs_by_address_equal_the_view_path_and_float64(monkeypatch, rows, k, n, bias):
    x, w = torch.randn(1, rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    fast, slow = _both(monkeypatch, [linear_gemv], lambda: linear_gemv.linear_gemv(x, w, b))
    _same(fast, slow)
    assert float((fast.double() - exact).abs().max()) < 1e-4 * float(exact.abs().max()) + 1e-5
    wb = w.to(torch.bfloat16)
    # where the vdpbf16ps GEMV runs (avx512_bf16, K a multiple of 32), x is rounded to bf16 too
    xr = x.to(torch.bfloat16).double() if _bf16dot.AVAILABLE and k % 32 == 0 else x.double()
    exact = xr @ wb.double().T + (b.double() if bias else 0)
    fast, slow = _both(monkeypatch, [linear_bf16], lambda: linear_bf16.linear_bf16(x, wb, b))
    _same(fast, slow)
    assert float((fast.double() - exact).abs().max()) < 1e-4 * float(exact.abs().max()) + 1e-5


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
def test_rope_qk_by_address_on_decode_views_equals_the_view_path(monkeypatch, layout):
    """q / k as a decode step has them: [B, 1, H, D] transposed to [B, H, 1, D] (contiguous
    in torch's sense), tables [B, 1, 1, D]; batch 2 with per-row tables."""
    q = torch.randn(2, 1, 8, 64).transpose(1, 2)
    k = torch.randn(2, 1, 4, 64).transpose(1, 2)
    cos, sin = torch.randn(2, 1, 64).unsqueeze(1), torch.randn(2, 1, 64).unsqueeze(1)
    calls = []
    real = rope._rope_at
    monkeypatch.setattr(rope, "_rope_at", lambda *a: calls.append(1) or real(*a))
    fast = rope.rope_qk(q, k, cos, sin, layout)
    assert calls == [1, 1]
    monkeypatch.undo()
    monkeypatch.setattr(rope, "by_address", lambda *t: False)
    slow = rope.rope_qk(q, k, cos, sin, layout)
    _same(fast, slow)
    from opfuse.kernels import reference
    torch.testing.assert_close(fast[0].double(), reference.rope(q, cos, sin, layout), rtol=1e-5, atol=1e-5)


def test_other_inputs_keep_the_view_path():
    """Strided, half-precision or many-row parallel inputs are not taken by address."""
    x = torch.randn(4, 64)
    assert _launch.by_address(x, torch.randn(64))
    assert not _launch.by_address(x.t(), torch.randn(64))
    assert not _launch.by_address(x.half())
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not _launch.by_address(torch.randn(512, 256))  # parallel work: the prange kernel
        assert _launch.by_address(torch.randn(1, 512))
    finally:
        torch.set_num_threads(before)



@pytest.fixture
def float64_default():
    """A user who called ``torch.set_default_dtype(torch.float64)``: the fast paths' outputs
    must stay float32 (they once came from ``torch.empty(shape)``: float64 buffers the
    kernels filled with float32 bits, a silent wrong result)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def test_fast_paths_ignore_the_default_dtype(float64_default):
    from opfuse.kernels import reference
    from opfuse.kernels.cpu import attention
    g = torch.Generator().manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    x, res, w, wt = r(1, 1, 64), r(1, 1, 64), r(64), r(48, 64)
    checks = [
        (rmsnorm.rmsnorm(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6)),
        (add_rmsnorm.add_rmsnorm(x, res, w, 1e-6)[0], reference.add_rmsnorm(x, res, w, 1e-6)[0]),
        (linear_gemv.linear_gemv(x, wt, None), x.double() @ wt.double().t()),
    ]
    q, k = r(1, 4, 1, 16), r(1, 2, 1, 16)
    cos, sin = r(1, 1, 16).unsqueeze(1), r(1, 1, 16).unsqueeze(1)
    qo, ko = rope.rope_qk(q, k, cos, sin, "rotate_half")
    checks += [(qo, reference.rope(q, cos, sin, "rotate_half")), (ko, reference.rope(k, cos, sin, "rotate_half"))]
    kc, vc = r(1, 2, 9, 16), r(1, 2, 9, 16)
    checks.append((attention.attention(q, kc, vc, None, 0.25, False),
                   reference.attention(q, kc, vc, None, 0.25, False)))
    for out, expected in checks:
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected.double(), rtol=1e-4, atol=1e-5)


def test_f32_makes_a_strided_float32_input_contiguous():
    # Tensor.to(float32, memory_format=contiguous_format) returns a float32 input itself,
    # strides and all; numba then got a non-contiguous array and ran its loops unvectorised
    # (a Llama's batch-4 prefill LM head, x[:, -1, :], 18x slower)
    x = torch.randn(4, 3, 64)[:, -1, :]
    y = _launch.f32(x)
    assert not x.is_contiguous() and y.is_contiguous() and torch.equal(x, y)
    assert y.numpy().flags["C_CONTIGUOUS"]
    assert _launch.f32(y).data_ptr() == y.data_ptr()  # contiguous float32: no copy
    assert _launch.f32(x.double()).is_contiguous()


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_gemvs_on_a_strided_row_slice_equal_the_contiguous_call(rows):
    # the prefill LM head's input: the last position of each sequence, rows apart in memory
    h = torch.randn(rows, 5, 96)
    x = h[:, -1, :]
    w, b = torch.randn(200, 96), torch.randn(200)
    ref = (x.double() @ w.double().t() + b.double())
    y = linear_gemv.linear_gemv(x, w, b)
    assert torch.equal(y, linear_gemv.linear_gemv(x.contiguous(), w, b))
    assert float((y.double() - ref).abs().max()) < 1e-5 * float(ref.abs().max())
    wb = w.to(torch.bfloat16)
    xr = x.to(torch.bfloat16).double() if _bf16dot.AVAILABLE else x.double()  # the vdpbf16ps GEMV rounds x (K = 96)
    refb = xr @ wb.double().t() + b.double()
    yb = linear_bf16.linear_bf16(x, wb, b)
    assert torch.equal(yb, linear_bf16.linear_bf16(x.contiguous(), wb, b))
    assert float((yb.double() - refb).abs().max()) < 1e-5 * float(refb.abs().max())
