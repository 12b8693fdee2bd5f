"""Architectures of issue #14: Falcon (multi-query attention through SDPA's broadcasting of
one K/V head, the in-place ``/=`` scale of its eager attention), each vs the eager model,
with fused counts; and a must-not: an SDPA call whose K/V heads neither equal nor broadcast
to the query heads is never taken (SDPA itself raises on it)."""

from __future__ import annotations

import pytest
import torch

import opfuse


def _falcon(attn: str):
    import transformers as T
    torch.manual_seed(0)
    cfg = T.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=500,
                         new_decoder_architecture=False, multi_query=True, use_cache=False, attn_implementation=attn)
    return T.FalconModel(cfg).eval()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_falcon_multi_query_attention_fuses(attn):
    model = _falcon(attn)
    ids = torch.randint(0, 500, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    fused = opfuse.optimize(model, (ids,), example_kwargs={"attention_mask": mask})
    counts = fused.report.counts()
    assert counts.get("attention") == 2, counts  # 4 query heads, 1 K/V head
    assert counts.get("rope") == 2, counts
    with torch.no_grad():
        got = fused(ids, attention_mask=mask).last_hidden_state
        want = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Falcon's Linear is ``x @ self.weight.T``: respelled to aten.linear (4 per layer), so the
    # GEMM patterns apply — its bias-less MLP (Linear → GELU → Linear) fuses as an FFN with
    # zero biases
    assert fused.report.respelled.get("linear/matmul_T") == 8, fused.report.respelled
    assert counts.get("ffn") == 2, counts


class _Matmuls(torch.nn.Module):
    """x @ W.t() (a linear), v @ W.t() with a 1-D v, and x @ B.permute(0, 2, 1) with a
    batched B (a bmm, not a linear)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 8))
        self.b = torch.nn.Parameter(torch.randn(3, 16, 8))

    def forward(self, x, v):
        return torch.matmul(x, self.w.t()), torch.matmul(v, self.w.t()), torch.matmul(x, self.b.permute(0, 2, 1))


def test_matmul_with_transposed_weight_is_linear_only_for_a_2d_weight_and_x():
    model = _Matmuls().eval()
    x, v = torch.randn(3, 4, 8), torch.randn(8)
    fused = opfuse.optimize(model, (x, v))
    assert fused.report.respelled == {"linear/matmul_t": 1}, fused.report.respelled  # not the 1-D v, not the bmm
    with torch.no_grad():
        for got, want in zip(fused(x, v), model(x, v)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sdpa_with_non_broadcasting_kv_heads_is_refused():
    from opfuse.patterns.attention import check

    class _Match:  # the legality check on shapes alone: q 4 heads, k/v 2 heads, enable_gqa=False
        def __init__(self, hkv):
            from torch._subclasses.fake_tensor import FakeTensorMode
            with FakeTensorMode():
                vals = {"q": torch.empty(1, 4, 8, 16), "k": torch.empty(1, hkv, 8, 16),
                        "v": torch.empty(1, hkv, 8, 16)}
            g = torch.fx.Graph()
            self.inputs = {}
            for name, v in vals.items():
                node = g.placeholder(name)
                node.meta["val"] = v
                self.inputs[name] = node
            self.literals = {"enable_gqa": False, "scale": 0.25}
            self.params = {}
            self.pattern = next(p for p in __import__("opfuse.patterns.attention", fromlist=["PATTERNS"]).PATTERNS
                                if p.variant == "sdpa")
            self.region = []

    assert "enable_gqa=False" in (check(_Match(2)) or "")
    assert check(_Match(1)) is None  # one K/V head broadcasts: multi-query attention


class _PackedMLP(torch.nn.Module):
    """gate_up_proj [2H, K] + chunk(2, -1); ``act`` on the half ``act_on`` (0: gate, Phi-3)."""

    def __init__(self, act, act_on: int = 0):
        super().__init__()
        self.gate_up = torch.nn.Linear(16, 64, bias=False)
        self.act, self.act_on = act, act_on

    def forward(self, x):
        halves = self.gate_up(x).chunk(2, dim=-1)
        return halves[1 - self.act_on] * self.act(halves[self.act_on])


def test_phi3_packed_gate_up_swiglu_fuses():
    import transformers as T
    torch.manual_seed(0)
    cfg = T.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=500, use_cache=False, pad_token_id=0, eos_token_id=2,
                       bos_token_id=1)
    model = T.Phi3Model(cfg).eval()
    ids = torch.randint(0, 500, (2, 12))
    fused = opfuse.optimize(model, (ids,))
    swiglu = [r for r in fused.report.fused if r.pattern == "swiglu"]
    assert [r.variant for r in swiglu] == ["packed_chunk"] * 2, fused.report.counts()
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).last_hidden_state, model(ids).last_hidden_state, rtol=1e-4, atol=1e-4)


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


@pytest.mark.parametrize("act, act_on, fuses", [
    (torch.nn.functional.silu, 0, {"swiglu": "packed_chunk"}),
    (torch.nn.functional.silu, 1, {}),                                  # SiLU on the up half
    (torch.nn.functional.gelu, 0, {"geglu": "packed_chunk_erf"}),       # GeGLU, never taken for SwiGLU
    (_gelu_tanh, 0, {"geglu": "packed_chunk_tanh"}),                    # tanh GELU: its own row
    (torch.nn.functional.gelu, 1, {}),                                  # GELU on the up half
])
def test_packed_gate_up_rows(act, act_on, fuses):
    model = _PackedMLP(act, act_on).eval()
    x = torch.randn(2, 5, 16)
    fused = opfuse.optimize(model, (x,))
    got = {r.pattern: r.variant for r in fused.report.fused if r.pattern in ("swiglu", "geglu")}
    assert got == fuses, fused.report.counts()
    with torch.no_grad():
        out, want = fused(x), model(x)
    torch.testing.assert_close(out, want)
    x64 = x.double()
    halves = torch.nn.functional.linear(x64, model.gate_up.weight.double()).chunk(2, -1)
    torch.testing.assert_close(out.double(), halves[1 - act_on] * act(halves[act_on]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, variant", [("gemma", "tanh"), ("t5-encoder", "tanh"), ("modernbert", "packed_chunk_erf")])
def test_gated_gelu_mlps_fuse(name, variant):
    """GeGLU MLPs: Gemma (gelu_pytorch_tanh), T5 v1.1 gated-gelu (HF's hand-written tanh
    GELU, respelled), ModernBERT (packed Wi + chunk, erf GELU) — one geglu per layer."""
    from opfuse import zoo
    arch = zoo.BY_NAME[name]
    model = arch.build("eager")
    args, kwargs = arch.inputs(model, 2, 12)
    fused = opfuse.optimize(model, args, example_kwargs=kwargs)
    assert [r.variant for r in fused.report.fused if r.pattern == "geglu"] == [variant] * 2, fused.report.counts()
    assert "swiglu" not in fused.report.counts()
    with torch.no_grad():
        torch.testing.assert_close(fused(*args, **kwargs)[0], model(*args, **kwargs)[0], rtol=1e-4, atol=1e-4)


def test_gptj_rope_in_bshd_layout_with_partial_rotary_fuses():
    """GPT-J rotates every two of the first ``rotary_dim`` features of q and k laid out
    [B, S, H, D], with tables [1, S, 1, D] (it was refused with the head count called S)."""
    import transformers as T
    torch.manual_seed(0)
    cfg = T.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=500, n_positions=128,
                       use_cache=False, bos_token_id=1, eos_token_id=2)
    model = T.GPTJModel(cfg).eval()
    ids = torch.randint(0, 500, (2, 12))
    fused = opfuse.optimize(model, (ids,))
    rope = [r for r in fused.report.fused if r.pattern == "rope"]
    assert len(rope) == 4 and {r.variant for r in rope} == {"interleaved"}, fused.report.counts()
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).last_hidden_state, model(ids).last_hidden_state, rtol=1e-4, atol=1e-4)


class _Rope(torch.nn.Module):
    """rotate-half RoPE of x with given cos / sin tables (shapes chosen by the test)."""

    def forward(self, x, cos, sin):
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin


@pytest.mark.parametrize("x_shape, table_shape, fuses", [
    ((2, 6, 3, 8), (1, 6, 1, 8), True),    # [B, S, H, D] with [1, S, 1, D] tables
    ((2, 3, 6, 8), (1, 1, 6, 8), True),    # [B, H, S, D] with [1, 1, S, D] tables
    ((2, 3, 6, 8), (1, 3, 6, 8), False),   # a table per head: neither layout
])
def test_rope_layouts(x_shape, table_shape, fuses):
    x = torch.randn(x_shape)
    cos, sin = torch.randn(table_shape), torch.randn(table_shape)
    fused = opfuse.optimize(_Rope().eval(), (x, cos, sin))
    assert ("rope" in fused.report.counts()) == fuses, [r.reason for r in fused.report.regions]
    if not fuses:
        (region,) = [r for r in fused.report.regions if r.pattern == "rope"]
        assert "x as [B, H, S, D] (S = 6)" in region.reason and "x as [B, S, H, D] (S = 3)" in region.reason
    with torch.no_grad():
        out = fused(x, cos, sin)
    x64, c64, s64 = x.double(), cos.double(), sin.double()
    want = x64 * c64 + torch.cat((-x64[..., 4:], x64[..., :4]), -1) * s64
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_t5_relative_position_bias_attention_fuses():
    """T5 adds its relative position bias (the padding mask folded in) to unscaled scores,
    in place (``scores += position_bias``): functionalised at capture, the eager spelling
    with an additive float mask fuses (it was a near miss "expected mul but found add")."""
    import transformers as T
    torch.manual_seed(0)
    cfg = T.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=500,
                     feed_forward_proj="gated-gelu")
    model = T.T5EncoderModel(cfg).eval()
    ids = torch.randint(0, 500, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    fused = opfuse.optimize(model, (ids,), example_kwargs={"attention_mask": mask})
    assert fused.report.counts().get("attention") == 2, fused.report.counts()
    with torch.no_grad():
        got = fused(ids, attention_mask=mask).last_hidden_state
        want = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_t5_position_bias_then_mask_fuses_in_both_implementations(attn):
    """T5's eager attention adds the position bias and then the mask to the scores (scale
    1.0): the two-term row sums them into one additive mask."""
    from opfuse import zoo
    arch = zoo.BY_NAME["t5-encoder"]
    model = arch.build(attn)
    args, kwargs = arch.inputs(model, 2, 12)
    fused = opfuse.optimize(model, args, example_kwargs=kwargs)
    variants = [r.variant for r in fused.report.fused if r.pattern == "attention"]
    assert len(variants) == 2 and (attn == "sdpa" or set(variants) == {"eager_scaled_bias"}), variants
    with torch.no_grad():
        torch.testing.assert_close(fused(*args, **kwargs)[0], model(*args, **kwargs)[0], rtol=1e-4, atol=1e-4)


def test_bloom_alibi_attention_on_3d_bmm_fuses():
    """Bloom: ALiBi bias.baddbmm(q, kᵀ) on [B·H, S, D], + the padding/causal mask, softmax,
    bmm with v — one fused attention per layer, equal to eager (left-padded batch)."""
    from opfuse import zoo
    arch = zoo.BY_NAME["bloom"]
    model = arch.build("eager")
    args, kwargs = arch.inputs(model, 2, 12)
    fused = opfuse.optimize(model, args, example_kwargs=kwargs)
    assert [r.variant for r in fused.report.fused if r.pattern == "attention"] == ["bmm_alibi"] * 2
    with torch.no_grad():
        torch.testing.assert_close(fused(*args, **kwargs)[0], model(*args, **kwargs)[0], rtol=1e-4, atol=1e-4)


class _Bmm3d(torch.nn.Module):
    """Attention on [B·H, S, D] with an additive bias through baddbmm (Bloom's spelling)."""

    def __init__(self, heads, beta):
        super().__init__()
        self.heads, self.beta = heads, beta

    def forward(self, q, k, v, bias, mask):
        bh, s, _ = q.shape
        scores = bias.baddbmm(q, k.transpose(-1, -2), beta=self.beta, alpha=0.25)
        probs = torch.softmax(scores.view(bh // self.heads, self.heads, s, -1) + mask, dim=-1)
        return torch.bmm(probs.view(bh, s, -1), v)


@pytest.mark.parametrize("bias_shape, beta, fuses", [
    ((6, 1, 24), 1.0, True),    # ALiBi: one row per (batch, head)
    ((6, 24, 24), 0.5, True),   # a bias per query row, scaled by beta
    ((1, 1, 24), 1.0, True),    # one bias for every batch and head
    ((24, 24), 1.0, False),     # a 2-D bias: refused (the kernel path takes [B·H or 1, 1 or Sq, Sk])
])
def test_bmm_attention_bias_shapes(bias_shape, beta, fuses):
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 24, 8), torch.randn(6, 24, 8), torch.randn(6, 24, 8)  # B=2, H=3, S=24
    bias, mask = torch.randn(bias_shape), torch.zeros(2, 1, 24, 24)
    mask[0, :, :, 20:] = torch.finfo(torch.float32).min
    model = _Bmm3d(3, beta).eval()
    fused = opfuse.optimize(model, (q, k, v, bias, mask))
    assert ("attention" in fused.report.counts()) == fuses, [(r.pattern, r.reason) for r in fused.report.regions]
    if not fuses:
        (region,) = [r for r in fused.report.regions if r.pattern == "attention"]
        assert "bias" in region.reason and "[24, 24]" in region.reason, region.reason
    with torch.no_grad():
        out = fused(q, k, v, bias, mask)
    q64, k64, v64, b64, m64 = (t.double() for t in (q, k, v, bias, mask))
    scores = beta * b64 + 0.25 * q64 @ k64.transpose(-1, -2)
    want = torch.softmax(scores.view(2, 3, 24, 24) + m64, -1).view(6, 24, 24) @ v64
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


class _TwoTerms(torch.nn.Module):
    """Scores + a position bias + a mask; ``bool_bias`` adds a bool tensor (0/1), which no
    attention kernel reads as an additive bias."""

    def __init__(self, bool_bias):
        super().__init__()
        self.bool_bias = bool_bias

    def forward(self, q, k, v, bias, mask):
        if self.bool_bias:
            bias = bias > 0
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25 + bias + mask, -1), v)


@pytest.mark.parametrize("bool_bias", [False, True])
def test_two_additive_terms(bool_bias):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    bias, mask = torch.randn(1, 3, 5, 5), torch.zeros(2, 1, 1, 5)
    mask[1, ..., 4:] = -1e9
    model = _TwoTerms(bool_bias).eval()
    fused = opfuse.optimize(model, (q, k, v, bias, mask))
    assert ("attention" in fused.report.counts()) == (not bool_bias), fused.report.counts()
    with torch.no_grad():
        out = fused(q, k, v, bias, mask)
    b = (bias > 0).double() if bool_bias else bias.double()
    want = torch.softmax(q.double() @ k.double().transpose(-2, -1) * 0.25 + b + mask.double(), -1) @ v.double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


class _QKV(torch.nn.Module):
    """Three projections of one x; ``biases`` says which have a bias (Whisper: q and v)."""

    def __init__(self, biases):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(32, 32, bias=b) for b in biases)

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


@pytest.mark.parametrize("biases", [(True, False, True), (False, False, True), (True, True, True)])
def test_qkv_merge_with_missing_biases(biases):
    """A projection without a bias contributes zeros to the merged bias (folded once); the
    weights changed after optimize still give the new answer."""
    torch.manual_seed(0)
    model = _QKV(biases).eval()
    x = torch.randn(4, 24, 32)
    fused = opfuse.optimize(model, (x,))
    assert fused.report.counts().get("qkv_merge") == 1, [(r.pattern, r.reason) for r in fused.report.regions]

    def want():
        x64 = x.double()
        return [torch.nn.functional.linear(x64, m.weight.double(), None if m.bias is None else m.bias.double())
                for m in (model.q, model.k, model.v)]
    with torch.no_grad():
        for got, ref in zip(fused(x), want()):
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        model.v.weight.mul_(2.0)
        for got, ref in zip(fused(x), want()):
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_whisper_encoder_qkv_merges_without_a_key_bias():
    from opfuse import zoo
    arch = zoo.BY_NAME["whisper-encoder"]
    model = arch.build("eager")
    args, kwargs = arch.inputs(model, 2, 0)
    fused = opfuse.optimize(model, args, example_kwargs=kwargs)
    assert fused.report.counts().get("qkv_merge") == 2, fused.report.counts()
    with torch.no_grad():
        torch.testing.assert_close(fused(*args)[0], model(*args)[0], rtol=1e-4, atol=1e-4)


class _SplitMLP(torch.nn.Module):
    """gate_up_proj + ``split(piece, -1)``: two halves (SwiGLU) or four quarters (not)."""

    def __init__(self, piece):
        super().__init__()
        self.gate_up = torch.nn.Linear(16, 64, bias=False)
        self.piece = piece

    def forward(self, x):
        parts = self.gate_up(x).split(self.piece, dim=-1)
        return parts[1] * torch.nn.functional.silu(parts[0])


@pytest.mark.parametrize("piece, fuses", [(32, True), (16, False)])
def test_split_into_halves_is_chunk(piece, fuses):
    """torch.export's decompositions (a model with a KV cache: Phi-3 with use_cache=True)
    turn ``chunk(2, -1)`` into ``split``; canonicalised back, the packed SwiGLU row matches
    — only when the pieces are the two halves."""
    torch.manual_seed(0)
    model = _SplitMLP(piece).eval()
    x = torch.randn(2, 5, 16)
    fused = opfuse.optimize(model, (x,))
    assert ("swiglu" in fused.report.counts()) == fuses, fused.report.counts()
    with torch.no_grad():
        out = fused(x)
    parts = torch.nn.functional.linear(x.double(), model.gate_up.weight.double()).split(piece, -1)
    torch.testing.assert_close(out.double(), parts[1] * torch.nn.functional.silu(parts[0]), rtol=1e-5, atol=1e-5)


class _BiaslessMLP(torch.nn.Module):
    """Linear → GELU (→ Linear) with no biases (Falcon's MLP)."""

    def __init__(self, second: bool, form: str = "none"):
        super().__init__()
        self.up = torch.nn.Linear(32, 128, bias=False)
        self.down = torch.nn.Linear(128, 32, bias=False) if second else None
        self.form = form

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x), approximate=self.form)
        return self.down(h) if self.down is not None else h


@pytest.mark.parametrize("second, form, pattern", [(False, "tanh", "bias_gelu"), (True, "none", "ffn")])
def test_gemm_epilogues_without_a_bias(second, form, pattern):
    """A linear without a bias takes a zero bias (a folded constant) in the GELU epilogue and
    the FFN; a weight changed after optimize still gives the new answer."""
    torch.manual_seed(0)
    model = _BiaslessMLP(second, form).eval()
    x = torch.randn(4, 64, 32)
    fused = opfuse.optimize(model, (x,))
    assert fused.report.counts().get(pattern) == 1, fused.report.counts()

    def want():
        h = torch.nn.functional.gelu(x.double() @ model.up.weight.double().T, approximate=form)
        return h @ model.down.weight.double().T if second else h
    with torch.no_grad():
        torch.testing.assert_close(fused(x).double(), want(), rtol=1e-5, atol=1e-5)
        model.up.weight.mul_(0.5)
        torch.testing.assert_close(fused(x).double(), want(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, variant", [("deberta-v2", "bmm_kscaled_fill"), ("deberta-v3", "bmm_kscaled_bias_fill")])
def test_deberta_attention_on_3d_bmm_fuses(name, variant):
    """DeBERTa-v2: Kᵀ / sqrt(tensor(D)·factor) (a constant, canonicalised to a scale), 3-D
    bmm, masked_fill(~keep, finfo.min) on the 4-D view; v3-style relative attention adds the
    disentangled c2p + p2c bias [B·H, S, S] first. One attention per layer, equal to eager."""
    from opfuse import zoo
    arch = zoo.BY_NAME[name]
    model = arch.build("eager")
    args, kwargs = arch.inputs(model, 2, 12)
    fused = opfuse.optimize(model, args, example_kwargs=kwargs)
    assert [r.variant for r in fused.report.fused if r.pattern == "attention"] == [variant] * 2
    with torch.no_grad():
        torch.testing.assert_close(fused(*args, **kwargs)[0], model(*args, **kwargs)[0], rtol=1e-4, atol=1e-4)


class _BmmFill(torch.nn.Module):
    """DeBERTa's spelling with a given fill value and a scale tensor (constant or an input)."""

    def __init__(self, fill, constant_scale=True):
        super().__init__()
        self.fill, self.constant_scale = fill, constant_scale

    def forward(self, q, k, v, keep, d):
        scale = torch.sqrt(torch.tensor(8.0) * 2) if self.constant_scale else torch.sqrt(d)
        scores = torch.bmm(q, k.transpose(-1, -2) / scale)
        probs = torch.softmax(scores.view(2, 3, 24, 24).masked_fill(~keep, self.fill), -1)
        return torch.bmm(probs.view(6, 24, 24), v)


@pytest.mark.parametrize("fill, constant_scale, fuses", [
    (torch.finfo(torch.float32).min, True, True),
    (0.0, True, False),                             # masked_fill with 0: not a mask (it changes the result)
    (torch.finfo(torch.float32).min, False, False),  # the scale is a run-time tensor: stays a div
])
def test_bmm_masked_fill_attention(fill, constant_scale, fuses):
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 24, 8), torch.randn(6, 24, 8), torch.randn(6, 24, 8)
    keep = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    keep[1, ..., 20:] = False
    d = torch.tensor(16.0)
    model = _BmmFill(fill, constant_scale).eval()
    fused = opfuse.optimize(model, (q, k, v, keep, d))
    assert ("attention" in fused.report.counts()) == fuses, [(r.pattern, r.reason) for r in fused.report.regions]
    with torch.no_grad():
        out = fused(q, k, v, keep, d)
    q64, k64, v64 = q.double(), k.double(), v.double()
    scores = (q64 @ k64.transpose(-1, -2) / 4.0).view(2, 3, 24, 24).masked_fill(~keep, fill)
    want = torch.softmax(scores, -1).view(6, 24, 24) @ v64
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
