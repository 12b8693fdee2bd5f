"""No silent wrong results from state, aliasing and stale weights (issue: reliability items
1–3), under both entry points: ``opfuse.optimize`` and ``torch.compile(backend="opfuse")``.
Each case is a small module compared with an eager twin (same weights, same state)."""

from __future__ import annotations

import copy

import pytest
import torch

import opfuse
import opfuse.backend as backend
from opfuse.graph.capture import CaptureError


def _twin(model):
    return copy.deepcopy(model)


def _compiled(model):
    backend.reset()
    return torch.compile(model, backend="opfuse")


def _fused_graphs():
    return [f for g in backend.COMPILED for f in g.plans.values() if f is not None]


# --- 1. state mutated in forward --------------------------------------------------------


class RollingCache(torch.nn.Module):
    """A rolling cache written with index_copy_ and a step counter buffer (+= 1)."""

    def __init__(self):
        super().__init__()
        self.lin, self.ln = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)
        self.register_buffer("cache", torch.zeros(4, 16))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.ln(self.lin(x) + x)
        self.cache.index_copy_(0, self.step.view(1) % 4, h[:1])
        self.step += 1
        return h + self.cache.sum(0)


def _state(m):
    return {k: v.clone() for k, v in m.named_buffers()}


@pytest.mark.parametrize("entry", ["optimize", "compile"])
def test_buffer_mutation_happens_once_per_call_and_never_replans(entry):
    torch.manual_seed(0)
    model = RollingCache().eval()
    ref = _twin(model)
    x = torch.randn(3, 16)
    fused = opfuse.optimize(model, (x,)) if entry == "optimize" else _compiled(model)
    assert model.step.item() == 0 and not model.cache.any(), "optimize advanced the model's state"
    for _ in range(6):  # wraps around the 4-slot cache
        with torch.no_grad():
            out, expected = fused(x), ref(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for k, v in _state(ref).items():
            torch.testing.assert_close(dict(model.named_buffers())[k], v, rtol=1e-5, atol=1e-5)
    assert model.step.item() == 6
    plans = [fused] if entry == "optimize" else _fused_graphs()
    assert plans and all(p.replans == [] for p in plans), [p.replans for p in plans]
    assert all(p.report.counts().get("linear_add_layernorm") == 1 for p in plans)


class PythonCounter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.ln(x + x) * self.calls


def test_python_attribute_written_in_forward_is_refused_by_name_and_restored():
    model = PythonCounter().eval()
    with pytest.raises(CaptureError, match=r"calls: 0 -> 1"):
        opfuse.optimize(model, (torch.randn(2, 8),))
    assert model.calls == 0


def test_python_attribute_under_compile_equals_eager():
    model, ref = PythonCounter().eval(), PythonCounter().eval()
    ref.load_state_dict(model.state_dict())
    compiled = _compiled(model)
    x = torch.randn(2, 8)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), ref(x))
    assert model.calls == ref.calls == 3


# --- 2. aliasing and in-place writes ------------------------------------------------------


class ViewThenWrite(torch.nn.Module):
    """A view of the input, the input written in place, the view used in add+LayerNorm."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)

    def forward(self, x, r):
        v = r.view(-1, 16)
        r.mul_(2)
        return self.ln(x.view(-1, 16) + v)


class WriteResidual(torch.nn.Module):
    """``r.add_(proj(x))`` before a LayerNorm: the write is visible to the caller."""

    def __init__(self):
        super().__init__()
        self.ln, self.proj = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    def forward(self, x, r):
        r.add_(self.proj(x))
        return self.ln(r)


class ReadBeforeWrite(torch.nn.Module):
    """add+LayerNorm reads r, then r is written, then r is read again."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)

    def forward(self, x, r):
        a = self.ln(x + r)
        r.sub_(1.0)
        return a + r


@pytest.mark.parametrize("entry", ["optimize", "compile"])
@pytest.mark.parametrize("cls", [ViewThenWrite, WriteResidual, ReadBeforeWrite])
def test_in_place_writes_to_inputs(entry, cls):
    torch.manual_seed(0)
    model = cls().eval()
    x, r = torch.randn(4, 16), torch.randn(4, 16)
    r_example = r.clone()
    fused = opfuse.optimize(model, (x, r)) if entry == "optimize" else _compiled(model)
    if entry == "optimize":
        assert torch.equal(r, r_example), "optimize changed the example input"
    for _ in range(2):
        r_fused, r_eager = r_example.clone(), r_example.clone()
        with torch.no_grad():
            out, expected = fused(x, r_fused), model(x, r_eager)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r_fused, r_eager, rtol=1e-6, atol=1e-6)  # the write happened, once
    expected_counts = {ViewThenWrite: "add_layernorm", WriteResidual: "linear_add_layernorm",
                       ReadBeforeWrite: "add_layernorm"}[cls]
    plans = [fused] if entry == "optimize" else _fused_graphs()
    assert any(p.report.counts().get(expected_counts) == 1 for p in plans), [p.report.counts() for p in plans]


def test_captured_graph_is_functional_before_matching():
    """The graph the patterns see has no in-place op except trailing copy_ write-backs."""
    from opfuse import pipeline
    from opfuse.graph.state import check_functional, mutated_targets
    for model, args in ((ViewThenWrite().eval(), (torch.randn(4, 16), torch.randn(4, 16))),
                        (RollingCache().eval(), (torch.randn(3, 16),))):
        plan = pipeline.run(model, args, {}, verify=False, rewrite_graph=False)
        assert check_functional(plan.gm.graph) is None
    assert mutated_targets(plan.gm.graph)["buffers"] == {"cache", "step"}


# --- 3. weights and modules changed after optimize ---------------------------------------


def _tiny_bert():
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                     vocab_size=1000, attn_implementation="eager")
    return BertModel(cfg).eval(), cfg


def _err(fused, model, ids):
    with torch.no_grad():
        return (fused(ids).last_hidden_state - model(ids).last_hidden_state).abs().max().item()


@pytest.mark.parametrize("entry", ["optimize", "compile"])
def test_inference_mode_weights_changed_in_place_are_not_stale(entry):
    """Inference tensors have no version counter: merging a LoRA-like delta into the
    query weight (folded into the QKV concat) is seen by the fingerprint and re-planned."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                     vocab_size=1000, attn_implementation="eager")
    with torch.inference_mode():
        model = BertModel(cfg).eval()
        ids = torch.randint(0, 1000, (2, 16))
        fused = opfuse.optimize(model, (ids,)) if entry == "optimize" else _compiled(model)
        out0 = fused(ids).last_hidden_state
        if entry == "optimize":
            assert fused.report.counts().get("qkv_merge") == 2
        q = model.encoder.layer[0].attention.self.query.weight
        q.add_(torch.randn_like(q) * 0.5)  # a dense delta, as a merged LoRA
        model.encoder.layer[1].attention.self.value.weight.mul_(3.0)
        out1, ref1 = fused(ids).last_hidden_state, model(ids).last_hidden_state
    assert (out1 - out0).abs().max() > 0.05  # the change matters
    torch.testing.assert_close(out1, ref1, rtol=1e-4, atol=1e-4)
    if entry == "optimize":
        assert any("inference-mode tensor" in r for r in fused.replans), fused.replans


@pytest.mark.parametrize("entry", ["optimize", "compile"])
def test_replaced_submodule_is_not_stale(entry):
    from transformers import BertModel
    model, cfg = _tiny_bert()
    ids = torch.randint(0, 1000, (2, 16))
    fused = opfuse.optimize(model, (ids,)) if entry == "optimize" else _compiled(model)
    assert _err(fused, model, ids) < 1e-4
    torch.manual_seed(1)
    model.encoder.layer[0].attention = BertModel(cfg).eval().encoder.layer[0].attention
    assert _err(fused, model, ids) < 1e-4
    if entry == "optimize":
        assert fused.replans and "replaced" in fused.replans[-1]


def test_replaced_parameter_and_reassigned_buffer_are_not_stale():
    model, _ = _tiny_bert()
    ids = torch.randint(0, 1000, (2, 16))
    fused = opfuse.optimize(model, (ids,))
    attn = model.encoder.layer[1].attention.self
    attn.key.weight = torch.nn.Parameter(torch.randn_like(attn.key.weight))  # setattr: folded QKV source
    assert _err(fused, model, ids) < 1e-4
    model.embeddings.token_type_ids = torch.ones_like(model.embeddings.token_type_ids)  # buffer reassigned
    assert _err(fused, model, ids) < 1e-4
    assert len(fused.replans) == 2, fused.replans


def test_refresh_replans_on_demand():
    model, _ = _tiny_bert()
    ids = torch.randint(0, 1000, (2, 16))
    fused = opfuse.optimize(model, (ids,))
    fused.refresh()
    assert _err(fused, model, ids) < 1e-4 and fused.replans == ["refresh() called"]


def test_a_graph_with_an_in_place_write_fuses_nothing():
    """The safety net behind functionalisation: legality on a graph that still writes in
    place refuses every candidate, naming the write."""
    from opfuse import pipeline
    from opfuse.graph.capture import capture
    from opfuse.patterns import LIBRARY, find_matches
    gm = capture(AddLNThenWrite().eval(), (torch.randn(4, 16), torch.randn(4, 16)), {})
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default)
    node.target = torch.ops.aten.add_.Tensor  # an in-place op that is not a trailing write-back
    with gm.graph.inserting_after(node):
        user = gm.graph.call_function(torch.ops.aten.neg.default, (node,))
    gm.graph.output_node().args = ((*gm.graph.output_node().args[0], user),)
    matches, _ = find_matches(gm.graph, LIBRARY)
    cands = pipeline.legality(matches, gm.graph)
    assert cands and all(not c.legal and "not functional" in c.reason for c in cands)
    assert pipeline.legality(matches) and all(c.legal for c in pipeline.legality(matches))  # no graph: no net


class AddLNThenWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)

    def forward(self, x, r):
        out = self.ln(x + r)
        r.mul_(2.0)
        return out
