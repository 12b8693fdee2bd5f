"""Decoder models with their DEFAULT configs (``use_cache=True``): the forward returns a
``DynamicCache``, which torch.export cannot capture (no pytree), so opfuse captures them
through dynamo's pieces (opfuse/partial.py). Hidden states / logits and the returned cache
equal eager's, and the decoder blocks still fuse."""

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
    assert fused.report.capture["mode"] == "pieces" and fused.report.capture["pieces"] == 1
    assert counts.get("attention") == 2, counts  # every layer's attention fused inside the piece
