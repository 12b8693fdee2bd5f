"""Refusal messages (issue #14): every refusal names the node, the check and the values seen,
in the model's own terms — heads, sequence, head dim, batch — never mislabelled. Each case
runs a pattern's legality check on placeholders with the given shapes."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from opfuse.patterns import attention, qkv_merge, rope


class _Match:
    """A structural match's inputs as graph placeholders with FakeTensor values."""

    def __init__(self, pattern, shapes: dict, literals: dict | None = None, get_attr=()):
        g = torch.fx.Graph()
        self.inputs, self.literals, self.params, self.region, self.pattern = {}, dict(literals or {}), {}, [], pattern
        with FakeTensorMode():
            vals = {n: torch.empty(s) for n, s in shapes.items()}
        for name, v in vals.items():
            node = g.get_attr(name) if name in get_attr else g.placeholder(name)
            node.meta["val"] = v
            self.inputs[name] = node


def _pattern(module, variant):
    return next(p for p in module.PATTERNS if p.variant == variant)


@pytest.mark.parametrize("q, k, v, words", [
    ((1, 4, 8, 16), (1, 4, 8, 32), (1, 4, 8, 32), ["head dim D", "16", "32"]),
    ((1, 4, 8, 16), (1, 4, 8, 16), (1, 4, 9, 16), ["key/value sequence Sk", "8", "9"]),
    ((1, 4, 8, 16), (1, 2, 8, 16), (1, 1, 8, 16), ["key/value heads", "2", "1"]),
    ((2, 4, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16), ["batch B", "2", "1"]),
    ((1, 6, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16), ["key/value heads (4", "query heads (6"]),
    ((4, 8, 16), (4, 8, 16), (4, 8, 16), ["4-D [B, H, S, D]", "q q"]),
])
def test_attention_refusals_name_the_dim(q, k, v, words):
    reason = attention.check(_Match(_pattern(attention, "sdpa"), {"q": q, "k": k, "v": v}, {"scale": 0.25}))
    assert reason and all(w in reason for w in words), reason


def test_attention_mask_refusal_names_the_target_shape():
    m = _Match(_pattern(attention, "sdpa_mask"), {"q": (2, 4, 8, 16), "k": (2, 4, 10, 16), "v": (2, 4, 10, 16),
                                                 "mask": (2, 1, 8, 9)}, {"scale": 0.25})
    reason = attention.check(m)
    assert "mask mask has shape (2, 1, 8, 9)" in reason and "[B, H, Sq, Sk] = [2, 4, 8, 10]" in reason, reason


def test_rope_refusals_name_head_dim_and_layouts():
    odd = _Match(_pattern(rope, "rotate_half"), {"x": (1, 2, 5, 7), "cos": (1, 1, 5, 7), "sin": (1, 1, 5, 7)})
    reason = rope._check_one(odd, "rotate_half", "x")
    assert "head dim D = 7 is odd" in reason and "x [1, 2, 5, 7]" in reason, reason


def test_qkv_refusal_lists_each_weight():
    m = _Match(_pattern(qkv_merge, "three_linear"),
               {"x": (2, 8), "wq": (8, 8), "bq": (8,), "wk": (8, 6), "bk": (8,), "wv": (8, 8), "bv": (8,)},
               get_attr=("wq", "bq", "wk", "bk", "wv", "bv"))
    reason = qkv_merge.check(m)
    assert "in_features" in reason and "wk [8, 6]" in reason and "wq [8, 8]" in reason, reason
