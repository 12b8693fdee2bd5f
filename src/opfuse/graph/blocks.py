"""Repeated blocks (``encoder.layer.0``, ``h.3``...) and op sequences in the seed's
notation (``Linear MatMul Softmax MatMul Linear Add LN ...``)."""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch import fx

from .meta import VIEW_OPS

aten = torch.ops.aten

_SHORT = {
    aten.linear.default: "Linear", aten.matmul.default: "MatMul", aten.bmm.default: "MatMul",
    aten.softmax.int: "Softmax", aten._softmax.default: "Softmax", aten.add.Tensor: "Add",
    aten.mul.Tensor: "Mul", aten.layer_norm.default: "LN", aten.gelu.default: "GELU",
    aten.scaled_dot_product_attention.default: "SDPA", aten.where.self: "Where", aten.silu.default: "SiLU",
}
_BLOCK = re.compile(r"^(.*\.\d+)$")


def block_of(node: fx.Node) -> str | None:
    """Innermost module path ending in an index (one element of a ModuleList)."""
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    for path, _type in stack.values():
        if _BLOCK.match(path):
            found = path
    return found


def first_block(graph: fx.Graph) -> str | None:
    """The first block of the most frequent kind (``encoder.layer.0``)."""
    kinds = Counter()
    first: dict[str, str] = {}
    for n in graph.nodes:
        b = block_of(n)
        if b:
            kind = re.sub(r"\d+$", "#", b)
            kinds[kind] += 1
            first.setdefault(kind, b)
    return first[kinds.most_common(1)[0][0]] if kinds else None


def op_name(node: fx.Node) -> str | None:
    """Short name of a compute node; None for views, constants and bookkeeping."""
    if node.op != "call_function" or node.target in VIEW_OPS or "getitem" in str(node.target):
        return None
    gemm = node.target is aten.linear.default or "mkldnn._linear_pointwise" in str(node.target)
    if node.meta.get("opfuse_pattern") and (gemm or "opfuse" in str(node.target)):
        return f"[{node.meta['opfuse_pattern']}]"  # a fused region, by its pattern's name (as the report's tables)
    if "opfuse" in str(node.target):  # an op a later pass made (no pattern): its own name
        return "[" + str(node.target).split(".")[1] + "]"
    if gemm:
        return "Linear"
    if node.target in _SHORT:
        return _SHORT[node.target]
    return None


def op_sequence(graph: fx.Graph, block: str | None, planned: dict | None = None) -> list[str]:
    """Compute ops of ``block`` in graph order. ``planned`` maps nodes to the name of the
    fused op that will replace them (``explain``): each planned region appears once, as
    ``[name]``, where its first node was."""
    out, seen = [], set()
    for n in graph.nodes:
        if block is not None and block_of(n) != block:
            continue
        if planned and n in planned:
            if id(planned[n]) not in seen:
                seen.add(id(planned[n]))
                out.append(f"[{planned[n][0]}]")
            continue
        name = op_name(n)
        if name is not None and not (out and name == out[-1] and name.startswith("[")):  # a region's nodes once
            out.append(name)
    return out
