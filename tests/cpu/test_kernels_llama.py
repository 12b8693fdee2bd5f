"""Llama-family CPU kernels (rmsnorm, add_rmsnorm, swiglu, rope) vs their float64 oracles.

Awkward shapes (last dim 1, 7, 127, 384, 1023; rows 1, 3, 130; head dims 8, 64, 128;
sequence 1, 7, 33), per-dtype tolerance from reference.TOLERANCE, HF Llama's eager
arithmetic (cast before the weight), the two RoPE layouts not swapped, non-contiguous
inputs, validation errors, opcheck and hypothesis properties.

The HF eager formulas below are copied (not imported: importing transformers' Llama costs
~12 s) from transformers 5.x ``models/llama/modeling_llama.py`` (LlamaRMSNorm.forward,
rotate_half, apply_rotary_pos_emb) and ``models/gptj/modeling_gptj.py`` (rotate_every_two,
apply_rotary_pos_emb).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opfuse.kernels import reference
from opfuse.kernels.cpu import _math
from kernel_testing import assert_close, randn
from opfuse.kernels.registry import REGISTRY, lookup

OP = torch.ops.opfuse
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAST_DIMS = [1, 7, 127, 384, 1023]
ROWS = [1, 3, 130]
HEAD_DIMS = [8, 64, 128]
SEQS = [1, 7, 33]
LAYOUTS = ["rotate_half", "interleaved"]


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected).abs().max().item()


def rms_weight(n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return randn(n, dtype=dtype, seed=seed, scale=0.5, offset=1.0)


# --- HF eager formulas (see module docstring) ------------------------------------------


def hf_llama_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_llama_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # q [B, H, S, D]; cos, sin [B, S, D] (unsqueeze_dim=1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (hf_rotate_half(q) * sin)


def hf_gptj_rope(tensor: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    # tensor [B, S, H, D]; sin, cos [B, S, D/2]
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    x1 = tensor[:, :, :, ::2]
    x2 = tensor[:, :, :, 1::2]
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return (tensor * cos) + (rotated * sin)


def rope_tables(b: int, s: int, d: int, layout: str, dtype=torch.float32, base: float = 10000.0, offset: int = 0):
    """HF-style cos / sin [B, 1, S, D] for positions offset..offset+S-1 (batch b shifts by b)."""
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
    pos = torch.arange(s, dtype=torch.float64)[None, :] + offset + torch.arange(b, dtype=torch.float64)[:, None]
    freqs = pos[..., None] * inv_freq  # [B, S, D/2]
    if layout == "rotate_half":
        emb = torch.cat((freqs, freqs), dim=-1)  # Llama / NeoX: cat(c, c)
    else:
        emb = freqs.repeat_interleave(2, dim=-1)  # GPT-J: repeat_interleave(c, 2)
    return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)


# --- rmsnorm ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", LAST_DIMS)
def test_rmsnorm(n, rows, dtype):
    x = randn(rows, n, dtype=dtype, seed=2, scale=2.0, offset=0.3)
    w = rms_weight(n, dtype)
    assert_close(OP.rmsnorm(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("n", [4096, 8192])
def test_rmsnorm_wide_rows_large_values(n):
    """Sum of squares of width 8192 with values ~1e4: blocked float32 + float64 carry."""
    x = randn(16, n, seed=3, offset=1e4)
    w = rms_weight(n, torch.float32)
    err = max_err(OP.rmsnorm(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6))
    assert err <= 2e-6, err


@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),  # the cast happens before the weight: float32 result
        (torch.float16, torch.bfloat16),
    ],
)
def test_rmsnorm_matches_hf_llama_eager(x_dtype, w_dtype):
    """Normalised value cast to x's dtype, then times the weight: eager's result dtype and,
    for float16 / bfloat16 x, eager's bits bar rare 1-ulp flips from the summation order."""
    n = 1024
    x = randn(64, n, dtype=x_dtype, seed=4, scale=3.0)
    w = rms_weight(n, w_dtype)
    out, eager = OP.rmsnorm(x, w, 1e-6), hf_llama_rmsnorm(x, w, 1e-6)
    assert out.dtype == eager.dtype == torch.promote_types(x_dtype, w_dtype)
    eps = torch.finfo(x_dtype).eps
    torch.testing.assert_close(out.double(), eager.double(), rtol=2 * eps, atol=1e-6)  # <= 1 ulp of the cast
    if x_dtype != torch.float32:  # a 1-ulp rstd difference rarely survives the cast
        assert (out != eager).double().mean().item() <= 1e-3


def test_rmsnorm_float16_subnormal_cast():
    """Tiny normalised values take float16's subnormal rounding, as eager's cast does."""
    x = (randn(8, 1000, seed=5) * torch.logspace(-9, 0, 1000, dtype=torch.float64).float()).half()
    w = torch.ones(1000, dtype=torch.float16)
    out, eager = OP.rmsnorm(x, w, 1e-6), hf_llama_rmsnorm(x, w, 1e-6)
    assert (out != eager).double().mean().item() <= 1e-3
    assert max_err(out, eager.double()) <= 2 * torch.finfo(torch.float16).eps


# --- add_rmsnorm -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", LAST_DIMS)
def test_add_rmsnorm(n, rows, dtype):
    x, r = randn(rows, n, dtype=dtype, seed=6), randn(rows, n, dtype=dtype, seed=7, scale=3.0)
    w = rms_weight(n, dtype)
    out, s = OP.add_rmsnorm(x, r, w, 1e-5)
    expected, expected_sum = reference.add_rmsnorm(x, r, w, 1e-5)
    assert_close(out, expected, dtype)
    assert_close(s, expected_sum, dtype)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)  # the next residual, as eager adds it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_rmsnorm_matches_hf_llama_eager(dtype):
    """Eager: residual + hidden in the model dtype, then LlamaRMSNorm of that sum."""
    x, r = randn(2, 5, 512, dtype=dtype, seed=8), randn(2, 5, 512, dtype=dtype, seed=9, scale=4.0)
    w = rms_weight(512, dtype)
    out, s = OP.add_rmsnorm(x, r, w, 1e-6)
    eager_s = r + x
    eager = hf_llama_rmsnorm(eager_s, w, 1e-6)
    torch.testing.assert_close(s, eager_s, rtol=0, atol=0)
    assert out.dtype == eager.dtype and out.shape == eager.shape == x.shape
    assert (out != eager).double().mean().item() <= 1e-3


# --- swiglu ----------------------------------------------------------------------------

SWIGLU_SHAPES = [(1, 1, 7), (3, 7, 1), (3, 127, 384), (130, 384, 127), (130, 1023, 7), (1, 384, 1023)]  # (rows, K, H)


def gate_up_weight(hidden: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return randn(2 * hidden, k, dtype=dtype, seed=seed, scale=2 / math.sqrt(k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,hidden", SWIGLU_SHAPES)
def test_swiglu(rows, k, hidden, dtype):
    x = randn(rows, k, dtype=dtype, seed=10)
    w = gate_up_weight(hidden, k, dtype)
    assert_close(OP.swiglu(x, w, hidden), reference.swiglu(x, w, hidden), dtype)


def test_swiglu_gate_rows_first_and_leading_dims():
    """Rows 0..H-1 of w_gate_up are the gate: swapping the halves changes the result."""
    x = randn(2, 3, 5, 16, seed=11)
    w = gate_up_weight(8, 16, torch.float32)
    out = OP.swiglu(x, w, 8)
    assert out.shape == (2, 3, 5, 8)
    gate, up = w[:8], w[8:]
    eager = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    swapped = torch.cat((up, gate))
    assert max_err(OP.swiglu(x, swapped, 8), reference.swiglu(x, w, 8)) > 1e-2


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,hidden", SWIGLU_SHAPES[:5])
def test_geglu(rows, k, hidden, dtype, approximate):
    x = randn(rows, k, dtype=dtype, seed=12)
    w = gate_up_weight(hidden, k, dtype)
    assert_close(OP.geglu(x, w, hidden, approximate), reference.geglu(x, w, hidden, approximate), dtype)


def test_geglu_forms_and_halves_are_distinct():
    """erf and tanh GELU are different functions (never interchanged), gate rows come first,
    and a GeGLU is not a SwiGLU: each swap moves the result far beyond float32 noise."""
    x = randn(2, 3, 5, 16, seed=13) * 3
    w = gate_up_weight(8, 16, torch.float32)
    gate, up = w[:8], w[8:]
    erf = OP.geglu(x, w, 8, "none")
    torch.testing.assert_close(erf, torch.nn.functional.gelu(x @ gate.T) * (x @ up.T), rtol=1e-5, atol=1e-5)
    tanh = OP.geglu(x, w, 8, "tanh")
    torch.testing.assert_close(tanh, torch.nn.functional.gelu(x @ gate.T, approximate="tanh") * (x @ up.T),
                               rtol=1e-5, atol=1e-5)
    assert max_err(erf, tanh) > 1e-4
    assert max_err(OP.geglu(x, torch.cat((up, gate)), 8, "none"), erf) > 1e-2
    assert max_err(OP.swiglu(x, w, 8), erf) > 1e-2
    with pytest.raises(ValueError, match="approximate"):
        OP.geglu(x, w, 8, "sigmoid")


def test_silu_extremes_and_exp_accuracy():
    """silu on [-100, 100] and at +-1e4 (exp clamped): no inf / nan, relative error ~1e-7."""
    z = torch.cat((torch.linspace(-100, 100, 4001), torch.tensor([-1e4, -88.5, -87.5, 87.5, 88.5, 1e4])))
    x = torch.stack((z, torch.ones_like(z)), dim=-1)  # [M, 2]: gate = z, up = 1
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    out = OP.swiglu(x, w, 1)[:, 0]
    expected = reference.silu(z)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-30)

    v = np.linspace(-87.0, 88.0, 200_001, dtype=np.float32)
    got = np.array([_math.exp_f32(t) for t in v[::97]], dtype=np.float64)
    rel = np.abs(got / np.exp(v[::97].astype(np.float64)) - 1).max()
    assert rel <= 2e-7, rel


# --- rope ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", SEQS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rope(d, s, dtype, layout):
    b, h = 2, 3
    x = randn(b, h, s, d, dtype=dtype, seed=12)
    cos, sin = rope_tables(b, s, d, layout, dtype, offset=5)
    assert_close(OP.rope(x, cos, sin, layout), reference.rope(x, cos, sin, layout), dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rope_table_broadcasts(layout):
    """cos / sin of shape [1, 1, S, D], [S, D], or batch-broadcast differently from each other."""
    b, h, s, d = 3, 2, 7, 8
    x = randn(b, h, s, d, seed=13)
    cos, sin = rope_tables(b, s, d, layout)
    for c, sn in ((cos[:1], sin[:1]), (cos[0, 0], sin[0, 0]), (cos, sin[:1]), (cos[:1, 0], sin)):
        assert_close(OP.rope(x, c, sn, layout), reference.rope(x, c, sn, layout), torch.float32)


def test_rope_matches_hf_llama_and_gptj():
    b, h, s, d = 2, 4, 9, 64
    q = randn(b, s, h, d, seed=14)  # [B, S, H, D], as the projection writes it
    cos, sin = rope_tables(b, s, d, "rotate_half")
    llama = hf_llama_rope(q.transpose(1, 2), cos[:, 0], sin[:, 0])
    torch.testing.assert_close(OP.rope(q.transpose(1, 2), cos, sin, "rotate_half"), llama, rtol=1e-6, atol=1e-6)

    cos_i, sin_i = rope_tables(b, s, d, "interleaved")
    gptj = hf_gptj_rope(q, sin_i[:, 0, :, ::2], cos_i[:, 0, :, ::2])  # GPT-J passes half-width tables
    out = OP.rope(q.transpose(1, 2), cos_i, sin_i, "interleaved")
    torch.testing.assert_close(out, gptj.transpose(1, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rope_layouts_not_swappable(d):
    """Each layout matches its own oracle and is far from the other layout's, whichever table."""
    b, h, s = 1, 2, 33
    x = randn(b, h, s, d, seed=15)
    for table_layout in LAYOUTS:
        cos, sin = rope_tables(b, s, d, table_layout, offset=3)
        for mine, other in (("rotate_half", "interleaved"), ("interleaved", "rotate_half")):
            out = OP.rope(x, cos, sin, mine)
            assert max_err(out, reference.rope(x, cos, sin, mine)) <= 1e-5
            assert max_err(out, reference.rope(x, cos, sin, other)) > 0.1, f"layout={mine!r} computed {other!r}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,s", [(8, 1), (64, 7), (128, 33)])
def test_rope_qk(d, s, dtype, layout):
    """q [B, H, S, D] (a transposed view) and k [B, Hkv, S, D] (GQA) with one set of tables."""
    b, h, hkv = 2, 4, 2
    q = randn(b, s, h, d, dtype=dtype, seed=21).transpose(1, 2)
    k = randn(b, hkv, s, d, dtype=dtype, seed=22)
    cos, sin = rope_tables(b, s, d, layout, dtype, offset=2)
    oq, ok = OP.rope_qk(q, k, cos, sin, layout)
    eq, ek = reference.rope_qk(q, k, cos, sin, layout)
    assert_close(oq, eq, dtype)
    assert_close(ok, ek, dtype)
    torch.testing.assert_close(oq, OP.rope(q, cos, sin, layout), rtol=0, atol=0)  # the same kernel as rope
    torch.testing.assert_close(ok, OP.rope(k, cos, sin, layout), rtol=0, atol=0)


def test_rope_qk_tables_broadcast_and_promote():
    b, s, d = 3, 5, 8
    q, k = randn(b, 2, s, d, seed=23).bfloat16(), randn(b, 1, s, d, seed=24).bfloat16()
    cos, sin = rope_tables(b, s, d, "interleaved")
    oq, ok = OP.rope_qk(q, k, cos[:1, 0], sin, "interleaved")  # [S, D] cos, [B, 1, S, D] sin; float32 tables
    assert oq.dtype == ok.dtype == torch.float32
    eq, ek = reference.rope_qk(q, k, cos[:1, 0], sin, "interleaved")
    assert_close(oq, eq, torch.float32)
    assert_close(ok, ek, torch.float32)


# --- non-contiguous inputs -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    x = randn(384, 130, dtype=dtype, seed=16).t()  # [130, 384], strided
    r = randn(130, 768, dtype=dtype, seed=17)[:, ::2]  # [130, 384], stride 2
    w = rms_weight(768, dtype)[::2]  # [384], stride 2
    assert not (x.is_contiguous() or r.is_contiguous() or w.is_contiguous())
    assert_close(OP.rmsnorm(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6), dtype)
    out, s = OP.add_rmsnorm(x, r, w, 1e-6)
    expected, expected_sum = reference.add_rmsnorm(x, r, w, 1e-6)
    assert_close(out, expected, dtype)
    assert_close(s, expected_sum, dtype)

    wgu = gate_up_weight(127, 384, dtype).t().contiguous().t()  # [254, 384], column-major
    assert not wgu.is_contiguous()
    assert_close(OP.swiglu(x, wgu, 127), reference.swiglu(x, wgu, 127), dtype)
    assert_close(OP.geglu(x, wgu, 127, "tanh"), reference.geglu(x, wgu, 127, "tanh"), dtype)

    for layout in LAYOUTS:
        q = randn(2, 7, 3, 64, dtype=dtype, seed=18).transpose(1, 2)  # [B, H, S, D] view of [B, S, H, D]
        k = randn(2, 3, 7, 128, dtype=dtype, seed=19)[..., ::2]  # last dim stride 2: copied once
        cos, sin = rope_tables(2, 7, 64, layout, dtype)
        cos_t = cos.transpose(-1, -2).contiguous().transpose(-1, -2)  # strided table
        for t in (q, k):
            assert not t.is_contiguous()
            assert_close(OP.rope(t, cos_t, sin, layout), reference.rope(t, cos_t, sin, layout), dtype)


def test_rope_output_is_contiguous_and_input_untouched():
    q = randn(1, 5, 2, 8, seed=20).transpose(1, 2)
    before = q.clone()
    cos, sin = rope_tables(1, 5, 8, "rotate_half")
    out = OP.rope(q, cos, sin, "rotate_half")
    assert out.is_contiguous() and out.shape == q.shape
    torch.testing.assert_close(q, before, rtol=0, atol=0)


# --- validation ------------------------------------------------------------------------


def _bad_calls():
    x, r = randn(3, 8), randn(3, 8)
    w = rms_weight(8, torch.float32)
    q = randn(1, 2, 5, 8)
    cos, sin = rope_tables(1, 5, 8, "rotate_half")
    wgu = gate_up_weight(4, 8, torch.float32)
    return [
        ("weight shape", lambda: OP.rmsnorm(x, randn(9), 1e-6)),
        ("unsupported dtype", lambda: OP.rmsnorm(x.double(), w, 1e-6)),
        ("residual shape", lambda: OP.add_rmsnorm(x, randn(3, 9), w, 1e-6)),
        ("dtype mismatch", lambda: OP.add_rmsnorm(x, r.half(), w, 1e-6)),
        ("weight shape", lambda: OP.add_rmsnorm(x, r, randn(7), 1e-6)),
        ("w_gate_up shape", lambda: OP.swiglu(x, randn(8, 8), 3)),
        ("w_gate_up shape", lambda: OP.swiglu(x, randn(8, 7), 4)),
        ("hidden must be >= 1", lambda: OP.swiglu(x, wgu, 0)),
        ("dtype mismatch", lambda: OP.swiglu(x, wgu.bfloat16(), 4)),
        ("D must be even", lambda: OP.rope(randn(1, 2, 5, 7), cos[..., :7], sin[..., :7], "rotate_half")),
        ("layout must be one of", lambda: OP.rope(q, cos, sin, "neox")),
        ("4-D", lambda: OP.rope(q[0], cos, sin, "rotate_half")),
        ("cos shape", lambda: OP.rope(q, randn(1, 1, 4, 8), sin, "rotate_half")),
        ("sin shape", lambda: OP.rope(q, cos, randn(1, 2, 5, 8), "interleaved")),
        ("cos shape", lambda: OP.rope(q, randn(2, 1, 5, 8), sin, "rotate_half")),
        ("sin shape", lambda: OP.rope(q, cos, randn(1, 1, 1, 5, 8), "rotate_half")),
        ("unsupported dtype", lambda: OP.rope(q, cos.double(), sin, "rotate_half")),
        ("k shape", lambda: OP.rope_qk(q, randn(1, 2, 4, 8), cos, sin, "rotate_half")),
        ("k shape", lambda: OP.rope_qk(q, randn(1, 2, 5, 6), cos, sin, "interleaved")),
        ("layout must be one of", lambda: OP.rope_qk(q, q, cos, sin, "mixed")),
        ("k must be 4-D", lambda: OP.rope_qk(q, q[0], cos, sin, "rotate_half")),
        ("sin shape", lambda: OP.rope_qk(q, q, cos, randn(1, 1, 4, 8), "rotate_half")),
        ("device", lambda: lookup("rope_qk", "cpu")(q, q.to("meta"), cos, sin, "rotate_half")),
        ("device", lambda: lookup("rope", "cpu")(q.to("meta"), cos, sin, "rotate_half")),
        ("device", lambda: lookup("rmsnorm", "cpu")(x, w.to("meta"), 1e-6)),
        ("device", lambda: lookup("swiglu", "cpu")(x.to("meta"), wgu, 4)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_raises_value_error(case):
    problem, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=problem):
        call()


# --- registry, fake shapes, opcheck ----------------------------------------------------


def test_registered_for_cpu():
    assert {(key, "cpu") for key in ("rmsnorm", "add_rmsnorm", "swiglu", "rope", "rope_qk")} <= set(REGISTRY)


def test_fake_shapes_on_meta():
    m = lambda *s, dtype=torch.bfloat16: torch.empty(*s, device="meta", dtype=dtype)  # noqa: E731
    out = OP.rmsnorm(m(2, 3, 8), m(8, dtype=torch.float32), 1e-6)
    assert out.shape == (2, 3, 8) and out.dtype == torch.float32
    out, s = OP.add_rmsnorm(m(2, 3, 8), m(2, 3, 8), m(8), 1e-6)
    assert out.shape == s.shape == (2, 3, 8) and out.dtype == s.dtype == torch.bfloat16
    out = OP.swiglu(m(2, 3, 8), m(10, 8), 5)
    assert out.shape == (2, 3, 5) and out.dtype == torch.bfloat16
    out = OP.rope(m(1, 4, 3, 8), m(1, 1, 3, 8), m(1, 1, 3, 8), "interleaved")
    assert out.shape == (1, 4, 3, 8) and out.dtype == torch.bfloat16
    oq, ok = OP.rope_qk(m(1, 4, 3, 8), m(1, 2, 3, 8), m(1, 1, 3, 8, dtype=torch.float32), m(1, 1, 3, 8), "rotate_half")
    assert oq.shape == (1, 4, 3, 8) and ok.shape == (1, 2, 3, 8) and oq.dtype == ok.dtype == torch.float32


def _opcheck_cases():
    x, r = randn(2, 3, 8, seed=40), randn(2, 3, 8, seed=41)
    w = rms_weight(8, torch.float32)
    q = randn(1, 3, 2, 8, seed=42).transpose(1, 2)  # [1, 2, 3, 8] strided
    cos, sin = rope_tables(1, 3, 8, "rotate_half")
    return [
        (OP.rmsnorm, (x, w, 1e-6)),
        (OP.rmsnorm, (x.bfloat16(), w, 1e-6)),  # promoted float32 result
        (OP.add_rmsnorm, (x, r, w, 1e-6)),
        (OP.add_rmsnorm, (x.half(), r.half(), w.half(), 1e-6)),
        (OP.swiglu, (x, gate_up_weight(4, 8, torch.float32), 4)),
        (OP.rope, (q, cos, sin, "rotate_half")),
        (OP.rope, (q.bfloat16(), cos.bfloat16(), sin.bfloat16(), "interleaved")),
        (OP.rope_qk, (q, q[:, :1].contiguous(), cos, sin, "rotate_half")),
        (OP.rope_qk, (q.bfloat16(), q[:, :1].half(), cos.bfloat16(), sin.bfloat16(), "interleaved")),
    ]


@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


# --- hypothesis properties -------------------------------------------------------------

_DIMS = st.sampled_from([1, 2, 3, 5, 7, 13, 31, 64, 97, 127, 128, 257, 384, 509, 1023, 4099])
_EPS = st.sampled_from([1e-12, 1e-6, 1e-5, 1e-3, 0.1])
_OFFSETS = st.sampled_from([0.0, 1.0, -37.5, 1e3, -1e4, 1e4])
_SCALES = st.sampled_from([1e-3, 1.0, 30.0])


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 9), n=_DIMS, eps=_EPS, offset=_OFFSETS, scale=_SCALES, seed=st.integers(0, 2**31 - 1))
def test_property_rmsnorm(rows, n, eps, offset, scale, seed):
    x = randn(rows, n, seed=seed, scale=scale, offset=offset)
    r = randn(rows, n, seed=seed + 1, scale=scale)
    w = rms_weight(n, torch.float32, seed=seed + 2)
    torch.testing.assert_close(OP.rmsnorm(x, w, eps).double(), reference.rmsnorm(x, w, eps), rtol=1e-5, atol=2e-5)
    out, s = OP.add_rmsnorm(x, r, w, eps)
    torch.testing.assert_close(out.double(), reference.add_rmsnorm(x, r, w, eps)[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)


@settings(max_examples=50, deadline=None)
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 4),
    s=st.integers(1, 40),
    half=st.sampled_from([1, 2, 3, 4, 5, 16, 32, 64]),
    layout=st.sampled_from(LAYOUTS),
    transposed=st.booleans(),
    batch_table=st.booleans(),
    offset=st.integers(0, 100_000),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_rope(b, h, s, half, layout, transposed, batch_table, offset, seed):
    d = 2 * half
    x = randn(b, s, h, d, seed=seed).transpose(1, 2) if transposed else randn(b, h, s, d, seed=seed)
    cos, sin = rope_tables(b if batch_table else 1, s, d, layout, offset=offset)
    out = OP.rope(x, cos, sin, layout)
    torch.testing.assert_close(out.double(), reference.rope(x, cos, sin, layout), rtol=1e-5, atol=1e-5)
    # a rotation: each pair keeps its norm (the tables give cos^2 + sin^2 = 1 on both elements)
    def pairs(t: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D/2, 2]
        if layout == "rotate_half":
            return t.unflatten(-1, (2, half)).transpose(-1, -2)
        return t.unflatten(-1, (half, 2))

    torch.testing.assert_close(pairs(out).norm(dim=-1), pairs(x).norm(dim=-1), rtol=1e-5, atol=1e-5)
