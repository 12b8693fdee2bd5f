"""Per pattern: a small module that must fuse (count per pattern asserted) and one that
must NOT (with the reason asserted), each compared with the eager output."""

import math

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse.verify import VerificationError


def fused_and_check(module, *inputs, theta=0.3, atol=1e-4):
    module = module.eval()
    fused = opfuse.optimize(module, inputs, theta=theta)
    with torch.no_grad():
        ref = module(*inputs)
        out = fused(*inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, atol=atol, rtol=1e-4)
    return fused.report


class QKV(torch.nn.Module):
    def __init__(self, e=32, share=True):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(e, e) for _ in range(3))
        self.share = share

    def forward(self, x, y):
        return self.q(x), self.k(x), self.v(x if self.share else y)


def test_qkv_merge_fuses_three_projections():
    x = torch.randn(4, 64, 32)
    report = fused_and_check(QKV(), x, x.clone())
    assert report.counts().get("qkv_merge") == 1
    (region,) = [r for r in report.regions if r.pattern == "qkv_merge"]
    assert len(region.nodes) == 3 and region.rho > 0.3


def test_qkv_merge_not_when_inputs_differ():
    x = torch.randn(4, 64, 32)
    report = fused_and_check(QKV(share=False), x, torch.randn(4, 64, 32))
    assert "qkv_merge" not in report.counts()


class Attention(torch.nn.Module):
    def __init__(self, scale_style="mul", return_probs=False):
        super().__init__()
        self.scale_style, self.return_probs = scale_style, return_probs

    def forward(self, q, k, v, mask):
        d = q.shape[-1]
        if self.scale_style == "div":
            s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
        elif self.scale_style == "q":
            s = torch.matmul(q * d ** -0.5, k.transpose(2, 3))
        else:
            s = torch.matmul(q, k.transpose(-1, -2)) * 0.3
        p = torch.softmax(mask + s, dim=-1)
        out = torch.matmul(torch.nn.functional.dropout(p, 0.1, training=False), v)
        return (out, p) if self.return_probs else out


def _attn_inputs(b=2, h=4, s=64, d=16):
    mask = torch.zeros(b, 1, 1, s)
    mask[1, ..., s // 2:] = torch.finfo(torch.float32).min
    return torch.randn(b, h, s, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d), mask


@pytest.mark.parametrize("style", ["mul", "div", "q"])
def test_attention_eager_spellings_fuse(style):
    report = fused_and_check(Attention(style), *_attn_inputs())
    assert report.counts() == {"attention": 1}
    (region,) = report.fused
    assert region.rho > 0.5  # the S×S scores never leave the kernel


def test_attention_scale_is_read_from_graph_not_defaulted():
    q, k, v, mask = _attn_inputs()
    report = fused_and_check(Attention("mul"), q, k, v, mask)  # scale 0.3 ≠ 1/sqrt(16)
    assert report.counts() == {"attention": 1}


def test_attention_not_fused_when_probs_are_returned():
    report = fused_and_check(Attention(return_probs=True), *_attn_inputs())
    assert "attention" not in report.counts()
    reasons = [nm["reason"] for nm in report.near_misses if nm["pattern"] == "attention"]
    assert any("softmax" in r and "consumer" in r for r in reasons), report.near_misses


class Residual(torch.nn.Module):
    def __init__(self, e=32):
        super().__init__()
        self.dense = torch.nn.Linear(e, e)

    def forward(self, x, r):
        return self.dense(x) + r


def test_out_proj_residual_fuses():
    report = fused_and_check(Residual(), torch.randn(4, 64, 32), torch.randn(4, 64, 32))
    assert report.counts() == {"out_proj_residual": 1}


def test_out_proj_residual_not_with_broadcast_residual():
    report = fused_and_check(Residual(), torch.randn(4, 64, 32), torch.randn(1, 64, 32))
    assert report.counts() == {}
    (region,) = report.regions
    assert region.decision == "rejected" and "broadcast" in region.reason


class AddLN(torch.nn.Module):
    def __init__(self, e=32, eps=1e-6, emit=False, shape=None):
        super().__init__()
        self.ln = torch.nn.LayerNorm(shape or e, eps=eps)
        self.emit = emit

    def forward(self, x, r):
        s = x + r
        y = self.ln(s)
        return (y, s * 2) if self.emit else y


def test_add_layernorm_fuses_with_eps_carried():
    m = AddLN(eps=0.5)  # a large eps: dropping or defaulting it would fail verification
    report = fused_and_check(m, torch.randn(4, 16, 32), torch.randn(4, 16, 32))
    assert report.counts() == {"add_layernorm": 1}


def test_add_layernorm_emits_sum_for_other_consumer():
    x, r = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    # the sum must still be written: only one read of it is saved, ρ = 1/6 < default θ
    report = fused_and_check(AddLN(emit=True), x, r)
    (region,) = report.regions
    assert region.decision == "rejected" and abs(region.rho - 1 / 6) < 0.05 and "θ" in region.reason
    report = fused_and_check(AddLN(emit=True), x, r, theta=0.1)
    assert report.counts() == {"add_layernorm": 1}


def test_add_layernorm_not_over_two_dims():
    m = AddLN(shape=(16, 32))
    report = fused_and_check(m, torch.randn(4, 16, 32), torch.randn(4, 16, 32))
    assert report.counts() == {}
    assert any("last dim" in r.reason for r in report.regions)


@pytest.mark.parametrize("x_shape,r_shape", [((4, 16, 32), (1, 16, 32)), ((1, 16, 32), (4, 16, 32)),
                                             ((4, 16, 32), (16, 32)), ((4, 16, 32), (32,))])
def test_add_layernorm_fuses_with_a_row_broadcast_operand(x_shape, r_shape):
    """Position embeddings [1, S, E] added to [B, S, E] (DistilBERT, ALBERT, CLIP, MiniLM...):
    the kernel expands the residual row-wise; either operand may be the broadcast one."""
    report = fused_and_check(AddLN(), torch.randn(*x_shape), torch.randn(*r_shape))
    assert report.counts() == {"add_layernorm": 1}


@pytest.mark.parametrize("x_shape,r_shape", [((4, 16, 32), (4, 16, 1)), ((4, 1, 32), (1, 16, 32))])
def test_add_layernorm_not_with_broadcast_within_rows_or_both_operands(x_shape, r_shape):
    report = fused_and_check(AddLN(), torch.randn(*x_shape), torch.randn(*r_shape))
    assert report.counts() == {}
    (region,) = report.regions
    assert "broadcast" in region.reason and "add" in region.reason


class LinearAddLN(torch.nn.Module):
    """dense -> + residual -> LayerNorm; ``emit`` also returns the sum (pre-LN: the next residual)."""

    def __init__(self, k=48, n=32, bias=True, emit=False, ln_shape=None, runtime_weight=False):
        super().__init__()
        self.fc = torch.nn.Linear(k, n, bias=bias)
        self.ln = torch.nn.LayerNorm(ln_shape or n)
        self.emit, self.runtime_weight = emit, runtime_weight

    def forward(self, x, r):
        w = self.fc.weight * 1.5 if self.runtime_weight else self.fc.weight
        s = r + F.linear(x, w, self.fc.bias)  # residual first: the add is matched either way round
        y = self.ln(s)
        return (y, s * 2) if self.emit else y


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("emit", [False, True])
def test_linear_add_layernorm_fuses_and_wins_overlaps(bias, emit):
    report = fused_and_check(LinearAddLN(bias=bias, emit=emit), torch.randn(4, 16, 48), torch.randn(4, 16, 32))
    assert report.counts() == {"linear_add_layernorm": 1}
    (region,) = report.fused
    assert len(region.nodes) == 3
    others = {r.pattern: r for r in report.regions if r.decision != "fused"}
    assert "overlaps linear_add_layernorm" in others["out_proj_residual"].reason
    if emit:  # the sum is written too: add_layernorm alone has ρ = 0.2 and fails θ
        assert "θ" in others["add_layernorm"].reason
    else:
        assert "overlaps linear_add_layernorm" in others["add_layernorm"].reason
    assert region.bytes_unfused - region.bytes_fused > max(r.bytes_unfused - r.bytes_fused for r in others.values())


def test_linear_add_layernorm_not_with_runtime_weight():
    report = fused_and_check(LinearAddLN(runtime_weight=True), torch.randn(4, 16, 48), torch.randn(4, 16, 32))
    assert "linear_add_layernorm" not in report.counts()
    (region,) = [r for r in report.regions if r.pattern == "linear_add_layernorm"]
    assert region.decision == "rejected"
    assert "weight-is-parameter" in region.reason and "linear" in region.reason and "mul" in region.reason
    # the add still fuses, with the LN (add_layernorm) or with the linear (out_proj_residual,
    # whose kernel takes a run-time weight and whose epilogue saves more bytes here)
    assert report.counts() == {"out_proj_residual": 1}, report.counts()


def test_linear_add_layernorm_not_over_two_dims():
    m = LinearAddLN(ln_shape=(16, 32))
    report = fused_and_check(m, torch.randn(4, 16, 48), torch.randn(4, 16, 32))
    assert "linear_add_layernorm" not in report.counts() and "add_layernorm" not in report.counts()
    (region,) = [r for r in report.regions if r.pattern == "linear_add_layernorm"]
    assert "last dim" in region.reason and "layer_norm" in region.reason


def test_linear_add_layernorm_not_with_broadcast_residual():
    report = fused_and_check(LinearAddLN(), torch.randn(4, 16, 48), torch.randn(1, 16, 32))
    (region,) = [r for r in report.regions if r.pattern == "linear_add_layernorm"]
    assert region.decision == "rejected" and "equal-shapes" in region.reason and "broadcast" in region.reason


def test_linear_add_layernorm_near_miss_names_the_linear_with_other_consumers():
    class M(LinearAddLN):
        def forward(self, x, r):
            y = self.fc(x)
            return self.ln(y + r), y

    report = fused_and_check(M(), torch.randn(4, 16, 48), torch.randn(4, 16, 32))
    assert "linear_add_layernorm" not in report.counts()
    (nm,) = [nm for nm in report.near_misses if nm["pattern"] == "linear_add_layernorm"]
    assert nm["node"].startswith("linear") and "consumer" in nm["reason"]


class LNGelu(torch.nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.ln = torch.nn.LayerNorm(48)
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(self.ln(x), approximate=self.approximate)


@pytest.mark.parametrize("approximate,variant", [("none", "erf"), ("tanh", "tanh")])
def test_layernorm_gelu_variant_matches_form(approximate, variant):
    report = fused_and_check(LNGelu(approximate), torch.randn(8, 20, 48))
    assert report.counts() == {"layernorm_gelu": 1}
    assert [r.variant for r in report.fused] == [variant]


def test_layernorm_gelu_not_when_ln_output_reused():
    class M(LNGelu):
        def forward(self, x):
            y = self.ln(x)
            return F.gelu(y) + y

    report = fused_and_check(M(), torch.randn(8, 20, 48))
    assert "layernorm_gelu" not in report.counts()
    assert any("layer_norm" in nm["reason"] and "consumer" in nm["reason"] for nm in report.near_misses)


class BiasGelu(torch.nn.Module):
    def __init__(self, approximate="none", bias=True):
        super().__init__()
        self.fc = torch.nn.Linear(32, 64, bias=bias)
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(self.fc(x), approximate=self.approximate)


@pytest.mark.parametrize("approximate,variant", [("none", "erf"), ("tanh", "tanh")])
def test_bias_gelu_variant_matches_form(approximate, variant):
    report = fused_and_check(BiasGelu(approximate), torch.randn(4, 64, 32))
    assert report.counts() == {"bias_gelu": 1}
    assert [r.variant for r in report.fused] == [variant]


def test_bias_gelu_without_bias_takes_a_zero_bias():
    """Was a must-not ("the epilogue kernel expects a bias"); a bias-less linear is the
    same GEMM with a zero bias (folded once), so it fuses (Falcon's MLP)."""
    report = fused_and_check(BiasGelu(bias=False), torch.randn(4, 64, 32))
    assert report.counts() == {"bias_gelu": 1}


class FFN(torch.nn.Module):
    def __init__(self, e=32, h=128):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(e, h), torch.nn.Linear(h, e)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def test_ffn_fuses_and_wins_overlap_with_bias_gelu():
    report = fused_and_check(FFN(), torch.randn(2, 32, 32))
    assert report.counts() == {"ffn": 1}
    (bg,) = [r for r in report.regions if r.pattern == "bias_gelu"]
    assert bg.decision == "rejected" and "overlaps ffn" in bg.reason


def test_theta_rejects_everything_when_high():
    report = fused_and_check(FFN(), torch.randn(2, 32, 32), theta=0.99)
    assert report.counts() == {}
    assert all("θ" in r.reason for r in report.regions)


def test_failed_verification_reverts_and_strict_raises(monkeypatch):
    from opfuse.kernels import registry

    real = registry.lookup("add_layernorm", "cpu")

    def wrong(*a, **k):
        out, s = real(*a, **k)
        return out + 1.0, s

    monkeypatch.setitem(registry.REGISTRY._kernels, ("add_layernorm", "cpu"), wrong)
    x, r = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    report = fused_and_check(AddLN(), x, r)
    (region,) = report.regions
    assert region.decision == "reverted" and "verification failed" in region.reason
    with pytest.raises(VerificationError, match="add_layernorm"):
        opfuse.optimize(AddLN().eval(), (x, r), strict=True)


def test_explain_does_not_rewrite():
    report = opfuse.explain(FFN().eval(), (torch.randn(2, 32, 32),))
    assert report.counts() == {"ffn": 1} and report.verified is False


def test_report_dict_has_api_keys():
    report = fused_and_check(FFN(), torch.randn(2, 32, 32))
    d = report.to_dict()
    import json
    json.dumps(d)
    assert {"regions", "near_misses", "totals"} <= set(d)
    assert {"pattern", "decision", "reason", "nodes", "rho", "bytes_unfused", "bytes_fused", "flops",
            "intensity"} <= set(d["regions"][0])
    assert {"bytes_unfused", "bytes_fused", "fused_regions"} <= set(d["totals"])
    assert d["totals"]["bytes_fused"] < d["totals"]["bytes_unfused"]


def test_other_shapes_reoptimize_not_wrong():
    m = FFN().eval()
    fused = opfuse.optimize(m, (torch.randn(2, 32, 32),))
    for shape in [(1, 7, 32), (3, 129, 32)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), m(x), atol=1e-4, rtol=1e-4)
    assert len(fused.reports) == 3


def test_training_mode_refused():
    with pytest.raises(opfuse.OptimizeError, match="training mode"):
        opfuse.optimize(FFN().train(), (torch.randn(2, 4, 32),))


def test_kernels_leave_torch_thread_count_alone():
    """numba's OpenMP layer would reset torch's OpenMP thread count (shared libgomp)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x = torch.randn(64, 32)
        torch.ops.opfuse.add_layernorm(x, x, torch.ones(32), torch.zeros(32), 1e-5)
        torch.ops.opfuse.layernorm_gelu(x, torch.ones(32), torch.zeros(32), 1e-5, "none")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_gemm_epilogue_rho_excludes_the_gemm_operands():
    """At one row the weight is ~99% of a bias+GELU region's bytes; ρ over all bytes would be
    ~0.015 and the epilogue would never fuse. Epilogue rows measure ρ over the traffic the
    fusion can change: (M_orig − M_fused) / (M_orig − |x| − |W|)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(256, 1024)

        def forward(self, x):
            return F.gelu(self.fc(x))

    report = fused_and_check(M(), torch.randn(1, 2, 256))
    assert report.counts() == {"bias_gelu": 1}
    (r,) = report.regions
    x_w = (2 * 256 + 1024 * 256) * 4
    assert r.rho == pytest.approx((r.bytes_unfused - r.bytes_fused) / (r.bytes_unfused - x_w), abs=1e-6)
    assert r.rho >= 0.3 and (r.bytes_unfused - r.bytes_fused) / r.bytes_unfused < 0.02
    assert "epilogue" in r.reason and "GEMM operands" in r.reason
    # θ still applies to that ρ
    report = fused_and_check(M(), torch.randn(1, 2, 256), theta=0.99)
    assert report.counts() == {} and "epilogue traffic" in report.regions[0].reason
