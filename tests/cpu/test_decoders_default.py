"""Decoder models with their DEFAULT configs (``use_cache=True``): the forward returns a
``DynamicCache``; opfuse registers Hugging Face's cache classes as pytrees (as
transformers' own exporter does, graph.capture.register_cache_pytrees), so torch.export
captures the whole model and the cache is rebuilt on the way out. Hidden states / logits
and the returned cache equal eager's, the decoder blocks fuse, and with ``dynamic=True``
one plan serves every length (no re-plan, the plan survives save/load)."""

from __future__ import annotations

import pytest
import torch

import opfuse


def _models():
    from transformers import (GPT2Config, GPT2Model, LlamaConfig, LlamaForCausalLM, LlamaModel, Qwen2Config,
                              Qwen2Model)
    llama = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000)
    return {
        "gpt2": lambda: GPT2Model(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=1000, bos_token_id=0,
                                             eos_token_id=0)),
        "llama": lambda: LlamaModel(LlamaConfig(**llama)),
        "llama-lm": lambda: LlamaForCausalLM(LlamaConfig(**llama)),
        "qwen2": lambda: Qwen2Model(Qwen2Config(**llama)),
    }


def _cache_tensors(cache):
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("name", list(_models()))
def test_default_config_decoder_optimizes_with_its_cache(name):
    torch.manual_seed(0)
    model = _models()[name]().eval()
    assert model.config.use_cache
    ids = torch.randint(0, 1000, (2, 12))
    fused = opfuse.optimize(model, (ids,))
    with torch.no_grad():
        out, ref = fused(ids), model(ids)
    key = "logits" if hasattr(ref, "logits") else "last_hidden_state"
    torch.testing.assert_close(getattr(out, key), getattr(ref, key), rtol=1e-4, atol=1e-4)
    got, want = _cache_tensors(out.past_key_values), _cache_tensors(ref.past_key_values)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    counts = fused.report.counts()
    assert fused.report.capture["mode"] == "whole", fused.report.capture
    assert type(out.past_key_values) is type(ref.past_key_values)
    assert counts.get("attention") == 2, counts  # every layer's attention fused


@pytest.mark.parametrize("name", ["llama-lm", "gpt2"])
def test_default_config_decoder_dynamic_every_length(name, tmp_path):
    torch.manual_seed(0)
    model = _models()[name]().eval()
    fused = opfuse.optimize(model, (torch.randint(0, 1000, (2, 12)),), dynamic=True)
    assert fused.report.dynamic.get("dims"), fused.report.dynamic
    back = opfuse.load(opfuse.save(fused, tmp_path / name))
    key = "logits" if name == "llama-lm" else "last_hidden_state"
    for batch, seq in [(1, 1), (1, 7), (3, 30)]:
        ids = torch.randint(0, 1000, (batch, seq))
        with torch.no_grad():
            out, ref, loaded = fused(ids), model(ids), back(ids)
        torch.testing.assert_close(getattr(out, key), getattr(ref, key), rtol=1e-4, atol=1e-4)
        assert torch.equal(getattr(loaded, key), getattr(out, key))
        for g, w in zip(_cache_tensors(loaded.past_key_values), _cache_tensors(ref.past_key_values)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert len(fused.reports) == 1 and fused.replans == []


def test_saved_decoder_with_its_cache_loads_in_a_fresh_process(tmp_path):
    """The cache class is an output type: a fresh process registers it (from transformers)
    when loading, and the loaded plan returns a DynamicCache equal to the saved module's."""
    import subprocess
    import sys
    torch.manual_seed(0)
    model = _models()["llama"]().eval()
    fused = opfuse.optimize(model, (torch.randint(0, 1000, (2, 12)),), dynamic=True)
    root = opfuse.save(fused, tmp_path / "llama")
    ids = torch.randint(0, 1000, (1, 9))
    with torch.no_grad():
        ref = fused(ids)
    torch.save({"ids": ids, "h": ref.last_hidden_state, "k": ref.past_key_values.layers[1].keys}, tmp_path / "ref.pt")
    script = (f"import torch, opfuse\n"  # the parent's thread count: BLAS's sums split by threads
              f"torch.set_num_threads({torch.get_num_threads()})\n"
              f"ref = torch.load({str(tmp_path / 'ref.pt')!r}, weights_only=True)\n"
              f"out = opfuse.load({str(root)!r})(ref['ids'])\n"
              "assert type(out.past_key_values).__name__ == 'DynamicCache'\n"
              "assert torch.equal(out.last_hidden_state, ref['h'])\n"
              "assert torch.equal(out.past_key_values.layers[1].keys, ref['k'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("old, new, message", [
    ('transformers.cache_utils:DynamicLayer', 'subprocess:Popen', "only transformers' \\*Cache / \\*Layer"),
    ('\\"_t\\": \\"obj\\"', '\\"_t\\": \\"seq\\"', "rebuilds a 'seq' object"),
    ('"type": "transformers.cache_utils:DynamicCache"', '"type": "builtins:eval"', "not a transformers cache class"),
])
def test_cache_context_in_a_saved_plan_cannot_name_other_classes(tmp_path, old, new, message):
    """transformers rebuilds a cache from a context naming classes by path; a saved plan
    whose context (hashes rewritten) names anything but a transformers cache/layer class, or
    asks for a constructor call, is refused before anything is imported or built."""
    import json
    from opfuse import persist
    torch.manual_seed(0)
    fused = opfuse.optimize(_models()["llama"]().eval(), (torch.randint(0, 1000, (2, 12)),))
    root = opfuse.save(fused, tmp_path / "llama")
    graph_file = root / "plan0.graph.json"
    graph = json.loads(graph_file.read_text())
    assert old in graph["pytree"]["out_spec"]
    graph["pytree"]["out_spec"] = graph["pytree"]["out_spec"].replace(old, new)
    graph_file.write_text(json.dumps(graph))
    manifest = json.loads((root / "manifest.json").read_text())
    for entry in manifest["plans"]:
        entry["sha256"] = {k: persist._sha256(root / f) for k, f in entry["files"].items()}
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(opfuse.LoadError, match=message):
        opfuse.load(root)
