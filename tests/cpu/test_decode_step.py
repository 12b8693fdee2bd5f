"""The decode step's graph: what the rewrite leaves between the GEMMs (every op there is a
Python dispatch per token). Each test asserts the values against eager or float64 and the
ops the plan keeps or drops."""

import pytest
import torch
import torch.nn.functional as F

import opfuse


def _repeat_kv(x, n=2):  # HF repeat_kv: [B, Hkv, S, D] -> [B, Hkv·n, S, D]
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class GQALayers(torch.nn.Module):
    """Two grouped-query attention calls on one boolean padding mask (HF's SDPA path)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, q, k, v, keep):  # q [B, 4, S, 16], k/v [B, 2, S, 16], keep [B, 1, S, S] bool
        for p in self.proj:
            q = F.scaled_dot_product_attention(p(q), _repeat_kv(k), _repeat_kv(v), attn_mask=keep) + q
        return q


def _ops(fused):
    gm = next(iter(fused._plans.values())).gm
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_boolean_mask_needs_no_dead_row_restore():
    """A boolean mask comes from an SDPA source, which the kernel reads the same way (fully
    masked rows included): no isneginf / all / masked_fill per attention call."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g), \
        torch.randn(2, 2, 7, 16, generator=g)
    keep = torch.rand(2, 1, 7, 7, generator=g) > 0.3
    keep[0, 0, 3] = False  # a fully masked query row
    keep[1] = False        # a fully masked sequence
    model = GQALayers().eval()
    fused = opfuse.optimize(model, (q, k, v, keep), decide="rho")
    assert fused.report.counts().get("attention") == 2
    ops = _ops(fused)
    aten = torch.ops.aten
    assert aten.isneginf.default not in ops and aten.masked_fill.Scalar not in ops
    for mask in (keep, torch.ones_like(keep), torch.zeros_like(keep)):
        with torch.no_grad():
            out, ref = fused(q, k, v, mask), model(q, k, v, mask)
        assert torch.equal(out.isnan(), ref.isnan())
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_additive_inf_mask_still_restores_dead_rows():
    """The must-not: an additive float mask that may hold -inf keeps the restore (eager's
    softmax gives NaN on a fully masked row)."""
    class Eager(torch.nn.Module):
        def forward(self, q, k, v, bias):
            s = q @ k.transpose(-1, -2) * 0.25 + bias
            return torch.softmax(s, dim=-1) @ v

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(3))
    bias = torch.zeros(1, 1, 5, 5)
    bias[..., 2, :] = float("-inf")
    model = Eager().eval()
    fused = opfuse.optimize(model, (q, k, v, bias), decide="rho")
    assert fused.report.counts().get("attention") == 1
    assert torch.ops.aten.masked_fill.Scalar in _ops(fused)
    with torch.no_grad():
        out, ref = fused(q, k, v, bias), model(q, k, v, bias)
    assert out[0, :, 2].isnan().all() and ref[0, :, 2].isnan().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def _graph(build):
    """A GraphModule of ATen calls made by ``build(graph, x, buf)`` (x a placeholder, buf an
    attribute)."""
    from torch import fx
    root = torch.nn.Module()
    root.register_buffer("buf", torch.zeros(3, 4))
    graph = fx.Graph()
    x = graph.placeholder("x")
    buf = graph.get_attr("buf")
    graph.output(build(graph, x, buf))
    return fx.GraphModule(root, graph)


def test_dedupe_merges_repeated_pure_calls():
    from opfuse.rewrite import dedupe_pure_ops
    aten = torch.ops.aten

    def build(g, x, buf):
        a = [g.call_function(aten.unsqueeze.default, (x, 1)) for _ in range(3)]
        r = [g.call_function(aten.arange.default, (4,), {"dtype": torch.float32}) for _ in range(2)]
        nan = [g.call_function(aten.add.Tensor, (x, float("nan"))) for _ in range(2)]
        zero, negzero = (g.call_function(aten.mul.Tensor, (x, z)) for z in (0.0, -0.0))
        # consumed inside the graph, as a decode step's per-layer tables are
        return tuple(g.call_function(aten.sum.default, (t,)) for t in (*a, *r, *nan, zero, negzero))
    gm = _graph(build)
    x = torch.randn(3, 4)
    before = gm(x)
    assert dedupe_pure_ops(gm) == 2 + 1 + 1  # unsqueeze ×2, arange, add(nan); 0.0 and -0.0 stay apart
    after = gm(x)
    for b, a in zip(before, after):
        assert torch.equal(b.isnan(), a.isnan()) and torch.equal(b.nan_to_num(), a.nan_to_num())
        assert torch.equal(torch.signbit(b), torch.signbit(a))


def test_dedupe_keeps_outputs_independent():
    """Must-not: two equal calls that are graph outputs (or views of them) stay two tensors,
    so writing one output in place leaves the other as eager would."""
    from opfuse.rewrite import dedupe_pure_ops
    aten = torch.ops.aten

    def build(g, x, buf):
        a, b = (g.call_function(aten.add.Tensor, (x, 1.0)) for _ in range(2))
        c, d = (g.call_function(aten.mul.Tensor, (x, 3.0)) for _ in range(2))
        return (a, b, g.call_function(aten.view.default, (c, [12])), g.call_function(aten.view.default, (d, [12])))
    gm = _graph(build)
    assert dedupe_pure_ops(gm) == 0
    a, b, c, d = gm(torch.ones(3, 4))
    a.add_(1)
    c.add_(1)
    assert torch.equal(b, torch.full((3, 4), 2.0)) and torch.equal(d, torch.full((12,), 3.0))


def test_dedupe_never_reads_across_an_in_place_write():
    """Must-not: two equal calls on a buffer written in place between them, on a view of it,
    and seeded-random calls, all stay."""
    from opfuse.rewrite import dedupe_pure_ops
    aten = torch.ops.aten

    def build(g, x, buf):
        first = g.call_function(aten.mul.Tensor, (buf, 2.0))
        view = g.call_function(aten.view.default, (buf, [12]))
        v1 = g.call_function(aten.neg.default, (view,))
        g.call_function(aten.add_.Tensor, (buf, x))  # in-place write of buf
        second = g.call_function(aten.mul.Tensor, (buf, 2.0))
        v2 = g.call_function(aten.neg.default, (view,))
        noise = [g.call_function(aten.rand.default, ([2],)) for _ in range(2)]
        return (first, second, v1, v2, *noise)
    gm = _graph(build)
    assert dedupe_pure_ops(gm) == 0
    first, second, v1, v2, n1, n2 = gm(torch.ones(3, 4))
    assert torch.equal(first, torch.zeros(3, 4)) and torch.equal(second, torch.full((3, 4), 2.0))
    assert torch.equal(v1, torch.zeros(12)) and torch.equal(v2, torch.full((12,), -1.0))
    assert not torch.equal(n1, n2)


def test_decode_plan_dedupes_per_layer_tables():
    """Llama's decode graph: RoPE's cos / sin unsqueezes and the cache positions' arange are
    made once, not once per layer; generate's tokens stay eager's."""
    import transformers as T
    torch.manual_seed(0)
    lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                          pad_token_id=0)).eval()
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0))
    fused = opfuse.optimize(lm, (ids,), decide="rho")
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    out, ref = fused.generate(ids, **kw), lm.generate(ids, **kw)
    assert torch.equal(out, ref)
    (decode,) = [c for phase, c in fused.generation.graphs if phase == "decode"]
    plan = next(p for f in decode.plans.values() if f is not None for p in f._plans.values())
    ops = [n.target for n in plan.gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten.arange.default) == 1
    assert plan.report.deduped_ops >= 2 * 3


def test_small_gemms_are_timed_with_cold_caches(monkeypatch):
    """A GEMM of ≤ COLD_ROWS rows streams its weight from memory in a real forward: its
    backends are timed with the caches evicted before each call (and cached under their own
    key); a larger one is timed hot."""
    from opfuse import gemm
    from opfuse.bench import timing
    evictions = []
    monkeypatch.setattr(timing, "evict_caches", lambda: evictions.append(1))
    site = gemm.sites()[torch.ops.aten.linear.default]
    w = torch.randn(24, 16)
    backends = [gemm.BACKENDS[0], gemm.BACKENDS[1]]
    gemm.measure(site, [torch.randn(1, 1, 16), w, None], backends)
    assert len(evictions) == gemm.ROUNDS * len(backends)
    evictions.clear()
    gemm.measure(site, [torch.randn(gemm.COLD_ROWS + 1, 16), w, None], backends)
    assert not evictions
    cache = {}
    for rows in (1, gemm.COLD_ROWS + 1):
        gemm.choose(site, [torch.randn(rows, 16), w, None], backends, cache)
    assert [k.endswith("| cold") for k in cache] == [True, False]


def test_evict_caches_streams_more_than_the_last_level_cache():
    from opfuse.bench import timing
    timing.evict_caches()
    (scratch,) = timing._SCRATCH
    assert scratch.numel() * scratch.element_size() == timing.EVICT_BYTES >= 64 << 20


def test_bias_less_wt_gemms_run_as_one_matmul(monkeypatch):
    """The decode graph calls ``matmul(x, Wᵀ)`` for a bias-less GEMM on a pre-transposed
    weight (what ``linear`` calls, one dispatch instead of two), bit for bit; GEMMs with a bias
    keep ``linear``."""
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 16)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))
    model = Two().eval()
    x = torch.randn(1, 1, 32)
    wt = opfuse.optimize(model, (x,), gemm="wt")
    from opfuse import pipeline
    monkeypatch.setattr(pipeline, "direct_wt_matmuls", lambda gm: 0)
    linear_plan = opfuse.optimize(model, (x,), gemm="wt")  # linear(x, t(Wᵀ)) kept
    ops = _ops(wt)
    assert ops.count(torch.ops.aten.matmul.default) == 1 and ops.count(torch.ops.aten.linear.default) == 1
    assert ops.count(torch.ops.aten.t.default) == 1
    with torch.no_grad():
        for inp in (x, torch.randn(1, 1, 32)):
            assert torch.equal(wt(inp), linear_plan(inp))
            torch.testing.assert_close(wt(inp), model.double()(inp.double()).float(), rtol=1e-5, atol=1e-5)
            model.float()
        model.a.weight.mul_(2)  # a weight changed after optimize: never stale
        torch.testing.assert_close(wt(x), model(x), rtol=1e-6, atol=1e-6)


def _tiny_lm():
    import transformers as T
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                            pad_token_id=0)).eval()


def _phase_plans(fused, phase):
    return [p for ph, c in fused.generation.graphs if ph == phase for f in c.plans.values() if f is not None
            for p in f._plans.values()]


def test_generate_prefill_keeps_no_weight_copy_unless_asked():
    """The prefill graph (once per call) makes no weight copies by default: its GEMM
    backends are measured among those that keep none (generate.PREFILL_GEMM = "lean":
    aten, oneDNN on the weight as it is, the GEMV); a backend the user forces applies to it
    too."""
    from opfuse.generate import PREFILL_GEMM
    assert PREFILL_GEMM == "lean"
    lm = _tiny_lm()
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    ref = lm.generate(ids, **kw)
    for gemm, copies in ((None, False), ("wt", True)):
        fused = opfuse.optimize(lm, (ids,), decide="rho", gemm=gemm)
        assert torch.equal(fused.generate(ids, **kw), ref)
        (prefill,) = _phase_plans(fused, "prefill")
        folded = [n for n, _ in prefill.gm.named_buffers() if n.startswith(("opfuse_folded_wt_", "opfuse_folded_packed_"))]
        assert bool(folded) == copies
        backends = {c["backend"] for c in prefill.report.gemm}
        assert backends == {"wt"} if copies else backends <= {"aten", "onednn", "gemv"}
        assert all(c["extra_bytes"] == 0 for c in prefill.report.gemm) != copies
        if copies:
            (decode,) = _phase_plans(fused, "decode")
            assert any(n.startswith("opfuse_folded_wt_") for n, _ in decode.gm.named_buffers())


def test_wt_reads_gpt2_conv1d_weights_without_copying_them_back(tmp_path):
    """GPT-2's Conv1D weight is already [K, N] (the pre-transposed layout): the ``wt`` backend
    reads it (shared storage) instead of copying the canonicalised [N, K] copy back; values
    equal eager, an in-place weight update is seen, save/load round-trips."""
    import transformers as T
    torch.manual_seed(0)
    model = T.GPT2Model(T.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100)).eval()
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    fused = opfuse.optimize(model, (ids,), gemm="wt", decide="rho")
    gm = next(iter(fused._plans.values())).gm
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    wt = {n: t for n, t in gm.named_buffers() if n.startswith("opfuse_folded_wt_opfuse_t_")}
    assert len(wt) == 4 * 2 and all(t.untyped_storage().data_ptr() in own for t in wt.values())
    assert [c["extra_bytes"] for c in fused.report.gemm if c["backend"] == "wt"] == [0] * 8  # every GEMM is a Conv1D
    assert not any(n.startswith("opfuse_t_") for n, _ in gm.named_buffers())  # the [N, K] copies dropped
    with torch.no_grad():
        ref = model(ids).last_hidden_state
        torch.testing.assert_close(fused(ids).last_hidden_state, ref, rtol=1e-5, atol=1e-5)
        model.h[0].mlp.c_fc.weight.mul_(1.5)  # in place after optimize: never stale
        torch.testing.assert_close(fused(ids).last_hidden_state, model(ids).last_hidden_state, rtol=1e-5, atol=1e-5)
        opfuse.save(fused, tmp_path / "plan")
        loaded = opfuse.load(tmp_path / "plan")
        torch.testing.assert_close(loaded(ids).last_hidden_state, fused(ids).last_hidden_state, rtol=0, atol=0)


def test_decode_plan_shares_the_forward_plans_weight_copies():
    """The decode-step plan (dynamo's graph) reads the pre-transposed copies the forward
    plan (torch.export's graph) made of the same weights instead of holding its own: same
    tensor objects, fewer bytes held; tokens equal eager's, also after a weight changes."""
    from opfuse.bench.generate import held_bytes
    lm = _tiny_lm()
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    fused = opfuse.optimize(lm, (ids,), decide="rho", gemm="wt")
    forward = {n: t for p in fused._plans.values() for n, t in p.gm.named_buffers() if n.startswith("opfuse_folded_wt_")}
    alone = sum(t.untyped_storage().nbytes() for t in forward.values())
    assert torch.equal(fused.generate(ids, **kw), lm.generate(ids, **kw))
    (decode,) = _phase_plans(fused, "decode")
    copies = {n: t for n, t in decode.gm.named_buffers() if n.startswith("opfuse_folded_wt_")}
    mine = sum(t.untyped_storage().nbytes() for t in copies.values())
    shared = [n for n, t in copies.items() if any(t is f for f in forward.values())]
    assert shared == list(copies) and len(shared) == 2 * 5 + 1  # per layer: merged QKV, o, gate, up, down; LM head
    assert mine == alone and held_bytes(fused)["folded"] == alone  # the prefill plan's (forced wt) are shared too
    with torch.no_grad():
        lm.model.layers[0].self_attn.q_proj.weight.mul_(1.25)  # a shared copy's source changes: both re-plan
    assert torch.equal(fused.generate(ids, **kw), lm.generate(ids, **kw))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, lm(ids).logits, rtol=1e-5, atol=1e-5)


def _assert_generation_close(fused, lm, ids, new=6):
    """fused.generate equals eager's generate up to float32 rounding: logits of every step
    within 1e-4 while the tokens agree; where they part, the step's logits are still within
    it and eager's top two are a near-tie (oneDNN's sums differ from MKL's in the last bits)."""
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    out = fused.generate(ids, **kw)
    with torch.no_grad():
        ref = lm.generate(ids, **kw)
    for step, (got, want) in enumerate(zip(out.logits, ref.logits)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        pos = ids.shape[1] + step
        if not torch.equal(out.sequences[:, pos], ref.sequences[:, pos]):
            top = want.topk(2).values
            assert float(top[0, 0] - top[0, 1]) < 1e-4, step
            break


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="prepacked weights are oneDNN's")
def test_prefill_plan_shares_the_forward_plans_prepacked_weights():
    """oneDNN prepacked weights are opaque (no torch.equal): the prefill plan (dynamo's
    graph, whose weights are named ``in6`` …) reuses the forward plan's (torch.export's,
    named by FQN) where both were made of the same model tensors (``opfuse_derived_ids``);
    tokens equal eager's, also after a shared copy's source changes."""
    from opfuse.bench.generate import held_bytes
    lm = _tiny_lm()
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0))
    fused = opfuse.optimize(lm, (ids,), decide="rho", gemm="packed")
    forward = [t for p in fused._plans.values() for n, t in p.gm.named_buffers()
               if n.startswith("opfuse_folded_") and t.is_mkldnn]
    assert len(forward) >= 2 * 4 + 1  # per layer: merged QKV, o, gate/up (or merged), down; LM head
    alone = held_bytes(fused)["folded"]
    _assert_generation_close(fused, lm, ids)
    (prefill,) = _phase_plans(fused, "prefill")
    packed = [t for n, t in prefill.gm.named_buffers() if n.startswith("opfuse_folded_") and t.is_mkldnn]
    assert packed and all(any(t is f for f in forward) for t in packed), len(packed)
    assert held_bytes(fused)["folded"] - alone < sum(t.numel() * t.element_size() for t in packed)
    with torch.no_grad():
        lm.model.layers[1].mlp.down_proj.weight.mul_(0.5)
    _assert_generation_close(fused, lm, ids)
