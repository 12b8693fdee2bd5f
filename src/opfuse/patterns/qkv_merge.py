"""QKV projection merge: three Linear layers reading the same input become one GEMM on
the concatenated weight [Wq|Wk|Wv], then a split (views, no copy). The input X is read
once instead of three times and one GEMM replaces three launches (a multi-root pattern).

::

        x [..., E]
     /     |     \\
  linear linear linear        Wq [Nq,E]  Wk [Nk,E]  Wv [Nv,E]
     |     |     |
     q     k     v      ==>   y = linear(x, [Wq;Wk;Wv], [bq;bk;bv]);  q, k, v = split(y, [Nq,Nk,Nv], -1)

A projection without a bias (Whisper's k_proj) contributes zeros to the merged bias.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from .common import check_float, first_problem, shape, val, zeros_vector
from .engine import Pattern

aten = torch.ops.aten


def qkv(x, wq, bq, wk, bk, wv, bv):
    return F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)


def _example():
    return (torch.randn(2, 4, 8),) + tuple(t for _ in range(3) for t in (torch.randn(8, 8), torch.randn(8)))


def check(match) -> str | None:
    ws = [match.inputs[n] for n in ("wq", "wk", "wv")]
    bs = [match.inputs[n] for n in ("bq", "bk", "bv")]
    for w in ws:
        if w.op != "get_attr":
            return f"weight {w.name} is computed at run time, not a parameter; cannot pre-concatenate"
    if len({val(w).dtype for w in ws}) != 1 or len({shape(w)[1] for w in ws}) != 1:
        return ("Q/K/V weights differ in dtype or in_features: "
                + ", ".join(f"{w.name} {list(shape(w))} {val(w).dtype}" for w in ws))
    for b in bs:
        if b is not None and b.op != "get_attr":
            return f"bias {b.name} is computed at run time, not a parameter; cannot pre-concatenate"
    if len({val(b).dtype for b in bs if b is not None} | {val(ws[0]).dtype}) != 1:
        return ("Q/K/V biases differ in dtype from the weights (" + str(val(ws[0]).dtype) + "): "
                + ", ".join(f"{b.name} {val(b).dtype}" for b in bs if b is not None))
    match.params["sizes"] = [shape(w)[0] for w in ws]
    return check_float(match, "x")


def build(graph, inputs, literals, params):
    w = graph.call_function(aten.cat.default, ([inputs["wq"], inputs["wk"], inputs["wv"]], 0))
    b = None
    biases = [inputs["bq"], inputs["bk"], inputs["bv"]]
    if any(x is not None for x in biases):  # a missing bias is zeros (folded with the others)
        like = next(x for x in biases if x is not None)
        biases = [x if x is not None else zeros_vector(graph, like, n) for x, n in zip(biases, params["sizes"])]
        b = graph.call_function(aten.cat.default, (biases, 0))
    y = graph.call_function(aten.linear.default, (inputs["x"], w, b))
    parts = graph.call_function(aten.split_with_sizes.default, (y, params["sizes"], -1))
    return [graph.call_function(operator.getitem, (parts, i)) for i in range(3)]


PATTERNS = [Pattern("qkv_merge", "three_linear", qkv, _example, build, check, decide_by="time")]
