"""rewrite.shared_bool_masks: a boolean attention mask read by several attention calls is
made additive (0 / −inf) once; the outputs stay bit for bit those of eager (SDPA makes the
same additive mask on every call), fully masked rows included."""

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import pipeline
from opfuse.models import load


class TwoLayers(torch.nn.Module):
    """Two attention calls on one boolean mask (as every layer of an encoder reads the
    padding mask), optionally a third reader of the mask that is no attention."""

    def __init__(self, other_reader=False, layers=2):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(layers))
        self.other_reader = other_reader

    def forward(self, x, keep):  # x [B, H, S, 32], keep [B, 1, S, S] bool
        for p in self.proj:
            x = F.scaled_dot_product_attention(p(x), x, x, attn_mask=keep) + x
        return x + keep.sum() if self.other_reader else x


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 32, generator=g).to(dtype)
    keep = torch.rand(2, 1, 9, 9, generator=g) > 0.4
    keep[0, 0, 2] = False  # a fully masked query row
    keep[1] = False        # a fully masked sequence
    return x, keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_mask_converted_once_bit_exact(dtype, monkeypatch):
    model = TwoLayers().eval().to(dtype)
    x, keep = _inputs(dtype)
    fused = opfuse.optimize(model, (x, keep), decide="rho")
    assert fused.report.shared_masks == 1
    gm = next(iter(fused._plans.values())).gm
    wheres = [n for n in gm.graph.nodes if n.target is torch.ops.aten.where.Scalar]
    assert len(wheres) == 1
    monkeypatch.setattr(pipeline, "shared_bool_masks", lambda gm: 0)
    without = opfuse.optimize(model, (x, keep), decide="rho")  # the same plan, the boolean mask kept
    assert without.report.shared_masks == 0
    for k in (keep, torch.ones_like(keep)):  # other mask values, same plan
        with torch.no_grad():
            out, ref, eager = fused(x, k), without(x, k), model(x, k)
        assert torch.equal(out, ref)
        if dtype == torch.float32:
            assert torch.equal(out, eager)
        else:  # the fused attention computes in float32, eager in bfloat16
            torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("model, shared", [(TwoLayers(layers=1), 0), (TwoLayers(other_reader=True), 1)],
                         ids=["one reader: not converted", "a non-attention reader keeps the boolean"])
def test_readers(model, shared):
    x, keep = _inputs()
    fused = opfuse.optimize(model.eval(), (x, keep), decide="rho")
    assert fused.report.shared_masks == shared
    with torch.no_grad():
        assert torch.equal(fused(x, keep), model(x, keep))


def test_bert_sdpa_padding_mask_shared_by_every_layer():
    loaded = load("bert-tiny", batch=2, seq=16, attn="sdpa")
    ids, mask = loaded.args
    mask[0, 5:] = 0
    fused = opfuse.optimize(loaded.model, (ids, mask), decide="rho")
    assert fused.report.shared_masks == 1
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, mask).last_hidden_state, loaded.model(ids, mask).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)
