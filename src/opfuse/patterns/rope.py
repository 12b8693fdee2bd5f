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
        return f"RoPE input {match.inputs[x].name} {list(sx)}: head dim D = {d} is odd (rotation takes pairs)"
    slices = [n for n in match.region if n.target is aten.slice.Tensor and n.args[0] is match.inputs[x]]
    spans = sorted((n.args[2] if len(n.args) > 2 else 0, min(n.args[3] if len(n.args) > 3 else d, d),
                    n.args[4] if len(n.args) > 4 else 1) for n in slices)
    want = [(0, d // 2, 1), (d // 2, d, 1)] if layout == "rotate_half" else [(0, d, 2), (1, d, 2)]
    if spans != want:
        return f"slices {spans} are not the {layout} split {want} of head dim {d}"
    layouts = set()
    for name in ("cos", "sin"):
        sc = shape(match.inputs[name])
        ok = sc is not None and len(sc) == 4 and sc[3] == d and sc[0] in (1, sx[0])
        if ok and sc[1] == 1 and sc[2] == sx[2]:
            layouts.add("bhsd")  # x [B, H, S, D], tables [B|1, 1, S, D] (HF Llama / NeoX)
        elif ok and sc[2] == 1 and sc[1] == sx[1]:
            layouts.add("bshd")  # x [B, S, H, D], tables [B|1, S, 1, D] (GPT-J, Falcon-style)
        else:
            return (f"{name} {match.inputs[name].name} has shape {list(sc or [])}; for x {list(sx)} the kernel takes "
                    f"[B or 1, 1, S, D] with x as [B, H, S, D] (S = {sx[2]}) or [B or 1, S, 1, D] with x as "
                    f"[B, S, H, D] (S = {sx[1]})")
    if len(layouts) > 1:
        return (f"cos {match.inputs['cos'].name} {list(shape(match.inputs['cos']))} and sin {match.inputs['sin'].name} "
                f"{list(shape(match.inputs['sin']))} are laid out differently for x {list(sx)}")
    match.params.setdefault("layouts", {})[x] = layouts.pop()
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
        if match.params["layouts"]["q"] != match.params["layouts"]["k"]:
            return (f"q {match.inputs['q'].name} {list(sq)} and k {match.inputs['k'].name} {list(sk)} are laid out "
                    f"differently (one [B, H, S, D], the other [B, S, H, D])")
        seq = 1 if match.params["layouts"]["q"] == "bshd" else 2
        if (sq[0], sq[seq]) != (sk[0], sk[seq]):
            return (f"q {list(sq)} and k {list(sk)} differ in batch B ({sq[0]} vs {sk[0]}) or sequence S "
                    f"({sq[seq]} vs {sk[seq]})")
        return None
    return check


def _heads_first(graph, inputs, params, names):
    """Inputs as the kernel takes them: a [B, S, H, D] layout (and its [B, S, 1, D] tables)
    as transposed views [B, H, S, D] (the kernel reads any strides); the flag says whether
    the outputs must be transposed back."""
    bshd = params.get("layouts", {}).get(names[0]) == "bshd"
    if not bshd:
        return [inputs[n] for n in names], False
    return [graph.call_function(aten.transpose.int, (inputs[n], 1, 2)) for n in names], True


def _back(graph, node, bshd: bool):
    return graph.call_function(aten.transpose.int, (node, 1, 2)) if bshd else node


def _build(layout: str):
    def build(graph, inputs, literals, params):
        (x, cos, sin), bshd = _heads_first(graph, inputs, params, ("x", "cos", "sin"))
        return [_back(graph, graph.call_function(torch.ops.opfuse.rope.default, (x, cos, sin, layout)), bshd)]
    return build


def _build_qk(layout: str):
    def build(graph, inputs, literals, params):
        (q, k, cos, sin), bshd = _heads_first(graph, inputs, params, ("q", "k", "cos", "sin"))
        both = graph.call_function(torch.ops.opfuse.rope_qk.default, (q, k, cos, sin, layout))
        return [_back(graph, graph.call_function(operator.getitem, (both, i)), bshd) for i in (0, 1)]
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
