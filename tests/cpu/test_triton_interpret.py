"""Triton kernels under TRITON_INTERPRET=1 on CPU tensors vs the float64 oracles.

The interpreter must be switched on before triton is imported, so the cases run in one
fresh subprocess (this file executed as a script with TRITON_INTERPRET=1) that prints one
JSON result per case; each pytest case below asserts its own result. Shapes are tiny and
awkward (rows 1/3/5, widths 1/7/127/1023, head dims 40/24/128, sequence tails, GQA), the
tolerance is reference.TOLERANCE per dtype (the interpreter truncates fp32 -> bf16, which
stays within it). Skipped when triton is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback

import pytest

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _broken_interpreter() -> str:
    """triton 3.6's interpreter turns a runtime loop bound into int(1-element array), which
    numpy >= 2.4 rejects ('only 0-dimensional arrays ...'): every kernel with a K / Sk loop
    fails there (seen with triton 3.6.0 + numpy 2.4; triton 3.9 is fine)."""
    if not HAVE_TRITON:
        return ""
    from importlib.metadata import version

    import numpy

    tv = tuple(int(p) for p in version("triton").split(".")[:2])
    nv = tuple(int(p) for p in numpy.__version__.split(".")[:2])
    return f"triton {version('triton')} interpreter + numpy {numpy.__version__}" if tv < (3, 7) and nv >= (2, 4) else ""
DTYPES = ("float32", "float16", "bfloat16")


def _cases() -> dict:
    """name -> zero-arg function returning (ok, detail); built lazily in the subprocess."""
    import math

    import torch
    import torch.nn.functional as F

    from opfuse.kernels import reference
    from opfuse.kernels.registry import lookup

    def randn(*shape, dtype=torch.float32, seed=0, scale=1.0, offset=0.0):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)

    def close(actual, expected, dtype, tol=None):
        assert actual.dtype == dtype, f"dtype {actual.dtype} != {dtype}"
        assert tuple(actual.shape) == tuple(expected.shape), f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        err = (actual.double() - expected).abs().max().item() if actual.numel() else 0.0
        torch.testing.assert_close(actual.double(), expected, **(tol or reference.TOLERANCE[dtype]))
        return err

    K = lambda key: lookup(key, "cuda")  # noqa: E731  (the Triton launchers, on CPU tensors here)
    cases = {}

    def case(name):
        def deco(fn):
            cases[name] = fn
            return fn
        return deco

    for dname in DTYPES:
        dt = getattr(torch, dname)

        @case(f"add_layernorm-{dname}")
        def _(dt=dt):
            errs = []
            for i, (rows, n) in enumerate([(1, 1), (3, 7), (5, 127), (2, 1023)]):
                x, r = randn(rows, n, dtype=dt, seed=i), randn(rows, n, dtype=dt, seed=i + 10)
                w, b = randn(n, dtype=dt, seed=2, scale=0.5, offset=1.0), randn(n, dtype=dt, seed=3)
                for bias in (b, None):
                    for emit in (True, False):
                        exp, exp_s = reference.add_layernorm(x, r, w, bias, 1e-5, emit)
                        out, s = K("add_layernorm")(x, r, w, bias, 1e-5, emit)
                        errs.append(close(out, exp, dt))
                        assert (s is None) == (not emit)
                        if emit:
                            errs.append(close(s, exp_s, dt))
            return max(errs)

        @case(f"layernorm_gelu-{dname}")
        def _(dt=dt):
            errs = []
            for i, (rows, n) in enumerate([(1, 1), (3, 7), (5, 127), (2, 1023)]):
                x = randn(rows, n, dtype=dt, seed=i, scale=2.0)
                w, b = randn(n, dtype=dt, seed=2, scale=0.5, offset=1.0), randn(n, dtype=dt, seed=3)
                for approx in ("none", "tanh"):
                    for bias in (b, None):
                        errs.append(close(K("layernorm_gelu")(x, w, bias, 1e-5, approx),
                                          reference.layernorm_gelu(x, w, bias, 1e-5, approx), dt))
            return max(errs)

        @case(f"linear_bias_gelu-{dname}")
        def _(dt=dt):
            errs = []
            for i, (m, k, n) in enumerate([(1, 7, 5), (37, 33, 47), (65, 64, 70)]):
                x = randn(m, k, dtype=dt, seed=i)
                w, b = randn(n, k, dtype=dt, seed=i + 1, scale=1 / math.sqrt(k)), randn(n, dtype=dt, seed=i + 2)
                for approx in ("none", "tanh"):
                    errs.append(close(K("linear_bias_gelu")(x, w, b, approx),
                                      reference.linear_bias_gelu(x, w, b, approx), dt))
            x3 = randn(2, 33, 5, dtype=dt, seed=9).transpose(1, 2)  # [2, 5, 33], non-contiguous
            w, b = randn(19, 33, dtype=dt, seed=4, scale=0.2), randn(19, dtype=dt, seed=5)
            errs.append(close(K("linear_bias_gelu")(x3, w, b, "none"), reference.linear_bias_gelu(x3, w, b, "none"), dt))
            return max(errs)

        @case(f"linear_residual-{dname}")
        def _(dt=dt):
            errs = []
            for i, (m, k, n) in enumerate([(1, 7, 5), (37, 33, 47), (3, 80, 70)]):
                x, res = randn(m, k, dtype=dt, seed=i), randn(m, n, dtype=dt, seed=i + 3)
                w, b = randn(n, k, dtype=dt, seed=i + 1, scale=1 / math.sqrt(k)), randn(n, dtype=dt, seed=i + 2)
                for bias in (b, None):
                    errs.append(close(K("linear_residual")(x, w, bias, res),
                                      reference.linear_residual(x, w, bias, res), dt))
            return max(errs)

        @case(f"linear_add_layernorm-{dname}")
        def _(dt=dt):
            errs = []
            tol = reference.TOLERANCE[dt] if dt == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}  # s rounded
            for i, (m, k, n) in enumerate([(1, 7, 5), (37, 33, 47), (3, 80, 127)]):
                x, res = randn(m, k, dtype=dt, seed=i), randn(m, n, dtype=dt, seed=i + 3)
                w, b = randn(n, k, dtype=dt, seed=i + 1, scale=1 / math.sqrt(k)), randn(n, dtype=dt, seed=i + 2)
                g, beta = randn(n, dtype=dt, seed=i + 4, scale=0.5, offset=1.0), randn(n, dtype=dt, seed=i + 5)
                for bias, ln_bias in ((b, beta), (None, None)):
                    for emit in (True, False):
                        exp, exp_s = reference.linear_add_layernorm(x, w, bias, res, g, ln_bias, 1e-5, emit)
                        out, s = K("linear_add_layernorm")(x, w, bias, res, g, ln_bias, 1e-5, emit)
                        errs.append(close(out, exp, dt, tol))
                        assert (s is None) == (not emit)
                        if emit:
                            errs.append(close(s, exp_s, dt))
            x3 = randn(2, 5, 33, dtype=dt, seed=9)  # leading dims kept
            w, r3 = randn(19, 33, dtype=dt, seed=4, scale=0.2), randn(2, 5, 19, dtype=dt, seed=5)
            g = randn(19, dtype=dt, seed=6, offset=1.0)
            out, _ = K("linear_add_layernorm")(x3, w, None, r3, g, None, 1e-5, False)
            errs.append(close(out, reference.linear_add_layernorm(x3, w, None, r3, g, None, 1e-5, False)[0], dt, tol))
            return max(errs)

        @case(f"ffn-{dname}")
        def _(dt=dt):
            x = randn(2, 9, 24, dtype=dt, seed=1)
            w1, b1 = randn(67, 24, dtype=dt, seed=2, scale=0.2), randn(67, dtype=dt, seed=3)
            w2, b2 = randn(24, 67, dtype=dt, seed=4, scale=0.12), randn(24, dtype=dt, seed=5)
            errs = []
            for approx in ("none", "tanh"):
                tol = reference.TOLERANCE[dt] if dt == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}  # h rounded
                errs.append(close(K("ffn")(x, w1, b1, w2, b2, approx, 4),
                                  reference.ffn(x, w1, b1, w2, b2, approx), dt, tol))
            return max(errs)

        @case(f"attention-{dname}")
        def _(dt=dt):
            errs = []
            att = K("attention")
            # GQA (4 query heads on 2 kv heads), D=40 padded to 64, Dv=24, Sq/Sk tails, bool mask
            q, k, v = randn(2, 4, 37, 40, dtype=dt, seed=1), randn(2, 2, 45, 40, dtype=dt, seed=2), \
                randn(2, 2, 45, 24, dtype=dt, seed=3)
            keep = torch.rand(2, 1, 37, 45, generator=torch.Generator().manual_seed(4)) > 0.3
            keep[0, 0, 3] = False  # a fully masked row -> 0, as ATen SDPA
            errs.append(close(att(q, k, v, keep, 0.15, False), reference.attention(q, k, v, keep, 0.15, False), dt))
            add = randn(37, 45, dtype=dt, seed=5)
            add[5] = float("-inf")  # fully masked row
            add[6, 40:] = float("-inf")
            errs.append(close(att(q, k, v, add, 0.15, False), reference.attention(q, k, v, add, 0.15, False), dt))
            errs.append(close(att(q, k, v, None, 0.15, True), reference.attention(q, k, v, None, 0.15, True), dt))
            # head dim 128, causal, Sq > Sk and Sq = 1 / Sk = 1
            for (sq, sk, d, causal) in [(65, 33, 128, True), (1, 1, 32, False), (70, 70, 64, True)]:
                q, k, v = (randn(1, 2, sq, d, dtype=dt, seed=6), randn(1, 2, sk, d, dtype=dt, seed=7),
                           randn(1, 2, sk, d, dtype=dt, seed=8))
                sc = 1 / math.sqrt(d)
                errs.append(close(att(q, k, v, None, sc, causal), reference.attention(q, k, v, None, sc, causal), dt))
            return max(errs)

    def rope_tables(b, s, d, layout, dtype, offset=0):
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        pos = torch.arange(s, dtype=torch.float64)[None, :] + offset + torch.arange(b, dtype=torch.float64)[:, None]
        freqs = pos[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), -1) if layout == "rotate_half" else freqs.repeat_interleave(2, -1)
        return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)

    for dname in DTYPES:
        dt = getattr(torch, dname)

        @case(f"rope-{dname}")
        def _(dt=dt):
            errs = []
            for layout in ("rotate_half", "interleaved"):
                for (b, h, hkv, s, d) in [(2, 4, 2, 7, 64), (1, 3, 1, 5, 40), (1, 1, 1, 1, 2)]:
                    q = randn(b, s, h, d, dtype=dt, seed=1).transpose(1, 2)  # [B, H, S, D] strided view
                    k = randn(b, hkv, s, d, dtype=dt, seed=2)
                    cos, sin = rope_tables(b, s, d, layout, dt, offset=3)
                    errs.append(close(K("rope")(q, cos, sin, layout), reference.rope(q, cos, sin, layout), dt))
                    errs.append(close(K("rope")(k, cos[:1], sin, layout), reference.rope(k, cos[:1], sin, layout), dt))
                    # GPT-J's [B, S, 1, D] tables as the pattern passes them: transposed views [B, 1, S, D]
                    ct, st = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (cos, sin))
                    errs.append(close(K("rope")(q, ct, st, layout), reference.rope(q, cos, sin, layout), dt))
                    oq, ok = K("rope_qk")(q, k, cos[:1, 0], sin, layout)  # [S, D] table broadcast over B
                    eq, ek = reference.rope_qk(q, k, cos[:1, 0], sin, layout)
                    errs += [close(oq, eq, dt), close(ok, ek, dt)]
            return max(errs)

    @case("attention-fully-masked-matches-sdpa")
    def _():
        """-inf / False rows -> 0; finfo.min rows -> uniform average of v: both what ATen SDPA gives."""
        q, k, v = randn(1, 2, 9, 32, seed=1), randn(1, 2, 21, 32, seed=2), randn(1, 2, 21, 32, seed=3)
        errs = []
        for fill in (float("-inf"), torch.finfo(torch.float32).min):
            m = torch.zeros(9, 21)
            m[2] = fill
            m[4, 3:] = fill
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.2)
            errs.append(close(K("attention")(q, k, v, m, 0.2, False), sdpa.double(), torch.float32))
        keep = torch.ones(9, 21, dtype=torch.bool)
        keep[7] = False
        out = K("attention")(q, k, v, keep, 0.2, False)
        errs.append(close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.2).double(),
                          torch.float32))
        assert torch.equal(out[0, :, 7], torch.zeros(2, 32)) and not out.isnan().any()
        return max(errs)

    @case("layernorm-shifted-statistics-mean-1e4")
    def _():
        x = randn(4, 384, seed=1, offset=1e4)
        r = randn(4, 384, seed=2, offset=-3e3)
        w, b = randn(384, seed=3, scale=0.5, offset=1.0), randn(384, seed=4)
        tight = {"rtol": 0.0, "atol": 5e-5}  # naive fp32 statistics are off by ~1e-2 .. 1e3 here
        e1 = close(K("layernorm_gelu")(x, w, b, 1e-5, "none"), reference.layernorm_gelu(x, w, b, 1e-5, "none"),
                   torch.float32, tight)
        e2 = close(K("add_layernorm")(x, r, w, b, 1e-5, False)[0], reference.add_layernorm(x, r, w, b, 1e-5, False)[0],
                   torch.float32, tight)
        return max(e1, e2)

    @case("layernorm-huge-and-non-finite-values")
    def _():
        # rows with one finite value >= 2e19 (its float32 square overflows), and rows with
        # inf / NaN: finite where the float64 oracle is, NaN exactly where it is NaN
        errs = []
        for dt in (torch.float32, torch.bfloat16):
            x, r = randn(6, 96, dtype=dt, seed=5), randn(6, 96, dtype=dt, seed=6)
            x[0, 3], x[1, 50], x[2, 95], x[3, 0] = 3e19, -1e30, 3e38, 3e38
            x[4, 7], x[5, 9] = float("inf"), float("nan")
            w, b = randn(96, dtype=dt, seed=7, scale=0.5, offset=1.0), randn(96, dtype=dt, seed=8)
            got = {"add_layernorm": K("add_layernorm")(x, r, w, b, 1e-5, False)[0],
                   "layernorm_gelu": K("layernorm_gelu")(x, w, b, 1e-5, "none")}
            exp = {"add_layernorm": reference.add_layernorm(x, r, w, b, 1e-5, False)[0],
                   "layernorm_gelu": reference.layernorm_gelu(x, w, b, 1e-5, "none")}
            for key in got:
                assert torch.equal(got[key].isnan(), exp[key].isnan()), (key, dt, got[key].isnan().sum(0))
                assert got[key][:4].isfinite().all(), (key, dt)
                errs.append(close(got[key][:4], exp[key][:4], dt))
        return max(errs)

    @case("add_layernorm-row-broadcast-residual")
    def _():
        x, r = randn(3, 5, 40, seed=11), randn(1, 5, 40, seed=12)  # position embeddings [1, S, E]
        w, b = randn(40, seed=13, scale=0.5, offset=1.0), randn(40, seed=14)
        out, s = K("add_layernorm")(x, r, w, b, 1e-5, True)
        exp, exp_s = reference.add_layernorm(x, r, w, b, 1e-5, True)
        return max(close(out, exp, torch.float32), close(s, exp_s, torch.float32))

    @case("gelu-forms-not-swapped")
    def _():
        x = torch.linspace(-4, 4, 257).reshape(1, 257)
        w, b = torch.ones(257), torch.zeros(257)
        z = reference.layer_norm(x, w, b, 1e-5)
        out = {a: K("layernorm_gelu")(x, w, b, 1e-5, a).double() for a in ("none", "tanh")}
        wf = torch.eye(257)
        lin = {a: K("linear_bias_gelu")(x, wf, torch.zeros(257), a).double() for a in ("none", "tanh")}
        for a, other in (("none", "tanh"), ("tanh", "none")):
            for got, src in ((out[a], z), (lin[a], x.double())):
                own = (got - reference.gelu(src, a)).abs().max().item()
                swapped = (got - reference.gelu(src, other)).abs().max().item()
                assert own < 2e-6 < 1e-4 < swapped, (a, own, swapped)
        return 0.0

    @case("registry-has-cuda-kernels")
    def _():
        from opfuse.kernels.registry import REGISTRY

        keys = {"add_layernorm", "layernorm_gelu", "linear_bias_gelu", "linear_residual", "linear_add_layernorm", "ffn",
                "attention", "rope", "rope_qk"}
        missing = {k for k in keys if (k, "cuda") not in REGISTRY or (k, "cpu") not in REGISTRY}
        assert not missing, missing
        assert REGISTRY[("attention", "cuda")].__module__ == "opfuse.kernels.triton.attention"
        return 0.0

    return cases


CASE_NAMES = [f"{k}-{d}" for k in ("add_layernorm", "layernorm_gelu", "linear_bias_gelu", "linear_residual",
                                   "linear_add_layernorm", "ffn", "attention", "rope") for d in DTYPES] + [
    "attention-fully-masked-matches-sdpa", "layernorm-shifted-statistics-mean-1e4",
    "layernorm-huge-and-non-finite-values", "add_layernorm-row-broadcast-residual", "gelu-forms-not-swapped",
    "registry-has-cuda-kernels"]


def _main() -> None:
    """Subprocess entry: run every case under the interpreter, print one JSON line each."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import opfuse.kernels.ops  # noqa: F401  (CPU kernels + custom ops, as in production)
    import opfuse.kernels.triton  # noqa: F401  (registers the Triton launchers for "cuda")

    cases = _cases()
    assert sorted(cases) == sorted(CASE_NAMES), set(cases) ^ set(CASE_NAMES)
    for name, fn in cases.items():
        t0 = time.perf_counter()
        try:
            err, ok, detail = fn(), True, ""
        except Exception:
            err, ok, detail = None, False, traceback.format_exc(limit=6)
        print("CASE " + json.dumps(dict(name=name, ok=ok, max_err=err, seconds=round(time.perf_counter() - t0, 2),
                                        detail=detail)), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(src), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            r = json.loads(line[5:])
            results[r["name"]] = r
    if not results:
        pytest.fail(f"interpreter subprocess produced no results (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install -e '.[test]')")
@pytest.mark.skipif(bool(_broken_interpreter()), reason=f"known-broken combination: {_broken_interpreter()}")
@pytest.mark.parametrize("name", CASE_NAMES)
def test_triton_kernel_interpreted(interpreted, name):
    r = interpreted.get(name)
    assert r is not None, f"case {name} did not run (subprocess crashed earlier?)"
    assert r["ok"], f"{name} failed under TRITON_INTERPRET=1:\n{r['detail']}"


def test_ops_import_registers_no_cuda_kernels_without_cuda():
    """Importing ops never fails without a GPU; the Triton backend stays unregistered."""
    import torch

    from opfuse.kernels import ops
    from opfuse.kernels.registry import lookup

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert ops.TRITON_UNAVAILABLE
    with pytest.raises(NotImplementedError):
        lookup("attention", "cuda")


if __name__ == "__main__":
    _main()
