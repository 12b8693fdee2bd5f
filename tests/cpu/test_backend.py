"""torch.compile(model, backend="opfuse"): equal to eager, fused, graph breaks, fallbacks."""

import functools

import pytest
import torch

import opfuse.backend as B
from opfuse.models import load


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    B.reset()
    yield
    B.reset()


def _close(a, b, atol=1e-4):
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


def test_backend_is_registered_by_entry_point():
    from torch._dynamo.backends.registry import lookup_backend
    assert lookup_backend("opfuse") is B.opfuse_backend


def test_tiny_bert_compiled_equals_eager_and_fuses():
    loaded = load("bert-tiny", batch=2, seq=16)
    compiled = torch.compile(loaded.model, backend="opfuse")
    with torch.no_grad():
        out, ref = compiled(*loaded.args), loaded.model(*loaded.args)
    _close(out.last_hidden_state, ref.last_hidden_state)
    _close(out.pooler_output, ref.pooler_output)
    (graph,) = B.COMPILED
    assert graph.fallbacks == [] and graph.calls["fused"] == 1
    # parameters arrive as graph inputs; they are bound back so QKV can be pre-concatenated
    # add_layernorm 3: the two post-attention ones and the embeddings' (position embeddings
    # [1, S, E] broadcast over the batch, expanded row-wise by the kernel)
    assert graph.reports[0].counts() == {"attention": 2, "qkv_merge": 2, "linear_add_layernorm": 2, "add_layernorm": 3,
                                         "ffn": 2}
    # another batch of tokens, same signature: the cached plan, still equal to eager
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        _close(compiled(ids, loaded.args[1]).last_hidden_state, loaded.model(ids, loaded.args[1]).last_hidden_state)
    assert len(graph.plans) == 1


def test_tiny_gpt2_compiled_equals_eager():
    from transformers import GPT2Config, GPT2Model
    model = GPT2Model(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100)).eval()
    ids = torch.randint(0, 100, (2, 16))
    compiled = torch.compile(model, backend="opfuse")
    with torch.no_grad():
        out, ref = compiled(ids), model(ids)
    _close(out.last_hidden_state, ref.last_hidden_state)
    assert all(not g.fallbacks for g in B.COMPILED)
    counts = B.COMPILED[0].reports[0].counts()
    assert counts.get("attention") == 2 and counts.get("ffn") == 2, counts


class _Broken(torch.nn.Module):
    """Two fusable halves separated by a graph break."""

    def __init__(self, e=32):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(e, eps=1e-3), torch.nn.LayerNorm(e)
        self.fc = torch.nn.Linear(e, 4 * e)

    def forward(self, x, r):
        y = self.ln1(x + r)
        torch._dynamo.graph_break()
        return torch.nn.functional.gelu(self.fc(self.ln2(y + r)))


def test_graph_breaks_each_piece_optimized():
    model = _Broken().eval()
    x, r = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    compiled = torch.compile(model, backend=functools.partial(B.opfuse_backend, theta=0.1))
    with torch.no_grad():
        _close(compiled(x, r), model(x, r))
    assert len(B.COMPILED) == 2
    counts = [g.reports[0].counts() for g in B.COMPILED]
    assert counts[0] == {"add_layernorm": 1} and counts[1].get("add_layernorm") == 1, counts


def test_new_shape_reoptimizes_or_recompiles_correctly():
    model = _Broken().eval()
    compiled = torch.compile(model, backend="opfuse", dynamic=False)
    with torch.no_grad():
        for shape in [(4, 16, 32), (1, 7, 32), (3, 13, 32)]:
            x, r = torch.randn(*shape), torch.randn(*shape)
            _close(compiled(x, r), model(x, r))
    assert all(not g.fallbacks for g in B.COMPILED)


def test_failure_falls_back_with_reason(monkeypatch):
    from opfuse import pipeline
    from opfuse.graph.capture import CaptureError

    def broken(*a, **k):
        raise CaptureError("simulated export failure")

    monkeypatch.setattr(pipeline, "capture", broken)
    model = _Broken().eval()
    x, r = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    compiled = torch.compile(model, backend="opfuse")
    with torch.no_grad():
        _close(compiled(x, r), model(x, r))  # never raises, never wrong
    assert B.COMPILED and all(g.fallbacks for g in B.COMPILED)
    assert "simulated export failure" in B.COMPILED[0].fallbacks[0].reason


def test_autograd_calls_run_unfused_and_backprop():
    model = _Broken().eval()
    x = torch.randn(2, 8, 32, requires_grad=True)
    r = torch.randn(2, 8, 32)
    compiled = torch.compile(model, backend="opfuse")
    out = compiled(x, r)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert any("requires grad" in f.reason for g in B.COMPILED for f in g.fallbacks)


def test_training_mode_graph_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)).train()
    compiled = torch.compile(model, backend="opfuse")
    with torch.no_grad():
        out = compiled(torch.randn(4, 16))
    assert out.shape == (4, 16)
    (graph,) = B.COMPILED
    assert graph.calls["fused"] == 0 and "training mode" in graph.fallbacks[0].reason


def test_weights_updated_in_place_are_not_stale():
    loaded = load("bert-tiny", batch=2, seq=16)
    model = loaded.model
    compiled = torch.compile(model, backend="opfuse")
    with torch.no_grad():
        compiled(*loaded.args)
        model.encoder.layer[0].attention.self.key.weight.mul_(2.0)  # folded into the QKV concat
        _close(compiled(*loaded.args).last_hidden_state, model(*loaded.args).last_hidden_state)


class _CacheWrite(torch.nn.Module):
    """A decode step's shape: an in-place write to an input (the KV cache), then a read."""

    def forward(self, cache, x):
        cache.index_copy_(0, torch.tensor([0]), x)
        return cache * 2.0


def _failing_after(write: bool):
    def fused(cache, x=None):
        if write:
            cache.index_copy_(0, torch.tensor([0]), x)
        raise RuntimeError("simulated kernel failure")
    return fused


@pytest.mark.parametrize("write", [True, False])
def test_failed_fused_call_never_applies_an_inplace_write_twice(write):
    gm = torch.fx.symbolic_trace(_CacheWrite())
    cache, x = torch.zeros(4, 3), torch.ones(1, 3)
    graph = B.CompiledGraph(gm, (cache, x), {})
    assert graph.mutates
    graph._optimize = lambda key, args: _failing_after(write)
    if write:  # the fused graph wrote, then raised: rerunning would add the write again
        with pytest.raises(RuntimeError, match="apply those writes twice"):
            graph(cache, x)
        assert cache[0].tolist() == [1.0, 1.0, 1.0] and cache[1:].eq(0).all()
    else:  # nothing written yet: the unfused rerun is the one write
        _close(graph(cache, x), torch.tensor([[2.0] * 3] + [[0.0] * 3] * 3))
    assert graph.plans and all(p is None for p in graph.plans.values())
    out = graph(cache, x)  # later calls run unfused, exactly once
    assert cache[0].tolist() == [1.0, 1.0, 1.0] and out[0].tolist() == [2.0, 2.0, 2.0]


def test_failed_fused_call_of_a_pure_graph_reruns_unfused():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 2).eval())
    graph = B.CompiledGraph(gm, (torch.ones(1, 3),), {})
    assert not graph.mutates
    graph._optimize = lambda key, args: _failing_after(False)
    with torch.inference_mode():  # inference tensors have no version counter
        x = torch.ones(1, 3)
        _close(graph(x), gm(x))
    assert "simulated kernel failure" in graph.fallbacks[0].reason
