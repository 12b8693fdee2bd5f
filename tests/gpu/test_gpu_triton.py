"""Triton kernels on a CUDA device through torch.ops.opfuse (registry dispatch on
``x.device.type``) vs the float64 oracles. Skipped without CUDA + triton; the CPU tier
(tests/cpu/test_triton_interpret.py, test_triton_aot.py) covers the same code without one.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and triton"
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0, offset=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * scale + offset).to(dtype)


def close(actual, expected, dtype, scale=1.0):
    from opfuse.kernels.reference import TOLERANCE

    assert actual.dtype == dtype and actual.device.type == "cuda"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected, rtol=tol["rtol"], atol=tol["atol"] * scale)


@pytest.fixture(scope="module")
def op():
    from opfuse.kernels import ops
    from opfuse.kernels.registry import lookup

    assert ops.TRITON_UNAVAILABLE is None
    assert lookup("attention", "cuda").__module__ == "opfuse.kernels.triton.attention"
    return torch.ops.opfuse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1), (7, 127), (130, 768), (33, 4096), (5, 8191)])
def test_norms(op, rows, n, dtype):
    from opfuse.kernels import reference

    x, r = randn(rows, n, dtype=dtype, seed=1), randn(rows, n, dtype=dtype, seed=2)
    w, b = randn(n, dtype=dtype, seed=3, scale=0.5, offset=1.0), randn(n, dtype=dtype, seed=4)
    out, s = op.add_layernorm_sum(x, r, w, b, 1e-5)
    exp, exp_s = reference.add_layernorm(x, r, w, b, 1e-5, True)
    close(out, exp, dtype)
    close(s, exp_s, dtype)
    for approx in ("none", "tanh"):
        close(op.layernorm_gelu(x, w, None, 1e-5, approx), reference.layernorm_gelu(x, w, None, 1e-5, approx), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (129, 768, 3072), (1000, 3072, 768), (77, 100, 33)])
def test_gemm_epilogues(op, m, k, n, dtype):
    from opfuse.kernels import reference

    x, res = randn(m, k, dtype=dtype, seed=1), randn(m, n, dtype=dtype, seed=2)
    w, b = randn(n, k, dtype=dtype, seed=3, scale=1 / math.sqrt(k)), randn(n, dtype=dtype, seed=4)
    for approx in ("none", "tanh"):
        close(op.linear_bias_gelu(x, w, b, approx), reference.linear_bias_gelu(x, w, b, approx), dtype, 2.0)
    close(op.linear_residual(x, w, b, res), reference.linear_residual(x, w, b, res), dtype, 2.0)
    w2, b2 = randn(k, n, dtype=dtype, seed=5, scale=1 / math.sqrt(n)), randn(k, dtype=dtype, seed=6)
    close(op.ffn(x, w, b, w2, b2, "none", 64), reference.ffn(x, w, b, w2, b2, "none"), dtype, 4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (129, 768, 768), (1000, 3072, 768), (77, 100, 33)])
def test_linear_add_layernorm(op, m, k, n, dtype):
    from opfuse.kernels import reference

    x, res = randn(m, k, dtype=dtype, seed=1), randn(m, n, dtype=dtype, seed=2)
    w, b = randn(n, k, dtype=dtype, seed=3, scale=1 / math.sqrt(k)), randn(n, dtype=dtype, seed=4)
    g, beta = randn(n, dtype=dtype, seed=5, scale=0.5, offset=1.0), randn(n, dtype=dtype, seed=6)
    exp, exp_s = reference.linear_add_layernorm(x, w, b, res, g, beta, 1e-5, True)
    out, s = op.linear_add_layernorm_sum(x, w, b, res, g, beta, 1e-5)
    scale = 1.0 if dtype == torch.float32 else 3.0  # the sum rounds to the I/O dtype before the statistics
    close(out, exp, dtype, scale)
    close(s, exp_s, dtype, 2.0)
    close(op.linear_add_layernorm(x, w, None, res, g, None, 1e-5),
          reference.linear_add_layernorm(x, w, None, res, g, None, 1e-5, False)[0], dtype, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("b,h,hkv,s,d", [(1, 32, 8, 257, 128), (2, 12, 12, 77, 64), (1, 2, 1, 1, 80)])
def test_rope_qk(op, b, h, hkv, s, d, layout, dtype):
    from opfuse.kernels import reference

    q = randn(b, s, h, d, dtype=dtype, seed=1).transpose(1, 2)  # [B, H, S, D] view, as the projection writes it
    k = randn(b, hkv, s, d, dtype=dtype, seed=2)
    angle = randn(1, 1, s, d // 2, seed=3) * 3
    full = torch.cat((angle, angle), -1) if layout == "rotate_half" else angle.repeat_interleave(2, -1)
    cos, sin = full.cos().to(dtype), full.sin().to(dtype)
    oq, ok = op.rope_qk(q, k, cos, sin, layout)
    eq, ek = reference.rope_qk(q, k, cos, sin, layout)
    close(oq, eq, dtype)
    close(ok, ek, dtype)
    close(op.rope(q, cos, sin, layout), eq, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "b,h,hkv,sq,sk,d,mask,causal",
    [(2, 12, 12, 128, 128, 64, "bool", False), (2, 8, 2, 77, 77, 128, None, True), (1, 4, 4, 1, 300, 32, "add", False),
     (2, 4, 4, 257, 129, 80, None, False), (1, 2, 1, 1000, 1000, 128, None, True)],
)
def test_attention(op, b, h, hkv, sq, sk, d, mask, causal, dtype):
    from opfuse.kernels import reference

    q, k, v = randn(b, h, sq, d, dtype=dtype, seed=1), randn(b, hkv, sk, d, dtype=dtype, seed=2), \
        randn(b, hkv, sk, d, dtype=dtype, seed=3)
    m = None
    if mask == "bool":
        m = torch.rand(b, 1, sq, sk, device="cuda") > 0.2
        m[0, 0, 3] = False
    elif mask == "add":
        m = randn(b, 1, sq, sk, dtype=dtype, seed=4)
    sc = 1 / math.sqrt(d)
    close(op.attention(q, k, v, m, sc, causal), reference.attention(q, k, v, m, sc, causal), dtype)


@pytest.mark.parametrize("fill", [float("-inf"), "min", None])
def test_fully_masked_rows_match_sdpa(op, fill):
    q = randn(2, 4, 33, 64, dtype=torch.float16)
    k, v = randn(2, 4, 33, 64, dtype=torch.float16, seed=1), randn(2, 4, 33, 64, dtype=torch.float16, seed=2)
    if fill is None:
        m = torch.ones(33, 33, dtype=torch.bool, device="cuda")
        m[5] = False
    else:
        m = torch.zeros(33, 33, dtype=torch.float16, device="cuda")
        m[5] = torch.finfo(torch.float16).min if fill == "min" else fill
    got = op.attention(q, k, v, m, 0.125, False)
    exp = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.125)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), exp.float().nan_to_num(0.0), rtol=2e-3, atol=2e-3)
