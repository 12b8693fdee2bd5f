"""SwiGLU / GeGLU at a few rows (a dynamic plan's short calls, a decode-sized call): the
merged [gate; up] GEMM runs opfuse's float32 weight-stream GEMV, against float64 oracles;
inputs the GEMV cannot take run the GEMM path with the same values; NaN stays in its row;
and a decode-sized plan keeps the gated MLP unfused (ρ over all bytes, weights included:
fused at decode it measured slower in place, see the README)."""

import math

import pytest
import torch

import opfuse
from opfuse.kernels.cpu import _gemm
from opfuse.models import load

F = torch.nn.functional


def _oracle(x, w, hidden, act):
    h = x.double().reshape(-1, x.shape[-1]) @ w.double().T
    g, u = h[:, :hidden], h[:, hidden:]
    return (act(g) * u).view(*x.shape[:-1], hidden)


ACTS = {"swiglu": (lambda x, w, h: torch.ops.opfuse.swiglu(x, w, h), F.silu),
        "geglu": (lambda x, w, h: torch.ops.opfuse.geglu(x, w, h, "tanh"), lambda t: F.gelu(t, approximate="tanh"))}


def _rel(out, ref):
    return float((out.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("op", sorted(ACTS))
@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize("k, hidden", [(64, 48), (100, 17), (512, 1376)])
def test_few_rows_against_float64(one_thread, op, rows, k, hidden):
    call, act = ACTS[op]
    g = torch.Generator().manual_seed(rows + k)
    x, w = torch.randn(1, rows, k, generator=g), torch.randn(2 * hidden, k, generator=g) / math.sqrt(k)
    streamed = _gemm.few_rows(x.view(rows, k), w) is not None
    assert streamed == (rows <= _gemm.FEW_ROWS)  # above FEW_ROWS: ATen's GEMM
    out = call(x, w, hidden)
    assert out.shape == (1, rows, hidden) and out.dtype == torch.float32
    assert _rel(out, _oracle(x, w, hidden, act)) < 2e-6


def test_what_the_gemv_cannot_take_runs_the_gemm_path_with_equal_values(one_thread):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 64, generator=g), torch.randn(96, 64, generator=g) / 8
    ref = _oracle(x, w, 48, F.silu)
    strided = torch.randn(4, 128, generator=g)[:, ::2].copy_(x)  # not contiguous: no GEMV by address
    assert _gemm.few_rows(strided, w) is None
    assert _gemm.few_rows(x, w.t().contiguous().t()) is None  # the wt layout: ATen's GEMM
    assert _gemm.few_rows(x, w.double()) is None and _gemm.few_rows(x, w.bfloat16()) is None
    for xi, wi in ((strided, w), (x, w.t().contiguous().t()), (x.expand(2, 4, 64), w)):
        assert _rel(torch.ops.opfuse.swiglu(xi, wi, 48), ref) < 2e-6
    nan = x.clone()
    nan[2, 7] = float("nan")
    out = torch.ops.opfuse.swiglu(nan, w, 48)
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()  # no silent wrong value


def test_two_threads_keep_the_gemm_path():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, w = torch.randn(1, 64), torch.randn(96, 64) / 8
        assert _gemm.few_rows(x, w) is None
        assert _rel(torch.ops.opfuse.swiglu(x, w, 48), _oracle(x, w, 48, F.silu)) < 2e-6
    finally:
        torch.set_num_threads(before)


def test_a_decode_sized_plan_keeps_the_gated_mlp_unfused(monkeypatch, tmp_path):
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    loaded = load("llama-tiny", batch=1, seq=1)
    fused = opfuse.optimize(loaded.model, loaded.args, example_kwargs=loaded.kwargs, decide="rho")
    assert "swiglu" not in fused.report.counts()
    why = [r.reason for r in fused.report.regions if r.pattern == "swiglu"]
    assert why and all(r.startswith("ρ=") and "< θ" in r for r in why), why
    with torch.no_grad():
        torch.testing.assert_close(fused(*loaded.args, **loaded.kwargs).last_hidden_state,
                                   loaded.model(*loaded.args, **loaded.kwargs).last_hidden_state, rtol=1e-5, atol=1e-5)
