"""No silent wrong results from the inputs people bring (reliability items 5–8): layouts a
``view`` needs, empty inputs, mixed dtypes; under ``optimize`` and the compile backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opfuse
import opfuse.backend as backend
from opfuse.kernels import ops as _ops  # noqa: F401
from opfuse.verify import VerificationError

OP = torch.ops.opfuse


def _run(entry, model, args):
    if entry == "optimize":
        return opfuse.optimize(model, args)
    backend.reset()
    return torch.compile(model, backend="opfuse")


def _leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "last_hidden_state"):
        return [out.last_hidden_state]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _equal_to_eager(entry, model, args, tol=1e-4):
    fused = _run(entry, model, args)
    with torch.no_grad():
        outs, refs = _leaves(fused(*args)), _leaves(model(*args))
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype
        if r.numel():
            torch.testing.assert_close(o, r, rtol=tol, atol=tol)
    return fused


# --- 5. contiguous()/clone() before a view -------------------------------------------------


class PermuteContiguousView(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.ln = torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)

    def forward(self, x):  # x [B, H, S, D]
        y = x.permute(0, 2, 1, 3).contiguous().view(x.shape[0], x.shape[2], -1)  # [B, S, H*D]
        z = x.transpose(1, 2).clone(memory_format=torch.contiguous_format).view(x.shape[0], x.shape[2], -1)
        return self.ln(self.lin(y) + z)


def _deberta():
    from transformers import DebertaV2Config, DebertaV2Model
    torch.manual_seed(0)
    cfg = DebertaV2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                          vocab_size=1000, max_position_embeddings=64)
    return DebertaV2Model(cfg).eval(), (torch.randint(0, 1000, (2, 16)),)


def _swin():
    from transformers import SwinConfig, SwinModel
    torch.manual_seed(0)
    cfg = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
    return SwinModel(cfg).eval(), (torch.randn(1, 3, 32, 32),)


@pytest.mark.parametrize("entry", ["optimize", "compile"])
def test_contiguous_before_view_is_kept(entry):
    torch.manual_seed(0)
    fused = _equal_to_eager(entry, PermuteContiguousView().eval(), (torch.randn(2, 4, 8, 8),))
    if entry == "optimize":
        assert fused.report.counts() == {"linear_add_layernorm": 1}


@pytest.mark.parametrize("entry", ["optimize", "compile"])
@pytest.mark.parametrize("family", ["deberta-v2", "swin"])
def test_families_with_contiguous_views_optimize(entry, family):
    model, args = _deberta() if family == "deberta-v2" else _swin()
    fused = _equal_to_eager(entry, model, args)
    if entry == "optimize":
        counts = fused.report.counts()
        assert counts.get("qkv_merge") == 2, counts  # each layer's Q/K/V still fused


# --- 6. empty inputs ------------------------------------------------------------------------


class Mixed(torch.nn.Module):
    """add+LN, linear+add+LN, bias+GELU and SDPA, each of which fuses on non-empty input."""

    def __init__(self):
        super().__init__()
        self.lin, self.ln, self.ln2 = torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.LayerNorm(32)

    def forward(self, x, q, k, v):
        h = self.ln(self.lin(x) + x)
        return self.ln2(h + x), F.gelu(self.lin(h)), F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("entry", ["optimize", "compile"])
@pytest.mark.parametrize("rows,qshape", [((0, 32), (0, 2, 5, 8)), ((2, 0, 32), (2, 2, 0, 8))])
def test_empty_inputs_give_empty_outputs(entry, rows, qshape):
    torch.manual_seed(0)
    args = (torch.randn(*rows), *(torch.randn(*qshape) for _ in range(3)))
    _equal_to_eager(entry, Mixed().eval(), args)


def test_optimized_on_data_then_called_with_empty_batch():
    torch.manual_seed(0)
    model = Mixed().eval()
    fused = opfuse.optimize(model, (torch.randn(4, 32), *(torch.randn(4, 2, 5, 8) for _ in range(3))))
    assert fused.report.counts().get("linear_add_layernorm") == 1
    empty = (torch.randn(0, 32), *(torch.randn(0, 2, 5, 8) for _ in range(3)))
    with torch.no_grad():
        outs = fused(*empty)
    assert [tuple(o.shape) for o in outs] == [(0, 32), (0, 32), (0, 2, 5, 8)]


def _empty_calls():
    x = torch.randn(0, 16)
    w, b, W = torch.randn(16), torch.randn(16), torch.randn(16, 16)
    q, cos = torch.randn(0, 2, 5, 8), torch.randn(1, 5, 8)
    return {
        "add_layernorm": lambda: OP.add_layernorm(x, x, w, b, 1e-5),
        "add_layernorm_sum": lambda: OP.add_layernorm_sum(x, x, w, b, 1e-5),
        "layernorm_gelu": lambda: OP.layernorm_gelu(x, w, b, 1e-5, "none"),
        "linear_bias_gelu": lambda: OP.linear_bias_gelu(x, W, b, "tanh"),
        "linear_residual": lambda: OP.linear_residual(x, W, b, x),
        "linear_add_layernorm": lambda: OP.linear_add_layernorm(x, W, b, x, w, b, 1e-5),
        "linear_add_layernorm_sum": lambda: OP.linear_add_layernorm_sum(x, W, b, x, w, b, 1e-5),
        "ffn": lambda: OP.ffn(x, torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), b, "none", 1),
        "rmsnorm": lambda: OP.rmsnorm(x, w, 1e-6),
        "rmsnorm-N0": lambda: OP.rmsnorm(torch.randn(3, 0), torch.randn(0), 1e-6),
        "add_rmsnorm": lambda: OP.add_rmsnorm(x, x, w, 1e-6),
        "swiglu": lambda: OP.swiglu(x, torch.randn(8, 16), 4),
        "geglu": lambda: OP.geglu(x, torch.randn(8, 16), 4, "tanh"),
        "attention": lambda: OP.attention(q, q, q, None, 0.3, False),
        "rope": lambda: OP.rope(q, cos, cos, "rotate_half"),
        "rope_qk": lambda: OP.rope_qk(q, q, cos, cos, "interleaved"),
    }


@pytest.mark.parametrize("name", list(_empty_calls()))
def test_every_kernel_op_takes_empty_input(name):
    out = _empty_calls()[name]()
    outs = out if isinstance(out, tuple) else (out,)
    assert all(isinstance(o, torch.Tensor) and o.numel() == 0 for o in outs)


def test_attention_with_no_keys_equals_eager():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 0, 8)
    torch.testing.assert_close(OP.attention(q, k, k, None, 8 ** -0.5, False), F.scaled_dot_product_attention(q, k, k))


# --- 7. mixed dtypes --------------------------------------------------------------------------


class Bf16Branch(torch.nn.Module):
    """A bfloat16 branch added to a float32 residual before a LayerNorm (and an RMSNorm)."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(32)
        self.lin = torch.nn.Linear(32, 32).to(torch.bfloat16)
        self.w = torch.nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        s = x + self.lin(x.to(torch.bfloat16))  # float32 + bfloat16 -> float32
        h = self.ln(s)
        t = h + self.lin(h.to(torch.bfloat16))
        return self.w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("kw", [{}, {"verify": False}, {"strict": True}])
def test_mixed_dtype_operands_are_refused_by_legality(kw):
    torch.manual_seed(0)
    model, x = Bf16Branch().eval(), torch.randn(4, 32)
    fused = opfuse.optimize(model, (x,), **kw)  # strict=True: a valid model never raises
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)
    reasons = [r.reason for r in fused.report.regions if r.pattern in ("add_layernorm", "add_rmsnorm")]
    assert reasons and all("dtype mismatch" in r and "illegal" in r for r in reasons), reasons
    assert not any(r.pattern in ("add_layernorm", "add_rmsnorm") for r in fused.report.fused)


def test_mixed_dtypes_under_compile_equal_eager():
    torch.manual_seed(0)
    model, x = Bf16Branch().eval(), torch.randn(4, 32)
    backend.reset()
    compiled = torch.compile(model, backend="opfuse")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert all(not g.fallbacks for g in backend.COMPILED), [g.fallbacks for g in backend.COMPILED]


def test_legality_fake_run_refuses_what_the_kernel_refuses():
    """The fake implementation of every op runs the launchers' argument check."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="dtype mismatch"):
        x = mode.from_tensor(torch.randn(4, 8))
        OP.add_rmsnorm(x, x.to(torch.bfloat16), x[0], 1e-6)
    assert VerificationError  # imported for the strict case above


# --- 8. whole-model capture fails: pieces -------------------------------------------------

_LIB = torch.library.Library("opfuse_test_user", "DEF")  # noqa: TOR901
_LIB.define("scale2(Tensor x) -> Tensor")
_LIB.impl("scale2", lambda x: x * 2, "CPU")  # a user's custom op without a fake implementation


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.ln = torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.ln(self.lin(x) + x)


class DataDependent(torch.nn.Module):
    """Python control flow on a tensor value: torch.export cannot capture it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Block(), _Block()

    def forward(self, x):
        h = self.a(x)
        if x.sum() > 0:
            h = h * 2
        return self.b(h)


class CustomOpNoFake(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Block(), _Block()

    def forward(self, x):
        return self.b(torch.ops.opfuse_test_user.scale2(self.a(x)))


@pytest.mark.parametrize("cls,why", [(DataDependent, "data-dependent"), (CustomOpNoFake, "scale2")])
def test_model_export_cannot_capture_is_fused_in_pieces(cls, why):
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(4, 32)
    fused = opfuse.optimize(model, (x,))
    cap = fused.report.capture
    assert cap["mode"] == "pieces" and cap["pieces"] >= 2 and why in cap["reason"].lower(), cap
    assert fused.report.counts() == {"linear_add_layernorm": 2}  # both blocks fused, in their pieces
    assert fused.report.max_error is not None and fused.report.max_error < 1e-5
    assert "Captured in pieces" in str(fused.report) and fused.report.to_dict()["capture"]["mode"] == "pieces"
    for inp in (x, -x, torch.randn(7, 32)):  # both branches; another shape
        with torch.no_grad():
            torch.testing.assert_close(fused(inp), model(inp), rtol=1e-5, atol=1e-5)


def test_pieces_refused_under_strict_and_capture_whole():
    from opfuse.graph.capture import CaptureError
    model, x = DataDependent().eval(), torch.randn(4, 32)
    for kw in ({"strict": True}, {"capture": "whole"}):
        with pytest.raises(CaptureError, match="could not capture DataDependent"):
            opfuse.optimize(model, (x,), **kw)
    with pytest.raises(opfuse.OptimizeError, match="capture must be"):
        opfuse.optimize(model, (x,), capture="pieces")


def test_whole_model_capture_says_so():
    fused = opfuse.optimize(_Block().eval(), (torch.randn(4, 32),))
    assert fused.report.capture == {"mode": "whole"} and "Captured in pieces" not in str(fused.report)


@pytest.mark.parametrize("cls", [DataDependent, CustomOpNoFake])
def test_uncapturable_model_under_compile_is_fused_in_dynamos_pieces(cls):
    torch.manual_seed(0)
    model = cls().eval()
    backend.reset()
    compiled = torch.compile(model, backend="opfuse")
    for inp in (torch.randn(4, 32), -torch.randn(4, 32)):
        with torch.no_grad():
            torch.testing.assert_close(compiled(inp), model(inp), rtol=1e-5, atol=1e-5)
    counts = [r.pattern for g in backend.COMPILED for rep in g.reports for r in rep.fused]
    assert counts.count("linear_add_layernorm") >= 2, counts  # each block fused in its own piece


class _EagerAttention(torch.nn.Module):
    """softmax(q·kᵀ·s)·v spelled without a mask (three scalings), or SDPA without a mask."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v):
        if self.spelling == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, scale=0.25)
        if self.spelling == "qscaled":
            return ((q * 0.25) @ k.transpose(-1, -2)).softmax(-1) @ v
        scores = q @ k.transpose(-1, -2)
        return (scores * 0.25 if self.spelling == "scaled" else scores).softmax(-1) @ v


@pytest.mark.parametrize("spelling", ["scaled", "qscaled", "unscaled", "sdpa"])
def test_nan_in_one_query_row_without_a_mask_is_eagers(spelling):
    """A NaN in one query element, no mask: eager's softmax(q·kᵀ)·v gives that query row NaN,
    where ATen's CPU flash kernel (the fused op's) returned a zero row on the AVX-512 machines
    (a NaN row on the AVX2 Zen 2 ones); the fused plan gives eager's NaN positions and values
    for every spelling (an SDPA source: what SDPA gives on this CPU)."""
    model = _EagerAttention(spelling).eval()
    q, k, v = (torch.randn(2, 3, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    fused = opfuse.optimize(model, (q, k, v), decide="rho")
    assert fused.report.counts() == {"attention": 1}
    q[1, 2, 5, 7] = float("nan")
    with torch.no_grad():
        out, ref = fused(q, k, v), model(q, k, v)
    assert torch.equal(out.isnan(), ref.isnan())
    assert bool(ref.isnan().any()) or spelling == "sdpa"  # SDPA's own NaN rows depend on the CPU's kernel
    assert torch.allclose(out, ref, equal_nan=True, atol=1e-5, rtol=1e-5)
