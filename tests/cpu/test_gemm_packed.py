"""The ``packed`` GEMM backend: weights prepacked once into oneDNN's blocked layout, every
opfuse op with a GEMM inside running its GEMM on oneDNN and its own epilogue after it.

Each op with a prepacked weight is checked against the float64 oracle
(:mod:`opfuse.kernels.reference`) and against itself on the aten path (row-major and
pre-transposed weights), on M = 1, 7, 129, 512 rows and K, N that are not multiples of 16;
then whole models forced onto the backend, in-place weight updates after optimize, and
save/load (the packed weights are stored dense and packed again at load)."""

import json

import pytest
import torch

import opfuse
from opfuse import gemm
from opfuse.kernels import reference as ref
from opfuse.models import load as load_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")

K, N, H = 37, 53, 29  # none a multiple of 16
ops = torch.ops.opfuse


def _case(m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(m, K), w=r(N, K) * 0.2, b=r(N), res=r(m, N), g=r(N), beta=r(N), wgu=r(2 * H, K) * 0.2,
                w1=r(H, K) * 0.2, b1=r(H), w2=r(N, H) * 0.2, b2=r(N))


# (name, call(c, weights) -> tensor, oracle(c) in float64); ``weights`` maps an operand name to
# its layout under test
CASES = [
    ("linear_bias_gelu erf", lambda c, w: ops.linear_bias_gelu(c["x"], w["w"], c["b"], "none"),
     lambda c: ref.linear_bias_gelu(c["x"], c["w"], c["b"], "none")),
    ("linear_bias_gelu tanh", lambda c, w: ops.linear_bias_gelu(c["x"], w["w"], c["b"], "tanh"),
     lambda c: ref.linear_bias_gelu(c["x"], c["w"], c["b"], "tanh")),
    ("linear_residual", lambda c, w: ops.linear_residual(c["x"], w["w"], c["b"], c["res"]),
     lambda c: ref.linear_residual(c["x"], c["w"], c["b"], c["res"])),
    ("linear_residual no bias", lambda c, w: ops.linear_residual(c["x"], w["w"], None, c["res"]),
     lambda c: ref.linear_residual(c["x"], c["w"], None, c["res"])),
    ("linear_add_layernorm", lambda c, w: ops.linear_add_layernorm(c["x"], w["w"], c["b"], c["res"], c["g"], c["beta"], 1e-5),
     lambda c: ref.linear_add_layernorm(c["x"], c["w"], c["b"], c["res"], c["g"], c["beta"], 1e-5, False)[0]),
    ("linear_add_layernorm_sum, no bias",
     lambda c, w: torch.cat(ops.linear_add_layernorm_sum(c["x"], w["w"], None, c["res"], c["g"], None, 1e-5), -1),
     lambda c: torch.cat(ref.linear_add_layernorm(c["x"], c["w"], None, c["res"], c["g"], None, 1e-5, True), -1)),
    ("swiglu", lambda c, w: ops.swiglu(c["x"], w["wgu"], H), lambda c: ref.swiglu(c["x"], c["wgu"], H)),
    ("geglu tanh", lambda c, w: ops.geglu(c["x"], w["wgu"], H, "tanh"), lambda c: ref.geglu(c["x"], c["wgu"], H, "tanh")),
    ("ffn", lambda c, w: ops.ffn(c["x"], w["w1"], c["b1"], w["w2"], c["b2"], "none", 64),
     lambda c: ref.ffn(c["x"], c["w1"], c["b1"], c["w2"], c["b2"], "none")),
]
WEIGHTS = ("w", "wgu", "w1", "w2")


def _d(c):
    return {k: v.double() for k, v in c.items()}


@pytest.mark.parametrize("m", [1, 7, 129, 512])
@pytest.mark.parametrize("name, call, oracle", CASES, ids=[c[0] for c in CASES])
def test_op_on_packed_weight_equals_oracle_and_aten_path(name, call, oracle, m):
    c = _case(m, seed=m)
    packed = {k: gemm.pack(c[k], m) for k in WEIGHTS}
    assert all(t.is_mkldnn and t.shape == c[k].shape for k, t in packed.items())
    with torch.no_grad():
        out = call(c, packed)
        aten = call(c, {k: c[k] for k in WEIGHTS})
        wt = call(c, {k: c[k].t().contiguous().t() for k in WEIGHTS})
    expect = oracle(_d(c))
    assert out.dtype == torch.float32 and out.shape == expect.shape
    torch.testing.assert_close(out.double(), expect, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out, aten, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(wt, aten, rtol=2e-5, atol=2e-5)


def test_packed_weight_for_other_row_counts_and_3d_inputs():
    """A weight packed for 128 rows serves 1 or 300 rows, and [B, S, K] inputs."""
    c = _case(4)
    pw = gemm.pack(c["w"], 128)
    for x in (torch.randn(1, K), torch.randn(300, K), torch.randn(2, 5, K)):
        out = ops.linear_residual(x, pw, c["b"], torch.zeros(*x.shape[:-1], N))
        torch.testing.assert_close(out.double(), ref.linear(x.double(), c["w"].double(), c["b"].double()),
                                   rtol=2e-5, atol=2e-5)


def _targets(fused):
    gm = next(iter(fused._plans.values())).gm
    return [n.target for n in gm.graph.nodes if n.op == "call_function"], gm


@pytest.mark.parametrize("name, fused_op", [("bert-tiny", "linear_add_layernorm"), ("llama-tiny", "swiglu"),
                                            ("gemma", "geglu")])
def test_model_forced_onto_packed_equals_eager(name, fused_op):
    loaded = load_model(name, batch=2, seq=9)
    fused = opfuse.optimize(loaded.model, loaded.args, example_kwargs=loaded.kwargs, gemm="packed", decide="rho")
    with torch.no_grad():
        out, eager = fused(*loaded.args, **loaded.kwargs), loaded.model(*loaded.args, **loaded.kwargs)
    torch.testing.assert_close(out[0], eager[0], rtol=1e-4, atol=1e-4)
    targets, gm = _targets(fused)
    packed = [b for b, t in gm.named_buffers() if b.startswith("opfuse_folded_packed_")]
    assert packed and all(t.is_mkldnn for b, t in gm.named_buffers() if b in packed)
    assert torch.ops.aten.linear.default not in targets  # every plain linear runs on oneDNN
    choices = fused.report.gemm
    assert choices and {c["backend"] for c in choices} == {"packed"}
    assert fused_op in {c["op"] for c in choices}  # the fused op's GEMM on the packed weight too
    assert sum(c["extra_bytes"] for c in choices) == sum(
        gemm_w.numel() * 4 for b, gemm_w in gm.named_buffers() if b in packed)


def test_packed_weights_follow_in_place_updates():
    loaded = load_model("bert-tiny", batch=2, seq=9)
    model = loaded.model
    fused = opfuse.optimize(model, loaded.args, gemm="packed", decide="rho")
    with torch.no_grad():
        model.encoder.layer[0].attention.output.dense.weight.mul_(-1.5)
        model.encoder.layer[1].intermediate.dense.weight.add_(0.1)
        torch.testing.assert_close(fused(*loaded.args).last_hidden_state, model(*loaded.args).last_hidden_state,
                                   rtol=1e-4, atol=1e-4)
    assert fused.replans and "changed" in fused.replans[-1]


def test_save_load_packs_again(tmp_path):
    loaded = load_model("llama-tiny", batch=1, seq=12)
    fused = opfuse.optimize(loaded.model, loaded.args, gemm="packed", decide="rho")
    opfuse.save(fused, tmp_path / "p")
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    packed = manifest["plans"][0]["packed"]
    assert packed and all(k.startswith("opfuse_folded_packed_") and v == 12 for k, v in packed.items())
    back = opfuse.load(tmp_path / "p")
    gm = next(iter(back._plans.values())).gm
    assert all(t.is_mkldnn for b, t in gm.named_buffers() if b in packed)
    with torch.no_grad():
        assert torch.equal(back(*loaded.args).last_hidden_state, fused(*loaded.args).last_hidden_state)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.update({"embed_tokens_weight": 1}), "not a prepacked weight of opfuse"),
    (lambda p: p.update({next(iter(p)): 0}), "not a float32"),
    (lambda p: p.update({"opfuse_folded_packed_nowhere": 4}), "not a float32"),
])
def test_edited_packed_entries_are_refused(tmp_path, edit, message):
    loaded = load_model("llama-tiny", batch=1, seq=12)
    fused = opfuse.optimize(loaded.model, loaded.args, gemm="packed", decide="rho")
    opfuse.save(fused, tmp_path / "p")
    path = tmp_path / "p" / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest["plans"][0]["packed"])
    path.write_text(json.dumps(manifest))
    with pytest.raises(opfuse.LoadError, match=message):
        opfuse.load(tmp_path / "p")


def test_half_precision_weights_are_never_packed():
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 8)).eval()
    for dtype in (torch.bfloat16, torch.float16):
        m = model.to(dtype)
        x = torch.randn(4, 16, dtype=dtype)
        fused = opfuse.optimize(m, (x,), gemm="packed")
        assert fused.report.gemm == []
        with torch.no_grad():
            out, eager = fused(x).double(), m(x).double()
            exact = model.double()(x.double())
            model.to(dtype)
        # the fused epilogue computes in float32 and rounds once: no worse than eager's own error
        assert (out - exact).abs().max() <= 2 * (eager - exact).abs().max() + 1e-3
