"""End to end on real Hugging Face models: outputs equal eager, expected counts per pattern."""

import pytest
import torch

import opfuse
from opfuse.models import load


def _run(loaded, **kw):
    fused = opfuse.optimize(loaded.model, loaded.args, **kw)
    with torch.no_grad():
        ref = loaded.model(*loaded.args)
        out = fused(*loaded.args)
    return fused, ref, out


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tiny_bert_equals_eager_and_fuses(attn):
    loaded = load("bert-tiny", batch=4, seq=64, attn=attn)
    fused, ref, out = _run(loaded)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, atol=1e-4, rtol=1e-4)
    counts = fused.report.counts()
    assert counts["attention"] == 2 and counts["qkv_merge"] == 2
    # post-LN: attention dense -> +residual -> LN is one linear_add_layernorm; the FFN's output
    # dense goes to the ffn kernel (it saves more), leaving its add+LN to add_layernorm; the
    # embeddings' add+LN fuses too (position embeddings [1, S, E] broadcast over the batch)
    assert counts["linear_add_layernorm"] == 2 and counts["add_layernorm"] == 3
    # the embeddings LayerNorm's add broadcasts position embeddings [1,S,E]: fused, verified
    emb = [r for r in fused.report.regions if r.anchor == "layer_norm"]
    assert emb and emb[0].decision == "fused" and emb[0].verify_error < 1e-4, emb
    # unknown ops stay: the fused graph still computes the pooler's tanh
    other = loaded.args[0].clone()
    other[0, :5] = 7
    with torch.no_grad():
        torch.testing.assert_close(fused(other, loaded.args[1]).last_hidden_state,
                                   loaded.model(other, loaded.args[1]).last_hidden_state, atol=1e-4, rtol=1e-4)


def test_minilm_real_weights():
    loaded = load("minilm", batch=8, seq=128, attn="eager")
    fused, ref, out = _run(loaded)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)
    counts = fused.report.counts()
    # add_layernorm 1: the embeddings (position embeddings broadcast over the batch of 8)
    assert counts == {"attention": 6, "qkv_merge": 6, "linear_add_layernorm": 12, "bias_gelu": 6,
                      "add_layernorm": 1}, counts
    t = fused.report.totals
    assert t["bytes_fused"] < 0.8 * t["bytes_unfused"]


def test_minilm_sentences_cosine():
    loaded = load("minilm", batch=8, seq=0, attn="sdpa")
    fused, ref, out = _run(loaded)
    mask = loaded.args[1].unsqueeze(-1).float()
    pool = lambda h: (h * mask).sum(1) / mask.sum(1)  # noqa: E731
    cos = torch.nn.functional.cosine_similarity(pool(ref.last_hidden_state), pool(out.last_hidden_state))
    assert cos.min() >= 0.99999
    assert fused.report.counts()["attention"] == 6


@pytest.mark.parametrize("name,batch,seq", [("gpt2-tiny", 2, 64), ("vit-tiny", 4, 0)])
def test_pre_ln_residual_layernorm_sites(name, batch, seq):
    """Pre-LN (2 layers): 2L + 1 add+LayerNorm sites. Each attention output projection ->
    +residual -> LN fuses as linear_add_layernorm (the sum is also the next residual, so it is
    emitted); each MLP output projection is taken by the ffn kernel (more bytes saved); the
    embedding add (not after a linear) stays add_layernorm, legal (position embeddings
    [1, S, E] broadcast over the batch are expanded row-wise) but below θ: its sum is also
    the next residual, so fusing saves little."""
    loaded = load(name, batch=batch, seq=seq, attn="eager")
    fused, ref, out = _run(loaded)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)
    regions = fused.report.regions
    lal = [r for r in regions if r.pattern == "linear_add_layernorm"]
    assert len(lal) == 4 and sum(r.decision == "fused" for r in lal) == 2
    for r in lal:
        if r.decision != "fused":
            assert "overlaps ffn" in r.reason or "θ" in r.reason, r.reason
    first = next(r for r in regions if r.pattern == "add_layernorm" and r.anchor == "layer_norm")
    assert first.decision == "rejected" and "< θ" in first.reason and "broadcast" not in first.reason, first
    assert not any(r.anchor == "layer_norm" for r in lal)  # the embedding add follows no linear
