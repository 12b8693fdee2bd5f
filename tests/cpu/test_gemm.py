"""GEMM backend choice (opfuse.gemm): every backend gives eager's values, the graph
structure says which one runs, the measured choice follows the (cached) timings, and
weight updates after optimize are seen through the pre-transposed copies."""

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import gemm
from opfuse.kernels.cpu import _gemm
from opfuse.kernels.reference import linear_bias_gelu as ref_linear_bias_gelu


class _MLP(torch.nn.Module):
    """Two Linear layers (the second without bias) around a tanh: nothing for the pattern
    library to fuse, so the GEMM pass sees plain aten.linear nodes."""

    def __init__(self, k=48, h=80, n=24):
        super().__init__()
        self.fc1 = torch.nn.Linear(k, h)
        self.fc2 = torch.nn.Linear(h, n, bias=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _targets(fused):
    gm = next(iter(fused._plans.values())).gm
    return [n.target for n in gm.graph.nodes if n.op == "call_function"], gm


@pytest.mark.parametrize("mode", ["aten", "wt", "onednn", "packed"])
def test_forced_backend_equals_eager(mode):
    if mode in ("onednn", "packed") and not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not in this torch build")
    model = _MLP().eval()
    x = torch.randn(3, 7, 48)
    fused = opfuse.optimize(model, (x,), gemm=mode)
    with torch.no_grad():
        ref = model.double()(x.double()).float()
        model.float()
        out = fused(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    targets, gm = _targets(fused)
    n_linear = targets.count(torch.ops.aten.linear.default)
    n_onednn = targets.count(torch.ops.mkldnn._linear_pointwise.default)
    folded = [name for name, _ in gm.named_buffers() if name.startswith("opfuse_folded_wt_")]
    choices = fused.report.gemm
    if mode == "aten":
        assert (n_linear, n_onednn, folded, choices) == (2, 0, [], [])
    elif mode == "wt":  # fc2 has no bias: linear(x, t(Wᵀ)) is run as matmul(x, Wᵀ), what linear calls
        assert (n_linear, n_onednn, targets.count(torch.ops.aten.matmul.default)) == (1, 0, 1)
        assert targets.count(torch.ops.aten.t.default) == 1  # fc1's view only
        assert sorted(folded) == ["opfuse_folded_wt_fc1_weight", "opfuse_folded_wt_fc2_weight"]
        assert [c["extra_bytes"] for c in choices] == [80 * 48 * 4, 24 * 80 * 4]
        # the originals are no longer read by the plan
        assert not any("fc1.weight" == str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
    else:
        assert (n_linear, n_onednn, folded) == (0, 2, [])
    if mode != "aten":
        assert [(c["m"], c["k"], c["n"], c["backend"]) for c in choices] == [(21, 48, 80, mode), (21, 80, 24, mode)]


def test_wt_weights_follow_in_place_updates():
    model = _MLP().eval()
    x = torch.randn(4, 48)
    fused = opfuse.optimize(model, (x,), gemm="wt")
    with torch.no_grad():
        model.fc1.weight.mul_(-2.0)
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


def test_auto_choice_follows_timings_with_margin():
    site = gemm.sites()[torch.ops.aten.linear.default]
    args = [torch.randn(64, 32), torch.randn(16, 32), torch.randn(16)]
    cache = {}
    name, times, _ = gemm.choose(site, args, gemm.BACKENDS, cache)  # measures once
    assert set(times) == {"aten", "wt", "onednn", "packed", "blas", "gemv"} and name in times
    (key,) = cache
    assert "linear(64x32:float32, 16x32:float32, 16:float32)" in key
    cache[key] = {"aten": 1.0, "wt": 0.90, "onednn": 0.99, "packed": 0.95}
    assert gemm.choose(site, args, gemm.BACKENDS, cache)[0] == "wt"
    cache[key] = {"aten": 1.0, "wt": 0.985, "onednn": 0.99, "packed": 0.995}
    name, _, reason = gemm.choose(site, args, gemm.BACKENDS, cache)
    assert name == "aten" and "within 3%" in reason


def test_gemm_timings_of_a_busy_machine_are_not_cached(monkeypatch):
    monkeypatch.setattr("opfuse.cost.device.busy", lambda: "load average 3.0 on 2 CPUs")
    site = gemm.sites()[torch.ops.aten.linear.default]
    cache = {}
    name, times, _ = gemm.choose(site, [torch.randn(8, 16), torch.randn(4, 16), None], gemm.BACKENDS, cache)
    assert name in times and cache == {}  # used for this choice, not stored


def test_measure_drops_a_backend_with_wrong_values():
    site = gemm.sites()[torch.ops.aten.linear.default]
    wrong = gemm.GemmBackend("wrong", lambda: True, replace={"linear": lambda x, w, b, a: F.linear(x, w, b) + 1e-2})
    times = gemm.measure(site, [torch.randn(8, 16), torch.randn(4, 16), None], [gemm.BACKENDS[0], wrong])
    assert times["wrong"] == float("inf") and times["aten"] < 1.0


def test_fused_ops_get_their_own_backends():
    """linear_bias_gelu (erf) and linear_residual may run as oneDNN GEMMs with a post-op; the
    tanh GELU form never does (oneDNN's tanh post-op measured slower)."""
    by_target = gemm.sites()
    x, w, b = torch.randn(2, 5, 16), torch.randn(24, 16), torch.randn(24)
    onednn = gemm.BACKENDS[2]
    gelu = by_target[torch.ops.opfuse.linear_bias_gelu.default]
    assert onednn.usable(gelu.kind, [x, w, b, "none"]) and not onednn.usable(gelu.kind, [x, w, b, "tanh"])
    res = by_target[torch.ops.opfuse.linear_residual.default]
    assert onednn.usable(res.kind, [x, w, b, torch.randn(2, 5, 24)])
    assert not onednn.usable(res.kind, [x, w, b, torch.randn(24)])  # broadcast residual: not a post-op operand
    for site, args, ref in [(gelu, [x, w, b, "none"], F.gelu(F.linear(x, w, b))),
                            (res, [x, w, b, torch.ones(2, 5, 24)], F.linear(x, w, b) + 1)]:
        out = onednn.replace[site.kind](*args[:3], args)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert gemm.measure(site, args, gemm.BACKENDS)["onednn"] < float("inf")


def test_cache_file_written_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    model = _MLP().eval()
    x = torch.randn(5, 48)
    fused = opfuse.optimize(model, (x,), gemm="auto")
    path = tmp_path / "gemm_cpu.json"
    assert path.exists() and "linear(5x48:float32, 80x48:float32, 80:float32)" in path.read_text()
    calls = []
    monkeypatch.setattr(gemm, "measure", lambda *a, **k: calls.append(a) or {"aten": 1.0})
    opfuse.optimize(model, (x,), gemm="auto")
    assert calls == []  # second optimize: every shape from the cache
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


def test_not_applied_to_half_precision():
    model = _MLP().eval().to(torch.bfloat16)
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    fused = opfuse.optimize(model, (x,), gemm="wt")
    assert fused.report.gemm == []


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(opfuse.OptimizeError, match="unknown gemm mode 'mkl'"):
        opfuse.optimize(_MLP().eval(), (torch.randn(2, 48),), gemm="mkl")


def test_kernel_takes_transposed_weight_without_copy():
    x = torch.randn(6, 32)
    w = torch.randn(40, 32) * 0.2
    b = torch.randn(40)
    wt_view = w.t().contiguous().t()
    assert _gemm.operand(wt_view).data_ptr() == wt_view.data_ptr()  # BLAS operand as it is
    out = torch.ops.opfuse.linear_bias_gelu(x, wt_view, b, "none")
    ref = ref_linear_bias_gelu(x.double(), w.double(), b.double(), "none")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, F.gelu(F.linear(x, w, b)), rtol=1e-5, atol=1e-5)


def test_every_gemm_op_equals_itself_with_the_transposed_weight():
    """The ``wt`` layout changes strides only: each opfuse op with a GEMM inside gives the
    same values with W and with the [N, K] view of Wᵀ."""
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 24)
    w, b, g, beta = torch.randn(24, 16) * 0.3, torch.randn(24), torch.randn(24), torch.randn(24)
    wt = w.t().contiguous().t()
    ops = torch.ops.opfuse
    calls = [lambda w: ops.linear_bias_gelu(x, w, b, "tanh"), lambda w: ops.linear_residual(x, w, b, r),
             lambda w: ops.linear_add_layernorm(x, w, b, r, g, beta, 1e-5),
             lambda w: ops.linear_add_layernorm_sum(x, w, b, r, g, beta, 1e-5)[1],
             lambda w: ops.swiglu(x, w, 12)]
    for call in calls:
        torch.testing.assert_close(call(wt), call(w), rtol=1e-5, atol=1e-5)


def test_a_backend_that_raises_is_not_chosen():
    site = gemm.sites()[torch.ops.aten.linear.default]

    def refuses(x, w, b, a):
        raise RuntimeError("could not create a primitive descriptor")
    times = gemm.measure(site, [torch.randn(8, 16), torch.randn(4, 16), None],
                         [gemm.BACKENDS[0], gemm.GemmBackend("refuses", lambda: True, replace={"linear": refuses})])
    assert times["refuses"] == float("inf")
    # a [1, N] broadcast bias is a valid F.linear bias but not a oneDNN one
    assert not gemm.BACKENDS[2].usable("linear", [torch.randn(2, 16), torch.randn(4, 16), torch.randn(1, 4)])


@pytest.mark.parametrize("mode", ["wt", "onednn"])
def test_op_sequence_after_is_the_same_whatever_the_gemm_backend(mode):
    """The report's "one block after" line names fused regions by pattern whether their GEMM
    runs through aten.linear or a oneDNN call."""
    from opfuse.models import load
    loaded = load("bert-tiny", batch=2, seq=16)
    base = opfuse.optimize(loaded.model, loaded.args, gemm="aten").report
    other = opfuse.optimize(loaded.model, loaded.args, gemm=mode).report
    assert "[qkv_merge]" in base.ops_after
    assert other.ops_after == base.ops_after


def test_op_sequence_after_names_fused_ops_by_their_pattern():
    """A region run by an opfuse op is named as the report's tables name it (the
    out_proj_residual pattern runs opfuse.linear_residual), once per region."""
    from opfuse.models import load
    loaded = load("bert-tiny", batch=2, seq=16)
    report = opfuse.optimize(loaded.model, loaded.args, gemm="aten", decide="rho").report
    fused = {r.pattern for r in report.regions if r.decision == "fused"}
    names = [n[1:-1] for n in report.ops_after if n.startswith("[")]
    assert names == ["qkv_merge", "attention", "linear_add_layernorm", "ffn", "add_layernorm"]
    assert set(names) <= fused

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(32, 32)

        def forward(self, x, r):
            return self.dense(x) + r

    x, r = torch.randn(4, 64, 32), torch.randn(4, 64, 32)
    model = Residual().eval()
    fused_module = opfuse.optimize(model, (x, r), decide="rho")
    assert fused_module.report.counts() == {"out_proj_residual": 1}
    assert fused_module.report.ops_after == ["[out_proj_residual]"]
    torch.testing.assert_close(fused_module(x, r), model(x, r))


def test_dynamic_plans_choose_a_backend_over_every_size():
    """A backend > SIZE_CAP slower than aten at one size of the plan (a oneDNN prepacked
    weight at one row) is not taken, however fast elsewhere; of the rest the lowest
    geometric mean of the time ratios wins: a backend slightly slower at one row but much
    faster at 16 rows beats one a little faster at both."""
    at128 = {"aten": 1.0, "wt": 0.95, "packed": 0.80}
    at1 = {"aten": 1.0, "wt": 0.90, "packed": 1.30}
    name, times, reason = gemm.combine([("M=128", at128), ("M=1", at1)])
    assert name == "wt" and times["packed@M=1"] == 1.30 and "M=128, M=1" in reason
    name, _, reason = gemm.combine([("M=128", at128), ("M=1", {"aten": 1.0, "wt": 1.2, "packed": 1.3})])
    assert name == "aten" and "without being 10% slower at one" in reason
    assert gemm.combine([("M=128", at128)])[0] == "packed"
    at16 = {"aten": 1.0, "wt": 0.92, "packed": 0.60}
    name, _, reason = gemm.combine([("M=128", at128), ("M=1", {"aten": 1.0, "wt": 0.9, "packed": 1.07}),
                                    ("M=16", at16)])
    assert name == "packed" and "geometric mean" in reason  # (0.8 · 1.07 · 0.6)^(1/3) = 0.80 < wt's 0.92


def test_dynamic_plan_measures_the_smallest_size_too():
    from opfuse.models import load
    loaded = load("bert-tiny", batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic=True, decide="rho")
    assert fused.report.gemm and all(any(k.endswith("@M=1") for k in g["times_s"]) for g in fused.report.gemm)
    tokens = [g for g in fused.report.gemm if g["m"] == 32]  # per token (the pooler's rows are the batch)
    assert tokens and all(any(k.endswith("@M=16") for k in g["times_s"]) for g in tokens)  # a short call: 2 × 8
    for b, s in [(1, 1), (3, 33)]:
        ids = torch.randint(0, 1000, (b, s))
        mask = torch.ones_like(ids)
        with torch.no_grad():
            torch.testing.assert_close(fused(ids, mask).last_hidden_state, loaded.model(ids, mask).last_hidden_state,
                                       rtol=1e-5, atol=1e-5)


def test_forced_gemv_runs_decode_size_linears_on_the_weight_as_it_is(tmp_path):
    """gemm="gemv": linears of ≤ COLD_ROWS rows become opfuse.linear_gemv on the model's own
    weight (no copy), equal to float64 eager within float32 round-off; a 21-row linear is
    not a GEMV site; the plan saves and loads bit for bit."""
    model = _MLP().eval()
    x = torch.randn(1, 3, 48)
    fused = opfuse.optimize(model, (x,), gemm="gemv")
    targets, gm = _targets(fused)
    assert targets.count(torch.ops.opfuse.linear_gemv.default) == 2 and torch.ops.aten.linear.default not in targets
    assert not [b for b, _ in gm.named_buffers() if b.startswith("opfuse_folded_")]
    assert [(c["m"], c["backend"], c["extra_bytes"]) for c in fused.report.gemm] == [(3, "gemv", 0), (3, "gemv", 0)]
    with torch.no_grad():
        ref = model.double()(x.double()).float()
        model.float()
        out = fused(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        back = opfuse.load(opfuse.save(fused, tmp_path / "p"))
        assert torch.equal(back(x), out)
        model.fc1.weight.mul_(-1.0)  # the GEMV reads the parameter itself: never stale
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)
    big = opfuse.optimize(model, (torch.randn(3, 7, 48),), gemm="gemv")
    assert big.report.gemm == [] and torch.ops.opfuse.linear_gemv.default not in _targets(big)[0]


@pytest.mark.parametrize("op, dtype", [("linear_gemv", torch.float32), ("linear_bf16", torch.bfloat16)])
@pytest.mark.parametrize("rows", [1, 5, 8, 9])
def test_weight_stream_kernels_against_float64(op, dtype, rows):
    from opfuse.kernels import reference
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 200, generator=g), torch.randn(33, 200, generator=g).to(dtype), torch.randn(33, generator=g)
    y = getattr(torch.ops.opfuse, op)(x, w, b)
    exact = getattr(reference, op)(x, w, b)
    sums = x.double().abs() @ w.double().abs().T
    tol = 200 * 2.0**-24 * sums + 1e-6 if rows <= 8 or dtype == torch.float32 else \
        2.0**-8 * sums * 1.01 + 2.0**-9 * exact.abs() + 1e-5
    assert y.dtype == torch.float32 and bool(((y.double() - exact).abs() <= tol).all())
    bad = torch.randn(33, 200).to(torch.float16)
    with pytest.raises((ValueError, RuntimeError), match="weight must be a dense contiguous"):
        getattr(torch.ops.opfuse, op)(x, bad, b)


def test_decode_size_measurement_warms_the_code_on_a_weight_copy(monkeypatch):
    """At ≤ COLD_ROWS rows every timed call is preceded by an eviction and one call of the
    same backend on a weight copy (cold weight, warm code); larger GEMMs are timed hot."""
    from opfuse.bench import timing
    evictions = []
    monkeypatch.setattr(timing, "evict_caches", lambda: evictions.append(1))
    site = gemm.sites()[torch.ops.aten.linear.default]
    backends = [be for be in gemm.BACKENDS if be.name in ("aten", "wt", "gemv")]
    x, w, b = torch.randn(1, 64), torch.randn(32, 64), torch.randn(32)
    times = gemm.measure(site, [x, w, b], backends)
    assert set(times) == {"aten", "wt", "gemv"} and all(0 < t < 1 for t in times.values())
    assert len(evictions) == gemm.ROUNDS * 3
    evictions.clear()
    gemm.measure(site, [torch.randn(64, 64), w, b], [be for be in backends if be.name != "gemv"])
    assert evictions == []


def test_lean_mode_measures_only_backends_without_a_weight_copy(monkeypatch):
    """gemm="lean": the measured choice among aten, onednn and gemv, so the plan holds no
    pre-transposed or prepacked copy (the timings are injected: every copying backend
    would win if it were measured); values equal float64 eager."""
    seen = []

    def fake_measure(site, args, backends):
        seen.append({be.name for be in backends})
        return {be.name: (1e-3 if be.copies else 2e-3 if be.name == "onednn" else 4e-3) for be in backends}
    monkeypatch.setattr(gemm, "measure", fake_measure)
    monkeypatch.setattr(gemm, "load_cache", lambda name: {})
    monkeypatch.setattr(gemm, "save_cache", lambda name, cache: None)
    model = _MLP().eval()
    x = torch.randn(3, 7, 48)
    fused = opfuse.optimize(model, (x,), gemm="lean")
    with torch.no_grad():
        ref = model.double()(x.double()).float()
        model.float()
        out = fused(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert seen and all(names <= {"aten", "onednn", "gemv"} and "aten" in names for names in seen)
    choices = fused.report.gemm
    assert [c["backend"] for c in choices] == ["onednn", "onednn"] and [c["extra_bytes"] for c in choices] == [0, 0]
    _, gm = _targets(fused)
    assert not [name for name, _ in gm.named_buffers() if name.startswith("opfuse_folded_")]
    with pytest.raises(opfuse.OptimizeError, match="expected auto, lean"):
        opfuse.optimize(model, (x,), gemm="leaner")


# --- blas: numpy's OpenBLAS on one thread ---------------------------------------------

needs_openblas = pytest.mark.skipif(_gemm.openblas() is None, reason="numpy's BLAS is not OpenBLAS here")


@pytest.mark.parametrize("layout", ["row-major", "padded", "wt"])
@pytest.mark.parametrize("rows, k, n", [(1, 200, 33), (7, 31, 97), (130, 64, 129)])
def test_linear_blas_against_float64(layout, rows, k, n):
    """opfuse.linear_blas on every weight layout it meets (the model's row-major weight,
    the row-padded Wᵀ of the ``blas`` backend, a pre-transposed view), 3-D and strided x,
    with and without bias, within float32 round-off of float64."""
    from opfuse.kernels import reference
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(2, rows, k, generator=g)[:, :, :]
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    weight = {"row-major": w, "padded": _gemm.blas_view(_gemm.blas_layout(w), n), "wt": w.t().contiguous().t()}[layout]
    assert torch.equal(weight, w)
    sums = x.double().abs() @ w.double().abs().T
    for xin, bias in [(x, b), (x.transpose(0, 1).contiguous().transpose(0, 1), None)]:
        y = torch.ops.opfuse.linear_blas(xin, weight, bias)
        exact = reference.linear_blas(xin, w, bias)
        assert y.shape == (2, rows, n) and y.is_contiguous()
        assert bool(((y.double() - exact).abs() <= 2 * k * 2.0**-24 * (sums + 1) + 1e-6).all())
    with pytest.raises((ValueError, RuntimeError), match="weight must be a dense"):
        torch.ops.opfuse.linear_blas(x, w.half(), b)
    with pytest.raises((ValueError, RuntimeError), match="features"):
        torch.ops.opfuse.linear_blas(x[..., :-1], w, b)


@needs_openblas
def test_blas_leaves_numpys_thread_count_as_it_was():
    """The call runs OpenBLAS on one thread and gives numpy back its own setting."""
    ctl = _gemm.openblas()
    before = ctl.get_num_threads()
    seen = []
    real = _gemm.np.matmul

    def spy(*a, **k):
        seen.append(ctl.get_num_threads())
        return real(*a, **k)
    try:
        ctl.set_num_threads(2)
        _gemm.np.matmul = spy
        _gemm.blas_mm(torch.randn(4, 8), torch.randn(5, 8))
        assert seen == [1] and ctl.get_num_threads() == 2
    finally:
        _gemm.np.matmul = real
        ctl.set_num_threads(before)


def test_every_gemm_op_equals_itself_with_the_padded_weight():
    """The ``blas`` layout (row-padded Wᵀ) sends each opfuse op's GEMM to OpenBLAS: the same
    values as with W, and the layout is kept as it is (no copy)."""
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 24)
    w, b, g, beta = torch.randn(24, 16) * 0.3, torch.randn(24), torch.randn(24), torch.randn(24)
    padded = _gemm.blas_view(_gemm.blas_layout(w), 24)
    assert _gemm.is_blas(padded) and not _gemm.is_blas(w) and not _gemm.is_blas(w.t().contiguous().t())
    assert _gemm.operand(padded).data_ptr() == padded.data_ptr()
    ops = torch.ops.opfuse
    calls = [lambda w: ops.linear_bias_gelu(x, w, b, "none"), lambda w: ops.linear_residual(x, w, b, r),
             lambda w: ops.linear_add_layernorm(x, w, b, r, g, beta, 1e-5),
             lambda w: ops.linear_add_layernorm_sum(x, w, b, r, g, beta, 1e-5)[1]]
    for call in calls:
        torch.testing.assert_close(call(padded), call(w), rtol=1e-5, atol=1e-5)
    w2 = torch.randn(48, 16) * 0.3  # swiglu's [2H, K] gate|up weight
    torch.testing.assert_close(ops.swiglu(x, _gemm.blas_view(_gemm.blas_layout(w2), 48), 24), ops.swiglu(x, w2, 24),
                               rtol=1e-5, atol=1e-5)


@needs_openblas
def test_forced_blas_backend_equals_eager_saves_and_follows_weight_updates(tmp_path, one_thread):
    """gemm="blas" at one thread: every linear of a BERT becomes opfuse.linear_blas on a
    row-padded copy (its bytes reported), values equal eager, the plan saves and loads bit
    for bit, and a weight changed after optimize is seen (the copy is derived, rebuilt)."""
    from opfuse.models import load
    loaded = load("bert-tiny", batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, gemm="blas")
    targets, gm = _targets(fused)
    choices = fused.report.gemm
    assert choices and {c["backend"] for c in choices} == {"blas"}
    assert targets.count(torch.ops.opfuse.linear_blas.default) == sum(c["op"] == "linear" for c in choices)
    assert torch.ops.aten.linear.default not in targets
    assert all(c["extra_bytes"] == c["k"] * (c["n"] + _gemm.BLAS_PAD) * 4 for c in choices)
    with torch.no_grad():
        out = fused(*loaded.args).last_hidden_state
        torch.testing.assert_close(out, loaded.model(*loaded.args).last_hidden_state, rtol=1e-5, atol=1e-5)
        back = opfuse.load(opfuse.save(fused, tmp_path / "p"))
        assert torch.equal(back(*loaded.args).last_hidden_state, out)
        loaded.model.encoder.layer[0].attention.self.query.weight.mul_(-1.5)
        torch.testing.assert_close(fused(*loaded.args).last_hidden_state,
                                   loaded.model(*loaded.args).last_hidden_state, rtol=1e-5, atol=1e-5)


def test_blas_is_not_offered_above_one_thread(one_thread):
    """OpenBLAS's own pool next to torch's OpenMP pool slowed later torch ops: at two
    threads the backend is unavailable and a forced gemm="blas" leaves eager's GEMMs."""
    torch.set_num_threads(2)
    blas = next(be for be in gemm.BACKENDS if be.name == "blas")
    assert not blas.available()
    model = _MLP().eval()
    x = torch.randn(3, 7, 48)
    fused = opfuse.optimize(model, (x,), gemm="blas")
    assert fused.report.gemm == [] and torch.ops.opfuse.linear_blas.default not in _targets(fused)[0]
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


def test_blas_streams_one_and_two_row_calls_with_opfuses_gemv(monkeypatch):
    """OpenBLAS's GEMV (and MKL's on the padded operand) measured slower here: at ≤
    BLAS_MIN_ROWS rows blas_mm streams the padded Wᵀ with opfuse's gemv_wt (numpy's matmul
    not called; any K, also not a multiple of its 4-row step), above it OpenBLAS; values
    within float32 round-off of float64 either way. A padded view whose storage does not
    hold the whole [K, ld] buffer is read by ATen's GEMM as it is."""
    from opfuse.kernels.cpu import linear_gemv
    called, streamed = [], []
    real, real_wt = _gemm.np.matmul, linear_gemv.gemv_wt
    monkeypatch.setattr(_gemm.np, "matmul", lambda *a, **k: called.append(1) or real(*a, **k))
    monkeypatch.setattr(linear_gemv, "gemv_wt", lambda *a, **k: streamed.append(1) or real_wt(*a, **k))
    for k in (24, 23):
        w = torch.randn(40, k)
        padded = _gemm.blas_view(_gemm.blas_layout(w), 40)
        for rows in (1, _gemm.BLAS_MIN_ROWS, _gemm.BLAS_MIN_ROWS + 1):
            x = torch.randn(rows, k)
            called.clear(), streamed.clear()
            exact = x.double() @ w.double().T
            y = _gemm.blas_mm(x, padded)
            assert y.shape == (rows, 40) and y.is_contiguous()
            assert float((y.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max()) + 1e-6
            assert bool(streamed) == (rows <= _gemm.BLAS_MIN_ROWS)
            assert bool(called) == (rows > _gemm.BLAS_MIN_ROWS and _gemm.openblas() is not None)
    w = torch.randn(40, 8)
    short = torch.zeros(7 * 56 + 40).as_strided((40, 8), (1, 56))  # the last row of Wᵀ ends at column N
    short.copy_(w)
    streamed.clear()
    x = torch.randn(1, 8)
    torch.testing.assert_close(_gemm.blas_mm(x, short), x @ w.T, rtol=1e-5, atol=1e-5)
    assert not streamed
