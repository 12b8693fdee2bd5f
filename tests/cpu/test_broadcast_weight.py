"""LayerNorm whose weight and bias are broadcast-shaped per-feature vectors ``(1, 1, E)``
(issue #14): legal (the same values as ``[E]``), so the hand-written LayerNorm respells and
add+LayerNorm fuses; a weight that varies over rows, or one of higher rank than x, must not."""

from __future__ import annotations

import pytest
import torch

import opfuse


class AddLNBroadcastWeight(torch.nn.Module):
    def __init__(self, weight_shape, e: int = 32):
        super().__init__()
        self.g = torch.nn.Parameter(1.0 + 0.1 * torch.randn(weight_shape))
        self.b = torch.nn.Parameter(0.1 * torch.randn(weight_shape))

    def forward(self, x, r):
        h = x + r
        u = h.mean(-1, keepdim=True)
        s = (h - u).pow(2).mean(-1, keepdim=True)
        return self.g * ((h - u) / torch.sqrt(s + 1e-5)) + self.b


def _reference(model, x, r):
    """float64 LayerNorm of x + r with the weight flattened to [E]."""
    h = (x + r).double()
    e = h.shape[-1]
    g, b = model.g.detach().double().reshape(-1)[-e:], model.b.detach().double().reshape(-1)[-e:]
    return torch.nn.functional.layer_norm(h, (e,), g if model.g.numel() == e else None,
                                          b if model.b.numel() == e else None, 1e-5)


def test_per_feature_weight_of_shape_1_1_e_fuses():
    model = AddLNBroadcastWeight((1, 1, 32)).eval()
    x, r = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    fused = opfuse.optimize(model, (x, r))
    assert fused.report.counts().get("add_layernorm") == 1, fused.report.counts()
    with torch.no_grad():
        out = fused(x, r)
        torch.testing.assert_close(out, model(x, r))
        torch.testing.assert_close(out.double(), _reference(model, x, r), rtol=1e-5, atol=1e-5)
    assert out.shape == (2, 7, 32)


@pytest.mark.parametrize("weight_shape, x_shape", [((1, 7, 32), (2, 7, 32)),   # varies over rows
                                                    ((1, 1, 32), (7, 32))])     # wider than x: [1, 7, 32] out
def test_weights_that_are_not_per_feature_vectors_do_not_fuse(weight_shape, x_shape):
    model = AddLNBroadcastWeight(weight_shape).eval()
    x, r = torch.randn(x_shape), torch.randn(x_shape)
    fused = opfuse.optimize(model, (x, r))
    counts = fused.report.counts()
    assert "add_layernorm" not in counts and "layernorm" not in counts, counts
    with torch.no_grad():
        out, want = fused(x, r), model(x, r)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want)
