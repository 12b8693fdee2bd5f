"""``fused.generate()`` (opfuse/generate.py): Hugging Face generation over a fused prefill
graph and a fused decode-step graph with a preallocated KV cache written in place.
Reference: the same model's own ``generate`` (eager, its default DynamicCache)."""

from __future__ import annotations

import pytest
import torch

import opfuse
from opfuse.generate import GenerateError

V = 1000
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=V)


def _lm(name: str):
    import transformers as T
    torch.manual_seed(0)
    if name == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=V, bos_token_id=1,
                                               eos_token_id=2, pad_token_id=0))
    elif name == "qwen2":
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**_SMALL, pad_token_id=0))
    elif name == "mistral":  # sliding window shorter than prompt + new tokens
        model = T.MistralForCausalLM(T.MistralConfig(**_SMALL, sliding_window=8, pad_token_id=0))
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(**_SMALL, pad_token_id=0))
    return model.eval()


def _prompt(batch: int = 2, length: int = 10, pad: int = 3):
    """Left-padded batch: row 0 has ``pad`` pad tokens (id 0) in front."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1 and pad:
        ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask


_FUSED = {}


def _fused(name: str):
    """One optimized model per family for the module (planning is the slow part)."""
    if name not in _FUSED:
        model = _lm(name)
        ids, mask = _prompt()
        _FUSED[name] = (model, opfuse.optimize(model, (ids,), example_kwargs={"attention_mask": mask}))
    return _FUSED[name]


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2", "mistral"])
def test_greedy_tokens_and_logits_equal_eager_with_left_padding(name):
    model, fused = _fused(name)
    ids, mask = _prompt()
    kw = dict(attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    out = fused.generate(ids, **kw)
    assert out.sequences.shape == (2, 10 + 32)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits) == 32
    for got, want in zip(out.logits, ref.logits):  # every step, both rows (the padded one too)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert "forward" not in model.__dict__  # the model's own forward again after the call
    plans = fused.generation.plans()
    phases = {p["phase"]: p for p in plans}
    assert set(phases) == {"prefill", "decode"}, plans
    decode = phases["decode"]
    assert decode["calls"]["fused"] >= 31 and not decode["fallbacks"], decode
    assert decode["fused"].get("attention") == 2, decode  # the decode step's attention over the cache fused
    assert phases["prefill"]["fused"].get("attention") == 2, phases["prefill"]


def test_decode_writes_the_cache_in_place_and_never_replans():
    model, fused = _fused("llama")
    ids, mask = _prompt()
    fused.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    graphs = len(fused.generation.graphs)
    cache = next(iter(fused.generation.caches.values()))
    storage = [layer.keys.data_ptr() for layer in cache.layers]
    fused.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert len(fused.generation.graphs) == graphs  # same cache bucket: the same prefill and decode graphs
    assert not fused.generation.replans  # HF's generate changed nothing the module fingerprint holds
    assert [layer.keys.data_ptr() for layer in cache.layers] == storage  # preallocated once, reset in place
    assert cache.get_max_length() == 128  # 10 + 20 tokens rounded up to CACHE_BUCKET
    for phase, compiled in fused.generation.graphs:
        for piece in compiled.plans.values():
            assert piece is not None and not piece.replans
            for plan in piece._plans.values():
                nodes = [n for n in plan.gm.graph.nodes if n.op == "call_function"]
                # K and V of both layers written in place into the cache (index_copy_, then fused with
                # RoPE into rope_qk_cache), no functional copy + copy_ back
                assert sum(n.target is torch.ops.opfuse.rope_qk_cache.default for n in nodes) == 2, phase
                assert not any(n.target in (torch.ops.aten.index_copy.default, torch.ops.aten.index_copy_.default,
                                            torch.ops.opfuse.rope_qk.default) for n in nodes), phase
                assert plan.report.inplace_writes == 4 and plan.report.rope_cache_writes == 2
    steps = fused.generation.summary()
    assert steps["new_tokens"] == 20 and steps["decode_step_s"] > 0


def _change_weight(model):
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)


def _replace_parameter(model):
    o = model.model.layers[1].self_attn.o_proj
    o.weight = torch.nn.Parameter(torch.randn_like(o.weight) * 0.2, requires_grad=False)


def _replace_activation(model):  # a submodule without parameters: only the module's identity changes
    model.model.layers[1].mlp.act_fn = torch.nn.ReLU()


def _change_attribute(model):  # a plain attribute the traced forward reads
    model.model.layers[0].self_attn.scaling = 0.6


def test_generate_after_the_model_changed_never_runs_stale():
    """dynamo keeps no guards on the model's modules (generate.GUARD_FILTER): each change
    below must still reach the tokens, checked once per generate call."""
    model = _lm("llama")
    ids, mask = _prompt()
    fused = opfuse.optimize(model, (ids,), example_kwargs={"attention_mask": mask})
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    before = fused.generate(ids, **kw)
    for change in (_change_weight, _replace_parameter, _replace_activation, _change_attribute):
        change(model)
        with torch.no_grad():
            ref = model.generate(ids, **kw)
        assert not torch.allclose(ref.logits[0], before.logits[0], atol=1e-3), change.__name__  # the change matters
        out = fused.generate(ids, **kw)
        assert torch.equal(out.sequences, ref.sequences), change.__name__
        for got, want in zip(out.logits, ref.logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        before = ref
    phases = {p["phase"] for p in fused.generation.plans()}
    assert phases == {"prefill", "decode"}  # still fused after the re-plans
    assert len(fused.generation.replans) == 3  # replaced parameter, activation, attribute (the in-place write:
    # the plans' own version guards)


def test_a_model_changed_during_generate_is_an_error_then_replans():
    """A logits processor that replaces a module mid-call: the graphs kept no guards on
    it, so the call raises (never returns tokens that ignored the change); the next call
    re-plans and equals eager."""
    from transformers import LogitsProcessor, LogitsProcessorList
    model = _lm("llama")
    ids, mask = _prompt()
    fused = opfuse.optimize(model, (ids,), example_kwargs={"attention_mask": mask})
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    fused.generate(ids, **kw)

    class Swap(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == ids.shape[1] + 2:
                _replace_activation(model)
            return scores
    with pytest.raises(GenerateError, match="changed during this generate"):
        fused.generate(ids, logits_processor=LogitsProcessorList([Swap()]), **kw)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    assert torch.equal(fused.generate(ids, **kw), ref)
    assert fused.generation.replans


def test_sampling_with_a_seed_equals_eager():
    model, fused = _fused("llama")
    ids, mask = _prompt()
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=20, temperature=0.8, pad_token_id=0)
    torch.manual_seed(123)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    torch.manual_seed(123)
    out = fused.generate(ids, **kw)
    assert torch.equal(out, ref)


def test_batch_and_prompt_length_changed_between_calls():
    model, fused = _fused("qwen2")
    for batch, length in [(1, 5), (3, 17), (2, 10)]:
        ids, mask = _prompt(batch, length, pad=2)
        kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            ref = model.generate(ids, **kw)
        assert torch.equal(fused.generate(ids, **kw), ref), (batch, length)


def test_eos_stops_and_pads_like_eager():
    model, fused = _fused("gpt2")
    ids, mask = _prompt()
    with torch.no_grad():
        greedy = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = int(greedy[1, 10 + 3])  # row 1's 4th new token becomes the end-of-sequence token
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    out = fused.generate(ids, **kw)
    assert torch.equal(out, ref)
    assert (out[1, 10 + 4:] == 0).all()  # row 1 finished and is padded


def test_clear_errors():
    import transformers as T
    model, fused = _fused("llama")
    ids, mask = _prompt()
    with pytest.raises(GenerateError, match="max_position_embeddings"):
        fused.generate(ids, max_new_tokens=model.config.max_position_embeddings)
    with pytest.raises(GenerateError, match="beam search"):
        fused.generate(ids, max_new_tokens=4, num_beams=2)
    with pytest.raises(GenerateError, match="StaticCache"):
        fused.generate(ids, max_new_tokens=4, cache=T.DynamicCache(config=model.config))
    with pytest.raises(GenerateError, match="got DynamicCache"):  # an empty one (no layers yet) too
        fused.generate(ids, max_new_tokens=4, past_key_values=T.DynamicCache())
    small = T.StaticCache(config=model.config, max_cache_len=12)
    with pytest.raises(GenerateError, match="holds 12 tokens"):
        fused.generate(ids, max_new_tokens=8, cache=small)
    assert "forward" not in model.__dict__
    base = T.LlamaModel(T.LlamaConfig(**_SMALL)).eval()
    fused_base = opfuse.optimize(base, (ids,))
    with pytest.raises(GenerateError, match="no language-model head"):
        fused_base.generate(ids, max_new_tokens=4)


# -- the in-place cache-write pass (opfuse.rewrite.inplace_cache_writes) -------------------

class _RollingCache(torch.nn.Module):
    """A KV-cache-like buffer written with ``index_copy_`` at a position given per call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(2, 8, 4))

    def forward(self, x, pos):
        self.k.index_copy_(1, pos, x)
        return torch.nn.functional.layer_norm(self.k + 1.0, (4,)).sum(1)


def test_inplace_cache_write_matches_eager_over_calls():
    model, twin = _RollingCache().eval(), _RollingCache().eval()
    fused = opfuse.optimize(model, (torch.randn(2, 1, 4), torch.tensor([0])))
    plan = next(iter(fused._plans.values()))
    targets = [n.target for n in plan.gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.index_copy_.default in targets and torch.ops.aten.copy_.default not in targets
    assert plan.report.inplace_writes == 1 and "k" in plan.writes
    for step in range(6):
        x = torch.randn(2, 1, 4)
        pos = torch.tensor([step])
        torch.testing.assert_close(fused(x, pos), twin(x, pos))
        assert torch.equal(model.k, twin.k)
    assert not fused.replans


def _hand_graph(reader: str) -> torch.fx.GraphModule:
    """buf.index_copy(0, i, x), written back with copy_, and a reader of buf placed
    ``reader``: "after" the write, or a "view" made before it and used after."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    buf, idx, x = g.placeholder("buf"), g.placeholder("idx"), g.placeholder("x")
    view = g.call_function(aten.view.default, (buf, [-1])) if reader == "view" else None
    new = g.call_function(aten.index_copy.default, (buf, 0, idx, x))
    old = g.call_function(aten.add.Tensor, (buf, 1.0)) if reader == "after" else \
        g.call_function(aten.sum.default, (view,))
    g.call_function(aten.copy_.default, (buf, new))
    g.output((g.call_function(aten.mul.Tensor, (new, old)),))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("reader", ["after", "view"])
def test_inplace_cache_write_refused_when_the_old_value_is_read_later(reader):
    from opfuse.rewrite import inplace_cache_writes
    gm = _hand_graph(reader)
    buf, idx, x = torch.randn(4, 3), torch.tensor([1]), torch.randn(1, 3)
    want = gm(buf.clone(), idx, x)
    assert inplace_cache_writes(gm) == 0
    assert any(n.target is torch.ops.aten.index_copy.default for n in gm.graph.nodes)
    b = buf.clone()
    torch.testing.assert_close(gm(b, idx, x), want)


def test_views_after_an_unfused_op_fed_by_a_fused_one_become_reshapes():
    """A fused RoPE changes q's layout, SDPA (left unfused) follows its query's layout, and
    the ``view`` export recorded after ``transpose(1, 2)`` of SDPA's output no longer fits
    (Llama, hidden 512, prompt 64, DynamicCache: raised in the whole-model check): every
    view downstream of a fused op, through any op, becomes a reshape; views elsewhere stay."""
    from opfuse.rewrite import relax_views
    aten = torch.ops.aten
    g = torch.fx.Graph()
    q, other = g.placeholder("q"), g.placeholder("other")
    fused = g.call_function(aten.mul.Tensor, (q, 2.0))
    fused.meta["opfuse_pattern"] = "rope"
    sdpa_like = g.call_function(aten.transpose.int, (g.call_function(aten.neg.default, (fused,)), 1, 2))
    after = g.call_function(aten.view.default, (sdpa_like, [2, -1]))
    untouched = g.call_function(aten.view.default, (other, [-1]))
    g.output((after, untouched))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert relax_views(gm) == 1
    assert after.target is aten.reshape.default and untouched.target is aten.view.default
    gm.recompile()
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(gm(x, x)[0], (-(x * 2)).transpose(1, 2).reshape(2, -1))


def test_bound_op_forward_equals_the_graph_and_never_runs_stale():
    """rewrite.bind_op_builtins: the same program with each op's C++ entry bound; after the
    graph is changed and recompiled, the new graph runs (not the bound old source)."""
    from opfuse.rewrite import bind_op_builtins
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.mul.Tensor, (g.call_function(aten.add.Tensor, (x, 1.0)), 3.0))
    g.output((y,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert bind_op_builtins(gm) == 2 and "forward" in gm.__dict__
    t = torch.randn(5)
    torch.testing.assert_close(gm(t)[0], (t + 1.0) * 3.0)
    y.target = aten.sub.Tensor  # the graph changes: (x + 1) - 3
    gm.recompile()
    torch.testing.assert_close(gm(t)[0], (t + 1.0) - 3.0)


def test_pipeline_plans_run_the_bound_forward():
    model, fused = _fused("llama")
    ids, mask = _prompt()
    fused.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert {phase for phase, _ in fused.generation.graphs} == {"prefill", "decode"}
    for phase, compiled in fused.generation.graphs:
        for piece in compiled.plans.values():
            for p in piece._plans.values():
                assert "forward" in p.gm.__dict__, phase  # bound: the decode step skips OpOverload.__call__


def test_generation_table_shows_both_plans():
    from rich.console import Console

    from opfuse.report.text import generation_table
    model, fused = _fused("llama")
    ids, mask = _prompt()
    fused.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    console = Console(record=True, width=200)
    console.print(generation_table(fused.generation.plans(), fused.generation.summary()))
    text = console.export_text()
    assert "prefill" in text and "decode" in text and "attention 2" in text and "decode step" in text
