"""Rotary position embedding (Su et al. 2021, "RoFormer"), applied to Q or K in one pass.

rotate_half (GPT-NeoX / HF Llama: halves [x1 | x2] rotated as (-x2, x1))::

    x [B,H,S,D] --slice(D/2:)--neg--\\
              \\--slice(:D/2)--------cat--> r --·sin--\\
     \\--·cos------------------------------------------ add --> out   ==> opfuse.rope(x, cos, sin, "rotate_half")

interleaved (GPT-J: pairs (x[2i], x[2i+1]) rotated as (-x[2i+1], x[2i]))::

    x --slice(1::2)--neg--\\
     \\--slice(0::2)------stack(-1)--flatten(-2)--> r; out = x·cos + r·sin   ==> opfuse.rope(x, cos, sin, "interleaved")

The two layouts are different functions: each row binds its own kernel layout.
Unfused: 2 slices (views), neg, cat, 2 muls and an add each read and write [B,H,S,D].

qk (one region per attention layer: q and k rotated with the same cos / sin, a multi-root
row per layout; the single-tensor rows stay as the fallback for a model that rotates one)::

    q [B,H,S,D] --rope(cos, sin)--> q_out
    k [B,Hkv,S,D] --rope(cos, sin)--> k_out   ==> q_out, k_out = opfuse.rope_qk(q, k, cos, sin, layout)
    (cos / sin staged once for both; same layout for q and k, never mixed)
"""

from __future__ import annotations

import operator

import torch

from .common import check_float, shape
from .engine import IGNORE, Pattern

aten = torch.ops.aten


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_rotate_half(x, cos, sin):
    return (x * cos) + (rotate_half(x) * sin)


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rope_interleaved(x, cos, sin):
    return (x * cos) + (rotate_every_two(x) * sin)


def rope_qk_rotate_half(q, k, cos, sin):
    return rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin)


def rope_qk_interleaved(q, k, cos, sin):
    return rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin)


def _example():
    return torch.randn(2, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)


def _example_qk():  # k with fewer heads (GQA); four distinct tensors (export merges equal ones)
    return torch.randn(2, 2, 4, 8), torch.randn(2, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)


def _check_one(match, layout: str, x: str) -> str | None:
    """Input ``x`` is [B,H,S,D] with D even, split by the ``layout`` slices, and cos / sin
    broadcast as [B or 1, 1, S, D]."""
    sx = shape(match.inputs[x])
    if sx is None or len(sx) != 4:
        return f"RoPE input {match.inputs[x].name} must be [B,H,S,D], got {sx}"
    d = sx[-1]
    if d % 2:
        return f"head dim {d} is odd"
    slices = [n for n in match.region if n.target is aten.slice.Tensor and n.args[0] is match.inputs[x]]
    spans = sorted((n.args[2] if len(n.args) > 2 else 0, min(n.args[3] if len(n.args) > 3 else d, d),
                    n.args[4] if len(n.args) > 4 else 1) for n in slices)
    want = [(0, d // 2, 1), (d // 2, d, 1)] if layout == "rotate_half" else [(0, d, 2), (1, d, 2)]
    if spans != want:
        return f"slices {spans} are not the {layout} split {want} of head dim {d}"
    for name in ("cos", "sin"):
        sc = shape(match.inputs[name])
        target = (sx[0], 1, sx[2], d)
        if sc is None or len(sc) != 4 or sc[1] != 1 or sc[3] != d or sc[2] != sx[2] or sc[0] not in (1, sx[0]):
            return f"{name} {match.inputs[name].name} has shape {sc}, kernel expects [B or 1, 1, S, D] = {target}"
    return check_float(match, x, "cos", "sin")


def _check(layout: str):
    def check(match) -> str | None:
        return _check_one(match, layout, "x")
    return check


def _check_qk(layout: str):
    def check(match) -> str | None:
        problem = _check_one(match, layout, "q") or _check_one(match, layout, "k")
        if problem:
            return problem
        sq, sk = shape(match.inputs["q"]), shape(match.inputs["k"])
        if (sq[0], sq[2]) != (sk[0], sk[2]):
            return f"q {list(sq)} and k {list(sk)} differ in batch or sequence length"
        return None
    return check


def _build(layout: str):
    def build(graph, inputs, literals, params):
        return [graph.call_function(torch.ops.opfuse.rope.default, (inputs["x"], inputs["cos"], inputs["sin"], layout))]
    return build


def _build_qk(layout: str):
    def build(graph, inputs, literals, params):
        both = graph.call_function(torch.ops.opfuse.rope_qk.default,
                                   (inputs["q"], inputs["k"], inputs["cos"], inputs["sin"], layout))
        return [graph.call_function(operator.getitem, (both, 0)), graph.call_function(operator.getitem, (both, 1))]
    return build


_LITERALS = {"start": IGNORE, "end": IGNORE, "step": IGNORE}

PATTERNS = [
    Pattern("rope", "qk_rotate_half", rope_qk_rotate_half, _example_qk, _build_qk("rotate_half"),
            _check_qk("rotate_half"), literals=_LITERALS),
    Pattern("rope", "qk_interleaved", rope_qk_interleaved, _example_qk, _build_qk("interleaved"),
            _check_qk("interleaved"), literals=_LITERALS),
    Pattern("rope", "rotate_half", rope_rotate_half, _example, _build("rotate_half"), _check("rotate_half"),
            literals=_LITERALS),
    Pattern("rope", "interleaved", rope_interleaved, _example, _build("interleaved"), _check("interleaved"),
            literals=_LITERALS),
]
