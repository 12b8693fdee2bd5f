"""CPU kernels vs their float64 oracles (opfuse.kernels.reference), through torch.ops.opfuse.

Awkward shapes (last dim 1, 7, 127, 384, 1023; rows 1, 3, 130), per-dtype tolerance from
reference.TOLERANCE, the LayerNorm mean-1e4 case, erf/tanh GELU not swapped, non-contiguous
inputs, validation errors, opcheck and hypothesis properties.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from opfuse.kernels import ops, reference
from kernel_testing import assert_close, randn
from opfuse.kernels.registry import REGISTRY, KernelRegistry, lookup

OP = torch.ops.opfuse
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAST_DIMS = [1, 7, 127, 384, 1023]
ROWS = [1, 3, 130]
APPROX = ["none", "tanh"]


def ln_params(n: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(n, dtype=dtype, seed=seed, scale=0.5, offset=1.0), randn(n, dtype=dtype, seed=seed + 1, scale=0.5)


def linear_params(n: int, k: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(n, k, dtype=dtype, seed=seed, scale=1 / math.sqrt(k)), randn(n, dtype=dtype, seed=seed + 1, scale=0.5)


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected).abs().max().item()


# --- add_layernorm ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", LAST_DIMS)
def test_add_layernorm(n, rows, dtype):
    x, r = randn(rows, n, dtype=dtype, seed=2), randn(rows, n, dtype=dtype, seed=3)
    w, b = ln_params(n, dtype)
    expected, expected_sum = reference.add_layernorm(x, r, w, b, 1e-5, True)
    assert_close(OP.add_layernorm(x, r, w, b, 1e-5), expected, dtype)
    out, s = OP.add_layernorm_sum(x, r, w, b, 1e-5)
    assert_close(out, expected, dtype)
    assert_close(s, expected_sum, dtype)


@pytest.mark.parametrize("with_bias", [True, False])
def test_add_layernorm_emit_sum_is_plain_sum(with_bias):
    """The emitted sum is x + residual (bias only enters the normalised output)."""
    x, r = randn(2, 5, 384, seed=4), randn(2, 5, 384, seed=5)
    w, b = ln_params(384, torch.float32)
    b = b if with_bias else None
    out, s = OP.add_layernorm_sum(x, r, w, b, 1e-6)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    expected, _ = reference.add_layernorm(x, r, w, b, 1e-6, False)
    assert_close(out, expected, torch.float32)
    assert out.shape == s.shape == x.shape


# --- layernorm_gelu --------------------------------------------------------------------


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", LAST_DIMS)
def test_layernorm_gelu(n, rows, dtype, approximate):
    x = randn(rows, n, dtype=dtype, seed=6, scale=2.0, offset=0.5)
    w, b = ln_params(n, dtype)
    expected = reference.layernorm_gelu(x, w, b, 1e-5, approximate)
    assert_close(OP.layernorm_gelu(x, w, b, 1e-5, approximate), expected, dtype)


def test_layernorm_gelu_without_bias():
    x = randn(3, 4, 127, seed=7)
    w, _ = ln_params(127, torch.float32)
    assert_close(OP.layernorm_gelu(x, w, None, 1e-5, "none"), reference.layernorm_gelu(x, w, None, 1e-5, "none"), torch.float32)


# --- LayerNorm numerics: rows with mean 1e4, std 1 -------------------------------------


def test_layernorm_large_mean_rows_beat_torch():
    """Shifted statistics: error <= 1e-5 vs float64 where torch's own LayerNorm is ~1e-3."""
    n = 768
    x = randn(64, n, seed=8, offset=1e4)
    r = randn(64, n, seed=9)
    w, b = torch.ones(n), torch.zeros(n)

    ours_ln_gelu = max_err(OP.layernorm_gelu(x, w, b, 1e-5, "none"), reference.layernorm_gelu(x, w, b, 1e-5, "none"))
    expected, _ = reference.add_layernorm(x, r, w, b, 1e-5, False)
    ours_add_ln = max_err(OP.add_layernorm(x, r, w, b, 1e-5), expected)
    torch_ln = max_err(F.layer_norm(x, (n,), w, b, 1e-5), reference.layer_norm(x, w, b, 1e-5))

    assert ours_ln_gelu <= 1e-5, ours_ln_gelu
    assert ours_add_ln <= 1e-5, ours_add_ln
    assert torch_ln > 10 * max(ours_ln_gelu, ours_add_ln), (torch_ln, ours_ln_gelu, ours_add_ln)


# --- GELU: erf form and tanh form are different functions ------------------------------


def _gelu_forms_case(name: str):
    """(call(approximate) -> out, pre-activation in float64) for each GELU-fusing op."""
    x = randn(130, 384, seed=10, scale=2.0)
    w, b = ln_params(384, torch.float32)
    lw, lb = linear_params(256, 384, torch.float32)
    w2, b2 = linear_params(384, 256, torch.float32, seed=3)
    if name == "layernorm_gelu":
        return (lambda a: OP.layernorm_gelu(x, w, b, 1e-5, a)), (lambda a: reference.layernorm_gelu(x, w, b, 1e-5, a))
    if name == "linear_bias_gelu":
        return (lambda a: OP.linear_bias_gelu(x, lw, lb, a)), (lambda a: reference.linear_bias_gelu(x, lw, lb, a))
    return (lambda a: OP.ffn(x, lw, lb, w2, b2, a, 32)), (lambda a: reference.ffn(x, lw, lb, w2, b2, a))


@pytest.mark.parametrize("name", ["layernorm_gelu", "linear_bias_gelu", "ffn"])
def test_gelu_forms_not_swapped(name):
    call, oracle = _gelu_forms_case(name)
    for mine, other in (("none", "tanh"), ("tanh", "none")):
        out = call(mine)
        assert max_err(out, oracle(mine)) <= 2e-5
        assert max_err(out, oracle(other)) > 1e-4, f"approximate={mine!r} computed the {other!r} form"


# --- linear_bias_gelu / linear_residual / ffn -------------------------------------------

LINEAR_SHAPES = [(1, 1, 7), (3, 7, 1), (3, 127, 384), (130, 384, 127), (130, 1023, 7), (1, 384, 1023)]  # (rows, K, N)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", LINEAR_SHAPES)
def test_linear_bias_gelu(rows, k, n, dtype, approximate):
    x = randn(rows, k, dtype=dtype, seed=11)
    w, b = linear_params(n, k, dtype)
    assert_close(OP.linear_bias_gelu(x, w, b, approximate), reference.linear_bias_gelu(x, w, b, approximate), dtype)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", LINEAR_SHAPES)
def test_linear_residual(rows, k, n, dtype, with_bias):
    x = randn(rows, k, dtype=dtype, seed=12)
    w, b = linear_params(n, k, dtype)
    b = b if with_bias else None
    res = randn(rows, n, dtype=dtype, seed=13)
    assert_close(OP.linear_residual(x, w, b, res), reference.linear_residual(x, w, b, res), dtype)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", LINEAR_SHAPES)
def test_linear_add_layernorm(rows, k, n, dtype, with_bias):
    x = randn(rows, k, dtype=dtype, seed=50)
    w, b = linear_params(n, k, dtype)
    g, beta = ln_params(n, dtype, seed=3)
    b, beta = (b, beta) if with_bias else (None, None)
    res = randn(rows, n, dtype=dtype, seed=51)
    expected, expected_sum = reference.linear_add_layernorm(x, w, b, res, g, beta, 1e-5, True)
    assert_close(OP.linear_add_layernorm(x, w, b, res, g, beta, 1e-5), expected, dtype)
    out, s = OP.linear_add_layernorm_sum(x, w, b, res, g, beta, 1e-5)
    assert_close(out, expected, dtype)
    assert_close(s, expected_sum, dtype)


def test_linear_add_layernorm_large_mean_rows_beat_eager():
    """Residual rows 1234 + 1e-3·randn (a tiny spread on a large mean): the GEMM accumulates
    into the residual shifted by its first element, so the spread survives float32."""
    k, n = 96, 256
    x = randn(64, k, seed=52, scale=1e-3)
    w, b = linear_params(n, k, torch.float32, seed=53)
    b = b * 1e-3
    res = randn(64, n, seed=54, scale=1e-3, offset=1234.0)
    g, beta = torch.ones(n), torch.zeros(n)
    expected, expected_sum = reference.linear_add_layernorm(x, w, b, res, g, beta, 1e-5, True)
    out, s = OP.linear_add_layernorm_sum(x, w, b, res, g, beta, 1e-5)
    ours = max_err(out, expected)
    eager = max_err(F.layer_norm(F.linear(x, w, b) + res, (n,), g, beta, 1e-5), expected)
    assert ours <= 1e-5, ours
    assert eager > 100 * ours, (eager, ours)
    assert max_err(s, expected_sum) <= 1.3e-4  # the sum itself rounds at 1234: half an ulp is 6.1e-5


@pytest.mark.parametrize("block_rows", [1, 7, 64, 4096])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,hidden", [(1, 7, 127), (3, 127, 384), (130, 384, 1023)])
def test_ffn(rows, k, hidden, dtype, approximate, block_rows):
    x = randn(rows, k, dtype=dtype, seed=14)
    w1, b1 = linear_params(hidden, k, dtype)
    w2, b2 = linear_params(k, hidden, dtype, seed=5)
    out = OP.ffn(x, w1, b1, w2, b2, approximate, block_rows)
    assert_close(out, reference.ffn(x, w1, b1, w2, b2, approximate), dtype)


def test_linear_ops_keep_leading_dims():
    x = randn(2, 3, 5, 16, seed=15)
    w, b = linear_params(8, 16, torch.float32)
    w2, b2 = linear_params(16, 8, torch.float32, seed=4)
    assert OP.linear_bias_gelu(x, w, b, "none").shape == (2, 3, 5, 8)
    assert OP.linear_residual(x, w, b, randn(2, 3, 5, 8)).shape == (2, 3, 5, 8)
    g, beta = ln_params(8, torch.float32)
    out, s = OP.linear_add_layernorm_sum(x, w, b, randn(2, 3, 5, 8), g, beta, 1e-5)
    assert out.shape == s.shape == (2, 3, 5, 8)
    assert OP.ffn(x, w, b, w2, b2, "tanh", 4).shape == (2, 3, 5, 16)


# --- attention -------------------------------------------------------------------------

ATTN_SHAPES = [  # (B, H, Hkv, Sq, Sk, D)
    (1, 1, 1, 1, 1, 7),
    (2, 4, 4, 3, 130, 16),
    (1, 8, 2, 130, 130, 32),  # grouped-query
    (2, 6, 1, 7, 127, 64),  # multi-query
]


def _mask(kind: str, b: int, h: int, sq: int, sk: int, dtype: torch.dtype):
    if kind == "none":
        return None
    keep = torch.rand(sq, sk, generator=torch.Generator().manual_seed(16)) > 0.3
    keep[:, 0] = True
    if kind == "bool":
        return keep
    if kind == "bool_b11s":
        return keep[:1].expand(b, 1, 1, sk).contiguous() if b > 0 else keep
    return torch.zeros(sq, sk, dtype=dtype).masked_fill(~keep, float("-inf")) + randn(sq, sk, dtype=dtype, seed=17) * 0.1


@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool_b11s", "float"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_attention(shape, dtype, mask_kind):
    b, h, hkv, sq, sk, d = shape
    q = randn(b, h, sq, d, dtype=dtype, seed=18)
    k, v = randn(b, hkv, sk, d, dtype=dtype, seed=19), randn(b, hkv, sk, d, dtype=dtype, seed=20)
    mask = _mask(mask_kind, b, h, sq, sk, dtype)
    scale = 1 / math.sqrt(d)
    assert_close(OP.attention(q, k, v, mask, scale, False), reference.attention(q, k, v, mask, scale, False), dtype)


@pytest.mark.parametrize("sq,sk", [(7, 7), (3, 130), (130, 127)])
def test_attention_causal(sq, sk):
    q, k, v = randn(1, 4, sq, 16, seed=21), randn(1, 2, sk, 16, seed=22), randn(1, 2, sk, 16, seed=23)
    assert_close(OP.attention(q, k, v, None, 0.3, True), reference.attention(q, k, v, None, 0.3, True), torch.float32)


def test_attention_fully_masked_row_matches_eager_sdpa():
    q, k, v = randn(1, 2, 4, 8, seed=24), randn(1, 2, 5, 8, seed=25), randn(1, 2, 5, 8, seed=26)
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[2] = False
    out = OP.attention(q, k, v, keep, 0.5, False)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.5)
    torch.testing.assert_close(out, eager)
    assert torch.all(out[:, :, 2] == 0)
    assert_close(out, reference.attention(q, k, v, keep, 0.5, False), torch.float32)


# --- one-row decode attention (kernels/cpu/attention.py _decode_at) ---------------------

DECODE_SHAPES = [  # (B, H, Hkv, Sk, D)
    (1, 8, 4, 256, 64),  # Llama-style GQA against a static cache
    (2, 6, 2, 17, 32),
    (3, 4, 4, 1, 8),  # one cached position
    (1, 12, 1, 129, 64),  # multi-query
    (2, 3, 3, 131, 7),  # odd head dim
]


def _decode_mask(kind: str, b: int, h: int, sk: int):
    g = torch.Generator().manual_seed(31)
    if kind == "none":
        return None
    if kind == "bool_b11s":  # HF's [B, 1, 1, S] padding / cache mask
        keep = torch.rand(b, 1, 1, sk, generator=g) > 0.3
        keep[..., 0] = True
        return keep
    if kind == "bool_per_head":  # a different mask per head: groups with partly dropped positions
        keep = torch.rand(b, h, 1, sk, generator=g) > 0.5
        keep[..., 0] = True
        return keep
    if kind == "float_tail":  # additive: a static cache's unwritten tail at -inf, a small bias elsewhere
        m = torch.randn(1, 1, 1, sk, generator=g) * 0.1
        m[..., sk - sk // 3:] = float("-inf")
        m[..., 0] = 0.0
        return m
    return (torch.rand(1, sk, generator=g) > 0.3).logical_or(torch.arange(sk) == 0)  # 2-D [Sq=1, Sk] bool


@pytest.mark.parametrize("mask_kind", ["none", "bool_b11s", "bool_per_head", "float_tail", "bool_2d"])
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_decode_attention_matches_float64_and_takes_the_one_row_kernel(shape, mask_kind, monkeypatch, one_thread):
    from opfuse.kernels.cpu import attention as cpu_attention
    b, h, hkv, sk, d = shape
    q = randn(b, h, 1, d, seed=32)
    k = randn(b, hkv, sk + 3, d, seed=33)[:, :, 1:sk + 1]  # a strided view of a longer cache
    v = randn(b, sk, hkv, d, seed=34).transpose(1, 2)  # [B, Hkv, Sk, D] read through its strides
    mask = _decode_mask(mask_kind, b, h, sk)
    calls = []
    kernel = cpu_attention._decode_at
    monkeypatch.setattr(cpu_attention, "_decode_at", lambda *a: calls.append(1) or kernel(*a))
    out = OP.attention(q, k, v, mask, 0.37, False)
    assert calls, "the one-row decode kernel did not run"
    assert_close(out, reference.attention(q, k, v, mask, 0.37, False), torch.float32)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.37, enable_gqa=hkv != h)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("case", ["fully_masked_bool", "fully_masked_float", "nan_mask", "pos_inf_mask", "nan_q"])
def test_decode_attention_special_rows_match_eager_sdpa(case, one_thread):
    """Fully masked rows give zeros, a NaN or +inf score NaN — what ATen SDPA gives (eager)."""
    q, k, v = randn(2, 4, 1, 16, seed=35), randn(2, 2, 9, 16, seed=36), randn(2, 2, 9, 16, seed=37)
    if case == "fully_masked_bool":
        mask = torch.ones(2, 4, 1, 9, dtype=torch.bool)
        mask[1, 2] = False
    else:
        mask = torch.zeros(2, 4, 1, 9)
        if case == "fully_masked_float":
            mask[0, 3] = float("-inf")
        elif case == "nan_mask":
            mask[1, 1, 0, 4] = float("nan")
        elif case == "pos_inf_mask":
            mask[0, 0, 0, 2] = float("inf")
        else:
            q = q.clone()
            q[1, 0, 0, 5] = float("nan")
    out = OP.attention(q, k, v, mask, 0.25, False)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=2e-6, equal_nan=True)
    assert torch.isnan(out).any() == (case in ("nan_mask", "pos_inf_mask", "nan_q"))


@pytest.mark.parametrize("why", ["causal", "two_rows", "float16"])
def test_decode_kernel_is_not_taken_where_it_does_not_apply(why, monkeypatch, one_thread):
    """Causal, several query rows or another dtype: ATen SDPA runs."""
    from opfuse.kernels.cpu import attention as cpu_attention
    monkeypatch.setattr(cpu_attention, "_decode_at", lambda *a: pytest.fail("decode kernel taken"))
    dtype = torch.float16 if why == "float16" else torch.float32
    sq = 2 if why == "two_rows" else 1
    q, k, v = randn(1, 2, sq, 8, dtype=dtype, seed=38), randn(1, 2, 5, 8, dtype=dtype, seed=39), \
        randn(1, 2, 5, 8, dtype=dtype, seed=40)
    out = OP.attention(q, k, v, None, 0.5, why == "causal")
    assert_close(out, reference.attention(q, k, v, None, 0.5, why == "causal"), dtype)


# --- non-contiguous inputs -------------------------------------------------------------


def test_non_contiguous_inputs():
    base = randn(384, 2, 130, seed=27)
    x = base[:, 0, :].t()  # [130, 384], strided
    r = randn(130, 768, seed=28)[:, ::2]  # [130, 384], stride 2
    w, b = (t.repeat_interleave(2)[::2] for t in ln_params(384, torch.float32))
    assert not (x.is_contiguous() or r.is_contiguous() or w.is_contiguous())
    out, s = OP.add_layernorm_sum(x, r, w, b, 1e-5)
    expected, expected_sum = reference.add_layernorm(x, r, w, b, 1e-5, True)
    assert_close(out, expected, torch.float32)
    assert_close(s, expected_sum, torch.float32)
    assert_close(OP.layernorm_gelu(x, w, b, 1e-5, "tanh"), reference.layernorm_gelu(x, w, b, 1e-5, "tanh"), torch.float32)

    lw = randn(384, 127, seed=29, scale=0.05).t()  # [127, 384] non-contiguous weight
    lb = randn(254, seed=30)[::2]
    assert_close(OP.linear_bias_gelu(x, lw, lb, "none"), reference.linear_bias_gelu(x, lw, lb, "none"), torch.float32)
    res = randn(127, 130, seed=31).t()
    assert_close(OP.linear_residual(x, lw, lb, res), reference.linear_residual(x, lw, lb, res), torch.float32)
    w2 = randn(127, 384, seed=32, scale=0.05).t()  # [384, 127]
    b2 = randn(384, seed=33)
    assert_close(OP.ffn(x, lw, lb, w2, b2, "none", 16), reference.ffn(x, lw, lb, w2, b2, "none"), torch.float32)

    q = randn(1, 16, 2, 8, seed=34).transpose(1, 2)  # [1, 2, 16, 8] non-contiguous
    k = randn(1, 9, 2, 8, seed=35).transpose(1, 2)
    v = randn(1, 9, 2, 8, seed=36).transpose(1, 2)
    assert_close(OP.attention(q, k, v, None, 0.25, False), reference.attention(q, k, v, None, 0.25, False), torch.float32)


# --- validation ------------------------------------------------------------------------


def _bad_calls():
    x, r = randn(3, 8), randn(3, 8)
    w, b = ln_params(8, torch.float32)
    lw, lb = linear_params(4, 8, torch.float32)
    q = randn(1, 4, 3, 8)
    kv = randn(1, 3, 5, 8)
    return [
        ("residual shape", lambda: OP.add_layernorm(x, randn(3, 9), w, b, 1e-5)),
        ("weight shape", lambda: OP.add_layernorm(x, r, randn(9), b, 1e-5)),
        ("bias shape", lambda: OP.layernorm_gelu(x, w, randn(7), 1e-5, "none")),
        ("unsupported dtype", lambda: OP.layernorm_gelu(x.double(), w, b, 1e-5, "none")),
        ("unsupported dtype", lambda: OP.add_layernorm(x.int(), r.int(), w, b, 1e-5)),
        ("approximate", lambda: OP.layernorm_gelu(x, w, b, 1e-5, "sigmoid")),
        ("weight shape", lambda: OP.linear_bias_gelu(x, randn(4, 7), lb, "none")),
        ("bias shape", lambda: OP.linear_bias_gelu(x, lw, randn(5), "none")),
        ("residual shape", lambda: OP.linear_residual(x, lw, lb, randn(3, 5))),
        ("residual shape", lambda: OP.linear_add_layernorm(x, lw, lb, randn(3, 8), w[:4], b[:4], 1e-5)),
        ("ln_weight shape", lambda: OP.linear_add_layernorm(x, lw, lb, randn(3, 4), w, b[:4], 1e-5)),
        ("ln_bias shape", lambda: OP.linear_add_layernorm_sum(x, lw, lb, randn(3, 4), w[:4], b, 1e-5)),
        ("dtype mismatch", lambda: OP.linear_add_layernorm(x, lw, lb, randn(3, 4).half(), w[:4], b[:4], 1e-5)),
        ("w2 shape", lambda: OP.ffn(x, lw, lb, randn(8, 5), b, "none", 4)),
        ("block_rows", lambda: OP.ffn(x, lw, lb, randn(8, 4), b, "none", 0)),
        ("must divide", lambda: OP.attention(q, kv, kv, None, 1.0, False)),
        ("4-D", lambda: OP.attention(q[0], kv[0], kv[0], None, 1.0, False)),
        ("not broadcastable", lambda: OP.attention(q, q, q, torch.ones(2, 3, dtype=torch.bool), 1.0, False)),
        ("mutually exclusive", lambda: OP.attention(q, q, q, torch.ones(3, 3, dtype=torch.bool), 1.0, True)),
        ("device", lambda: lookup("add_layernorm", "cpu")(x.to("meta"), r, w, b, 1e-5, False)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_raises_value_error(case):
    problem, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=problem):
        call()


# --- registry and op registration ------------------------------------------------------


def test_registry_lookup_and_errors():
    assert set(REGISTRY) >= {
        (key, "cpu")
        for key in ("add_layernorm", "layernorm_gelu", "linear_bias_gelu", "linear_residual", "linear_add_layernorm",
                    "ffn", "attention")
    }
    with pytest.raises(NotImplementedError, match="opfuse: no add_layernorm kernel for device cuda"):
        lookup("add_layernorm", "cuda")
    reg = KernelRegistry()

    @reg.register("k", "cpu")
    def k1():
        return 1

    assert reg.lookup("k", "cpu")() == 1 and reg[("k", "cpu")] is k1 and len(reg) == 1
    with pytest.raises(ValueError, match="already registered"):
        reg.register("k", "cpu")(lambda: 2)


def test_schemas_are_exact():
    for name, schema in ops.SCHEMAS.items():
        assert str(getattr(OP, name).default._schema) == f"opfuse::{name}{schema}"


def test_fake_shapes_on_meta():
    m = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16)  # noqa: E731
    assert OP.add_layernorm_sum(m(2, 3, 8), m(2, 3, 8), m(8), None, 1e-5)[1].shape == (2, 3, 8)
    assert OP.linear_bias_gelu(m(2, 3, 8), m(5, 8), m(5), "none").shape == (2, 3, 5)
    out, s = OP.linear_add_layernorm_sum(m(2, 3, 8), m(5, 8), None, m(2, 3, 5), m(5), m(5), 1e-5)
    assert out.shape == s.shape == (2, 3, 5) and s.dtype == torch.bfloat16
    out = OP.ffn(m(2, 3, 8), m(16, 8), m(16), m(6, 16), m(6), "tanh", 4)
    assert out.shape == (2, 3, 6) and out.dtype == torch.bfloat16
    assert OP.attention(m(1, 4, 3, 8), m(1, 2, 5, 8), m(1, 2, 5, 6), None, 0.3, False).shape == (1, 4, 3, 6)


def _opcheck_cases():
    x, r = randn(2, 3, 8, seed=40), randn(2, 3, 8, seed=41)
    w, b = ln_params(8, torch.float32)
    lw, lb = linear_params(4, 8, torch.float32)
    w2, b2 = linear_params(8, 4, torch.float32, seed=7)
    q, k, v = randn(1, 4, 3, 8, seed=42), randn(1, 2, 5, 8, seed=43), randn(1, 2, 5, 8, seed=44)
    keep = torch.rand(3, 5, generator=torch.Generator().manual_seed(0)) > 0.2
    return [
        (OP.add_layernorm, (x, r, w, b, 1e-5)),
        (OP.add_layernorm, (x, r, w, None, 1e-5)),
        (OP.add_layernorm_sum, (x, r, w, b, 1e-5)),
        (OP.layernorm_gelu, (x, w, b, 1e-5, "tanh")),
        (OP.linear_bias_gelu, (x, lw, lb, "none")),
        (OP.linear_residual, (x, lw, lb, randn(2, 3, 4, seed=45))),
        (OP.linear_residual, (x, lw, None, randn(2, 3, 4, seed=45))),
        (OP.linear_add_layernorm, (x, lw, lb, randn(2, 3, 4, seed=46), w[:4], b[:4], 1e-5)),
        (OP.linear_add_layernorm, (x, lw, None, randn(2, 3, 4, seed=46), w[:4], None, 1e-5)),
        (OP.linear_add_layernorm_sum, (x, lw, lb, randn(2, 3, 4, seed=46), w[:4], b[:4], 1e-5)),
        (OP.ffn, (x, lw, lb, w2, b2, "none", 2)),
        (OP.attention, (q, k, v, keep, 0.3, False)),
        (OP.attention, (q, k, v, None, 0.3, True)),
    ]


@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


def test_parameters_requiring_grad_are_accepted_without_grad_mode():
    """Under no_grad (how FusedModule runs) parameters are fine; with grad mode on the ops
    refuse with an error naming the op (they have no backward: never a silently wrong gradient)."""
    x, r = randn(3, 8), randn(3, 8)
    w, b = (torch.nn.Parameter(t) for t in ln_params(8, torch.float32))
    with torch.no_grad():
        out = OP.add_layernorm(x, r, w, b, 1e-5)
    assert_close(out, reference.add_layernorm(x, r, w, b, 1e-5, False)[0], torch.float32)
    lw, lb = (torch.nn.Parameter(t) for t in linear_params(4, 8, torch.float32))
    with torch.no_grad():
        got = OP.linear_bias_gelu(x, lw, lb, "tanh")
    assert_close(got, reference.linear_bias_gelu(x, lw, lb, "tanh"), torch.float32)
    with pytest.raises(RuntimeError, match="opfuse::linear_bias_gelu is inference-only"):
        OP.linear_bias_gelu(x, lw, lb, "tanh")
    assert_close(OP.linear_bias_gelu(x, lw.detach(), lb.detach(), "tanh"),  # grad mode on, nothing requires grad
                 reference.linear_bias_gelu(x, lw, lb, "tanh"), torch.float32)


def test_warm_up_runs():
    ops.warm_up()


# --- hypothesis properties -------------------------------------------------------------

_DIMS = st.sampled_from([1, 2, 3, 5, 7, 13, 31, 64, 97, 127, 128, 257, 384, 509, 1023])
_EPS = st.sampled_from([1e-12, 1e-6, 1e-5, 1e-3, 0.1])
_OFFSETS = st.sampled_from([0.0, 1.0, -37.5, 1e3, -1e4, 1e4])
_SCALES = st.sampled_from([1e-2, 1.0, 30.0])


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 9), n=_DIMS, eps=_EPS, offset=_OFFSETS, scale=_SCALES, seed=st.integers(0, 2**31 - 1))
def test_property_add_layernorm(rows, n, eps, offset, scale, seed):
    x = randn(rows, n, seed=seed, scale=scale, offset=offset)
    r = randn(rows, n, seed=seed + 1, scale=scale)
    w, b = ln_params(n, torch.float32, seed=seed + 2)
    out, s = OP.add_layernorm_sum(x, r, w, b, eps)
    expected, expected_sum = reference.add_layernorm(x, r, w, b, eps, True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(1, 9),
    n=_DIMS,
    eps=_EPS,
    offset=_OFFSETS,
    scale=_SCALES,
    approximate=st.sampled_from(APPROX),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_layernorm_gelu(rows, n, eps, offset, scale, approximate, seed):
    x = randn(rows, n, seed=seed, scale=scale, offset=offset)
    w, b = ln_params(n, torch.float32, seed=seed + 2)
    expected = reference.layernorm_gelu(x, w, b, eps, approximate)
    torch.testing.assert_close(OP.layernorm_gelu(x, w, b, eps, approximate).double(), expected, rtol=1e-5, atol=2e-5)
