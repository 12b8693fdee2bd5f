"""opfuse.attention_bf16's ``tiles=True`` form (one kernel per head: float32 scores kept in
L1, bf16 q·kᵀ and P·v on AVX512-BF16 tiles, :mod:`opfuse.kernels.cpu._bf16dot`) against
the float64 oracle on awkward shapes; what it cannot compute gives the float32 kernel's
result exactly; strided inputs, two threads and the precision pass's choice of the form."""

import math

import numpy as np
import pytest
import torch

from opfuse import precision as P
from opfuse.kernels import reference
from opfuse.kernels.cpu import _bf16dot
from opfuse.kernels.cpu import attention_bf16 as A
from opfuse.kernels.cpu.attention import attention as attention_f32
from opfuse.kernels.cpu.attention_bf16 import attention_bf16

pytestmark = pytest.mark.skipif(not _bf16dot.AVAILABLE, reason="the tiles need avx512_bf16")
FASTER = lambda node, fp32, bf16: {"fp32": 2e-4, "bf16": 1e-4}  # noqa: E731  injected clock


def _qkv(b, h, sq, sk, d, dv, scale=2.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, s, d, generator=g) * scale for s in (sq, sk))
    v = torch.randn(b, h, sk, dv, generator=g) * scale
    return [t.to(dtype) for t in (q, k, v)]


def _rel(out, ref):
    return float((out.double() - ref).abs().max() / ref.abs().max())


def _mask(kind, b, sq, sk):
    if kind == "bool":  # padding [B, 1, 1, Sk], key 0 kept
        mask = torch.rand(b, 1, 1, sk, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[..., 0] = True
        return mask
    if kind == "additive":  # [B, 1, Sq, Sk], positive entries too
        return torch.randn(b, 1, sq, sk, generator=torch.Generator().manual_seed(2)) * 3
    return None


# (B, H, Sq, Sk, D, Dv): Sq and Sk around the tile's 8 rows / 32 keys, odd Sk, one key, D = 2
SHAPES = [(2, 3, 16, 16, 32, 32), (1, 4, 7, 33, 64, 64), (3, 2, 128, 128, 32, 32), (1, 2, 1, 1, 2, 32),
          (1, 2, 9, 77, 6, 96), (1, 1, 130, 257, 64, 64), (2, 2, 31, 31, 16, 32)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_float64(shape, mask_kind, dtype):
    b, h, sq, sk, d, dv = shape
    if mask_kind == "causal" and sq != sk:
        pytest.skip("causal with Sq != Sk runs the float32 kernel")
    q, k, v = _qkv(b, h, sq, sk, d, dv, dtype=dtype)
    mask = _mask(mask_kind, b, sq, sk)
    scale, causal = 1 / math.sqrt(d), mask_kind == "causal"
    ref = reference.attention(q.double(), k.double(), v.double(), mask, scale, causal)
    out = attention_bf16(q, k, v, mask, scale, causal, tiles=True)
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
    # q, k, v and P rounded to bf16 once each (scores float32): the ATen bf16 SDPA's error
    assert _rel(out, ref) < 2.5e-2
    if dtype == torch.float32:
        assert _rel(out, ref) > 1e-5  # it did run in bf16 (the float32 kernel is ~1e-6 here)


def test_large_scores_stay_accurate_without_a_shift():
    """Scores of |s|·scale up to ~100 (MiniLM's first layer reaches 80): float32 scores keep
    them exact where a bf16 rounding of the raw score would cost |s|·2⁻⁹ in the exponent
    (against float64 on q, k, v rounded to bf16: the error the scores and P add)."""
    q, k, v = (t.bfloat16().float() for t in _qkv(2, 2, 16, 64, 32, 32, scale=6.0))
    ref = reference.attention(q.double(), k.double(), v.double(), None, 0.5, False)
    out = attention_bf16(q, k, v, None, 0.5, False, tiles=True)
    raw = attention_bf16(q, k, v, None, 0.5, False, False)  # the raw scores rounded to bf16
    assert _rel(out, ref) < 2.5e-2 and _rel(out, ref) < _rel(raw, ref) / 2


@pytest.mark.parametrize("bad", ["nan_q", "negative_nan_q", "inf_k", "minus_inf_q", "nan_mask", "inf_mask", "gqa"])
def test_what_it_does_not_compute_runs_the_float32_kernel(bad):
    q, k, v = _qkv(1, 4, 9, 40, 32, 32)
    mask = None
    if bad == "nan_q":
        q[0, 1, 2, 3] = float("nan")
    elif bad == "negative_nan_q":  # sign bit set: below every other value in an order key
        q[0, 1, 2, 3] = -torch.tensor(float("nan"))
    elif bad == "inf_k":
        k[0, 2, 5, 0] = float("inf")
    elif bad == "minus_inf_q":
        q[0, 3, 8, 1] = float("-inf")
    elif bad == "nan_mask":
        mask = torch.zeros(1, 1, 9, 40)
        mask[0, 0, 1, 1] = float("nan")
    elif bad == "inf_mask":
        mask = torch.zeros(1, 1, 9, 40)
        mask[0, 0, 6, 2] = float("inf")
    else:
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    out = attention_bf16(q, k, v, mask, 0.25, False, tiles=True)
    f32 = attention_f32(q, k, v, mask, 0.25, False)
    assert torch.allclose(out, f32, equal_nan=True, atol=0, rtol=0)


def test_nan_in_v_reaches_the_same_outputs_as_eager():
    q, k, v = _qkv(1, 2, 12, 20, 32, 32)
    v[0, 1, 7, 5] = float("nan")
    mask = torch.ones(1, 1, 12, 20, dtype=torch.bool)
    mask[..., 7] = False  # a masked key's P is 0, and 0·NaN is NaN in eager's P·v too
    out = attention_bf16(q, k, v, mask, 0.2, False, tiles=True)
    f32 = attention_f32(q, k, v, mask, 0.2, False)
    assert torch.equal(out.isnan(), f32.isnan()) and out.isnan().any()
    ok = ~f32.isnan()
    assert torch.allclose(out[ok], f32[ok], atol=5e-2, rtol=5e-2)


def test_fully_masked_rows_give_zero_as_sdpa():
    q, k, v = _qkv(2, 2, 11, 35, 32, 32)
    mask = torch.ones(2, 1, 11, 35, dtype=torch.bool)
    mask[1, 0, 3] = False
    out = attention_bf16(q, k, v, mask, 0.2, False, tiles=True)
    f32 = attention_f32(q, k, v, mask, 0.2, False)
    assert torch.equal(out[1, :, 3], torch.zeros_like(out[1, :, 3])) and torch.equal(out[1, :, 3], f32[1, :, 3])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_views_and_two_threads_give_the_same_bits(dtype):
    """q, k, v as a QKV GEMM leaves them (views of one [B, S, 3, H, D] tensor) equal their
    contiguous copies bit for bit, on one thread and on two (numba's prange over heads)."""
    b, s, h, d = 2, 45, 4, 32
    x = (torch.randn(b, s, 3, h, d, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    mask = _mask("bool", b, s, s)
    base = attention_bf16(*(t.contiguous() for t in (q, k, v)), mask, 0.2, False, tiles=True)
    assert torch.equal(attention_bf16(q, k, v, mask, 0.2, False, tiles=True), base)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(attention_bf16(q, k, v, mask, 0.2, False, tiles=True), base)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(2, 3, 16, 16, 32, 32), (1, 2, 9, 77, 6, 96)])  # odd Sk: v's last key alone
def test_float32_inputs_are_rounded_as_torch_rounds_them(shape):
    """float32 q, k, v are rounded to bf16 while they are packed: the result equals, bit for
    bit, that of the same inputs rounded by torch first (nearest even), ties included, and
    a value past bf16's range becomes inf there too (a ±inf score: the float32 kernel)."""
    b, h, sq, sk, d, dv = shape
    q, k, v = _qkv(b, h, sq, sk, d, dv, seed=4)
    tie = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8)])  # halfway between two bf16 values
    q.view(-1)[:3], k.view(-1)[:3], v.view(-1)[-3:] = tie, tie, tie
    mask = _mask("bool", b, sq, sk)
    rounded = [t.bfloat16().float() for t in (q, k, v)]
    out = attention_bf16(q, k, v, mask, 0.3, False, tiles=True)
    assert out.dtype == torch.float32 and torch.equal(out, attention_bf16(*rounded, mask, 0.3, False, tiles=True))
    big = q.clone()
    big[0, 0, 0, 0] = 3.4e38  # rounds up past bf16's largest finite value: inf, as torch rounds it
    torch.testing.assert_close(attention_bf16(big, k, v, mask, 0.3, False, tiles=True),
                               attention_f32(big, k, v, mask, 0.3, False), rtol=0, atol=0, equal_nan=True)


def test_unsupported_head_sizes_take_the_gemm_form():
    """Dv not a multiple of 32, or an odd D: ``tiles=True`` runs the shifted-GEMM form."""
    for d, dv in ((32, 48), (33, 32)):
        q, k, v = _qkv(1, 2, 8, 8, d, dv)
        assert not A.tiles_supported(d, dv)
        assert torch.equal(attention_bf16(q, k, v, None, 0.3, False, tiles=True),
                           attention_bf16(q, k, v, None, 0.3, False))


def test_tiles_against_float64_dot_products():
    """qk_tile / pv_tile alone: products exact, float32 accumulation; pv_tile's bf16 output
    rounded to nearest even (as torch's conversion)."""
    from numba import njit

    @njit
    def run(q, kp, s, p, vp, o, ob, inv, npairs, nkeys, vpairs):
        _bf16dot.qk_tile(q, 0, kp, s, npairs, nkeys)
        _bf16dot.pv_tile(p, vp, o, 0, 0, inv, vpairs)
        _bf16dot.pv_tile(p, vp, ob, 0, 0, inv, vpairs)

    g = torch.Generator().manual_seed(4)
    rows, d, nk, dv = _bf16dot.ROWS, 10, 64, 32
    q, k = torch.randn(rows, d, generator=g).bfloat16(), torch.randn(nk, d, generator=g).bfloat16()
    p, v = torch.rand(rows, nk, generator=g).bfloat16(), torch.randn(nk, dv, generator=g).bfloat16()
    inv = torch.rand(rows, generator=g) + 0.5
    kp = k.view(nk, d // 2, 2).transpose(0, 1).contiguous()  # [D/2, N, 2]
    vp = v.view(nk // 2, 2, dv).transpose(1, 2).contiguous()  # [N/2, Dv, 2]
    s, o = np.zeros((rows, nk), np.float32), np.zeros((rows, dv), np.float32)
    ob = torch.zeros(rows, dv, dtype=torch.bfloat16)
    bits = A._bits
    run(bits(q), bits(kp).reshape(d // 2, -1), s, bits(p), bits(vp).reshape(nk // 2, -1), o, bits(ob),
        inv.numpy(), d // 2, nk, nk // 2)
    ref_s = q.double() @ k.double().T
    ref_o = (p.double() @ v.double()) * inv.double()[:, None]
    assert np.allclose(s, ref_s.numpy(), rtol=1e-5, atol=1e-5)
    assert np.allclose(o, ref_o.numpy(), rtol=1e-5, atol=1e-5)
    assert torch.equal(ob, torch.from_numpy(o).bfloat16())


def _plan():
    import opfuse
    from opfuse.models import load
    loaded = load("bert-tiny", batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, example_kwargs=loaded.kwargs, decide="rho")
    return loaded, next(iter(fused._plans.values())).gm


def test_the_precision_pass_lowers_to_the_tiles_form(monkeypatch):
    """With the form pinned to "tiles": both attentions of bert-tiny run attention_bf16 with
    tiles=True, the report names the form, the outputs stay within budget of eager's."""
    monkeypatch.setattr(P, "ATTENTION_FORMS", ("tiles",))
    loaded, gm = _plan()
    info = P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", timer=FASTER)
    att = [g for g in info["gemms"] if g["region"] == "attention"]
    assert [g["precision"] for g in att] == ["bf16", "bf16"] and all("tiles" in g["reason"] for g in att)
    nodes = [n for n in gm.graph.nodes if n.target is torch.ops.opfuse.attention_bf16.default]
    assert len(nodes) == 2 and all(len(n.args) == 10 and n.args[9] is True for n in nodes)
    with torch.no_grad():
        out = P._outputs(gm, loaded.args, loaded.kwargs)[0]
        ref = loaded.model(*loaded.args, **loaded.kwargs)[0]
    assert _rel(out, ref.double()) < 5e-2


def test_where_the_tiles_cannot_run_the_form_is_not_offered(monkeypatch):
    """tiles_supported False (a CPU without avx512_bf16): the form timing never sees "tiles"
    and no node gets tiles=True."""
    monkeypatch.setattr(P, "ATTENTION_FORMS", ("opfuse", "tiles"))
    monkeypatch.setattr(A, "tiles_supported", lambda d, dv: False)
    offered = []

    def clock(label, forms):
        offered.append(sorted(forms))
        return "opfuse", {}
    monkeypatch.setattr(P, "_attention_form", clock)
    loaded, gm = _plan()
    P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", timer=FASTER)
    assert offered == [["opfuse"], ["opfuse"]]
    nodes = [n for n in gm.graph.nodes if n.target is torch.ops.opfuse.attention_bf16.default]
    assert len(nodes) == 2 and all(len(n.args) < 10 for n in nodes)
