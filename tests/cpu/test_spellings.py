"""Issue 4's spellings: each must fuse where legal and equal the eager output."""

import math

import pytest
import torch
import torch.nn.functional as F

import opfuse


def optimize_and_compare(module, *inputs, atol=1e-4, theta=0.3):
    module = module.eval()
    fused = opfuse.optimize(module, inputs, theta=theta)
    with torch.no_grad():
        ref, out = module(*inputs), fused(*inputs)
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-4)
    return fused.report


class PackedAttention(torch.nn.Module):
    """GPT-style block: one packed QKV linear split with chunk(3, -1), scale on Q, causal
    mask from a registered tril buffer applied with torch.where, softmax in float32."""

    def __init__(self, e=64, h=4, t_max=32, scale_style="div"):
        super().__init__()
        self.qkv = torch.nn.Linear(e, 3 * e)
        self.h, self.scale_style = h, scale_style
        self.register_buffer("tril", torch.ones(t_max, t_max, dtype=torch.bool).tril())

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k, v = (z.view(b, t, self.h, e // self.h).transpose(1, 2) for z in (q, k, v))
        d = e // self.h
        if self.scale_style == "div":
            s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
        elif self.scale_style == "pow":
            s = torch.matmul(q, k.transpose(-2, -1)) * d ** -0.5
        elif self.scale_style == "mulcall":
            s = torch.matmul(q, k.transpose(-2, -1)).mul(1 / math.sqrt(d))
        else:  # scale applied to Q first
            s = torch.matmul(q * d ** -0.5, k.transpose(-2, -1))
        s = torch.where(self.tril[:t, :t], s, torch.finfo(s.dtype).min)
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        return torch.matmul(p, v).transpose(1, 2).reshape(b, t, e)


@pytest.mark.parametrize("style", ["div", "pow", "mulcall", "q"])
def test_packed_qkv_causal_where_mask_and_scale_spellings(style):
    report = optimize_and_compare(PackedAttention(scale_style=style), torch.randn(2, 32, 64))
    assert report.counts().get("attention") == 1, report.regions


class HandLN(torch.nn.Module):
    def __init__(self, n=48, form="sqrt_div", eps=1e-5):
        super().__init__()
        self.g, self.b = torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n))
        self.form, self.eps = form, eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        if self.form == "sqrt_div":
            s = (x - u).pow(2).mean(-1, keepdim=True)
            return self.g * ((x - u) / torch.sqrt(s + self.eps)) + self.b
        if self.form == "rsqrt":
            d = x - u
            return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + self.eps) * self.g + self.b
        v = x.var(-1, keepdim=True, unbiased=False)
        return (x - u) / torch.sqrt(v + self.eps) * self.g + self.b


@pytest.mark.parametrize("form", ["sqrt_div", "rsqrt", "var"])
def test_layernorm_written_as_primitives_is_respelled(form):
    fused = opfuse.optimize(HandLN(form=form, eps=0.25).eval(), (torch.randn(4, 16, 48),))
    assert fused.report.respelled == {f"layer_norm/{form}": 1}
    x = torch.randn(4, 16, 48)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), fused._model[0](x), atol=1e-5, rtol=1e-5)


class HandGELUStack(torch.nn.Module):
    def __init__(self, form, blocks=12, e=32):
        super().__init__()
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(e, e) for _ in range(blocks))
        self.form = form

    def forward(self, x):
        for fc in self.fcs:
            y = fc(x)
            if self.form == "tanh":
                y = 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))
            elif self.form == "bloom":  # Bloom's bloom_gelu_forward: factored, constant to 8 digits
                y = y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))
            elif self.form == "sigmoid":  # quick GELU (CLIP): a different function, never respelled
                y = y * torch.sigmoid(1.702 * y)
            else:
                y = y * 0.5 * (1.0 + torch.erf(y / math.sqrt(2.0)))
            x = x + y
        return x


@pytest.mark.parametrize("form,variant", [("tanh", "tanh"), ("erf", "erf"), ("bloom", "tanh"), ("sigmoid", None)])
def test_hand_written_gelu_keeps_its_form_over_12_blocks(form, variant):
    report = optimize_and_compare(HandGELUStack(form), torch.randn(8, 64, 32))
    if variant is None:
        assert not report.respelled and "bias_gelu" not in report.counts(), report.counts()
        return
    assert sum(report.respelled.values()) == 12
    assert report.counts().get("bias_gelu") == 12
    assert {r.variant for r in report.fused if r.pattern == "bias_gelu"} == {variant}


def test_add_layernorm_large_mean_tiny_spread():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(256)

        def forward(self, x, r):
            return self.ln(x + r)

    x = 1234 + 1e-3 * torch.randn(64, 256)
    r = 1e-3 * torch.randn(64, 256)
    m = M().eval()
    fused = opfuse.optimize(m, (x, r))
    assert fused.report.counts() == {"add_layernorm": 1}
    with torch.no_grad():
        out = fused(x, r)
    ref = F.layer_norm((x.double() + r.double()), (256,), m.ln.weight.double(), m.ln.bias.double(), 1e-5)
    assert not torch.isnan(out).any()
    assert (out.double() - ref).abs().max() <= 1e-3


def test_attention_fp16_head_dim_256_scale_1_accumulates_in_fp32():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)), dim=-1), v)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 256, generator=g).half() * 40 for _ in range(3))
    fused = opfuse.optimize(M().eval(), (q, k, v), theta=0.0)
    assert fused.report.counts() == {"attention": 1}
    with torch.no_grad():
        out = fused(q, k, v)
    s = q.float() @ k.float().transpose(-2, -1)  # beyond the float16 range
    assert s.abs().max() > 65504
    ref = (torch.softmax(s, -1) @ v.float()).half()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)


def test_other_sequence_lengths_after_optimizing_at_128():
    from opfuse.models import load
    loaded = load("bert-tiny", batch=1, seq=128, attn="sdpa")
    fused = opfuse.optimize(loaded.model, loaded.args)
    for t in (1, 7, 77, 128, 129):
        ids = torch.randint(0, 1000, (1, t))
        mask = torch.ones(1, t, dtype=torch.long)
        with torch.no_grad():
            torch.testing.assert_close(fused(ids, mask).last_hidden_state,
                                       loaded.model(ids, mask).last_hidden_state, atol=1e-4, rtol=1e-4)


class Rope(torch.nn.Module):
    def __init__(self, layout):
        super().__init__()
        self.layout = layout

    def forward(self, x, cos, sin):
        if self.layout == "rotate_half":
            r = torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)
        else:
            r = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * cos + r * sin


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
def test_rope_layouts_each_get_their_own_kernel(layout):
    x = torch.randn(2, 4, 16, 32)
    cos, sin = torch.randn(1, 1, 16, 32), torch.randn(1, 1, 16, 32)
    report = optimize_and_compare(Rope(layout), x, cos, sin, theta=0.0)
    assert report.counts() == {"rope": 1}
    assert [r.variant for r in report.fused] == [layout]


def _rotate(x, layout):
    if layout == "rotate_half":
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class QKRope(torch.nn.Module):
    """``layers`` attention-like blocks, each rotating q and k: with the same cos / sin and
    layout (one region per layer), or with a different layout for k, or other tables for k."""

    def __init__(self, layout, layers=2, k_layout=None, k_tables=False):
        super().__init__()
        self.layout, self.layers = layout, layers
        self.k_layout, self.k_tables = k_layout or layout, k_tables

    def forward(self, x, cos, sin):
        for _ in range(self.layers):
            q, k = (x * 2).transpose(1, 2), (x[:, :, :2] - 1).transpose(1, 2)  # [B, H, S, D], k: 2 heads
            kc, ks = (sin, cos) if self.k_tables else (cos, sin)
            q = q * cos + _rotate(q, self.layout) * sin
            k = k * kc + _rotate(k, self.k_layout) * ks
            x = (q + k.repeat_interleave(2, dim=1)).transpose(1, 2) * 0.5
        return x


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
def test_rope_q_and_k_one_region_per_layer(layout):
    x = torch.randn(2, 16, 4, 32)  # [B, S, H, D]
    cos, sin = torch.randn(1, 1, 16, 32), torch.randn(1, 1, 16, 32)
    report = optimize_and_compare(QKRope(layout, layers=3), x, cos, sin, theta=0.0)
    assert report.counts() == {"rope": 3}
    assert [r.variant for r in report.fused] == [f"qk_{layout}"] * 3
    singles = [r for r in report.regions if r.variant == layout]
    assert len(singles) == 6 and all("overlaps rope" in r.reason for r in singles)


@pytest.mark.parametrize("k_layout,k_tables", [("interleaved", False), ("rotate_half", True)])
def test_rope_q_and_k_not_merged_when_layouts_or_tables_differ(k_layout, k_tables):
    x = torch.randn(2, 16, 4, 32)
    cos, sin = torch.randn(1, 1, 16, 32), torch.randn(1, 1, 16, 32)
    report = optimize_and_compare(QKRope("rotate_half", layers=1, k_layout=k_layout, k_tables=k_tables), x, cos, sin,
                                  theta=0.0)
    assert report.counts() == {"rope": 2}  # the single-tensor rows, each with its own layout
    assert sorted(r.variant for r in report.fused) == sorted(["rotate_half", k_layout])


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, float("-inf")])
def test_where_mask_fully_masked_row_matches_eager(fill):
    """A row whose mask is all False: eager gives the mean of V (finfo.min fill) or NaN (-inf
    fill); the fused attention must give the same, even when the example had no such row."""

    class M(torch.nn.Module):
        def forward(self, q, k, v, keep):
            s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            return torch.matmul(torch.softmax(torch.where(keep, s, fill), -1), v)

    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    m = M().eval()
    fused = opfuse.optimize(m, (q, k, v, keep))
    assert fused.report.counts() == {"attention": 1}
    dead = keep.clone()
    dead[3] = False
    with torch.no_grad():
        ref, out = m(q, k, v, dead), fused(q, k, v, dead)
    assert torch.equal(torch.isnan(ref), torch.isnan(out))
    torch.testing.assert_close(torch.nan_to_num(out), torch.nan_to_num(ref), atol=1e-5, rtol=1e-5)
