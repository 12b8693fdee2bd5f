"""Canonicalisation: rewrite spellings that mean the same thing into one form, so one
pattern row covers many (see ../shared/design/MATCHING.md).

Passes (each a small function, applied in order by :func:`canonicalize`):
  drop_noops        eval-mode dropout, contiguous, clone, alias, detach, same-dtype casts -> input
  div_to_mul        x / c (c a Python number) -> x * (1/c)
  normalize_dims    negative dims -> positive (rank from FakeTensor meta); transpose(a,b) sorted
  softmax_dtype     softmax(x, dim, dtype) with dtype == x.dtype -> softmax(x, dim)
  softmax_casts     cast(softmax(cast(x, f32)), x.dtype) and cast(softmax(x, dtype=f32), x.dtype)
                    -> softmax(x) (ATen's CPU/CUDA softmax accumulates half inputs in float32;
                    verification checks the result)
  constant_divs     x / c with c a 0-d tensor computed from constants only (DeBERTa's
                    ``kᵀ / sqrt(tensor(D) · factor)``) -> x * (1/c)
  split_to_chunk    split(x, s, d) with x.shape[d] = n·s (n ≥ 2) -> chunk(x, n, d), d counted
                    from the end (torch.export's decompositions turn ``chunk`` into ``split``)
  addmm_to_linear   view(addmm(b, view(x, [-1, K]), W[K, N]), [..., N]) (GPT-2's Conv1D)
                    -> linear(x, Wᵀ, b) with Wᵀ a new contiguous parameter [N, K]

Erf-GELU and tanh-GELU are deliberately NOT unified: they are different functions.
"""

from __future__ import annotations

import math
from operator import attrgetter

import torch
from torch import fx

from .args import arg
from .meta import VIEW_OPS
from .state import foldable, note_derived

aten = torch.ops.aten

# Ops that compute the same value as their first argument (in inference).
_IDENTITY = {aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
             aten.lift_fresh_copy.default}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default}


def _rank(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _same_tensor_type(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.device == vb.device and va.shape == vb.shape)


def _is_noop(node: fx.Node) -> bool:
    t = node.target
    if t is aten.dropout.default:
        return arg(node, "train") is False or arg(node, "p") == 0.0
    if t in _IDENTITY:
        return True
    if t in _CASTS and isinstance(node.args[0], fx.Node):
        return _same_tensor_type(node, node.args[0])
    return False


_VIEWS_NEEDING_STRIDES = {aten.view.default, aten._unsafe_view.default}


def _same_strides(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape \
        and va.stride() == vb.stride()


def _droppable(node: fx.Node) -> bool:
    """A no-op is dropped only where its input's layout serves every consumer: the same
    strides, or (``x.permute(...).contiguous().view(...)``) consumers that are all
    ``view``s, which then become ``reshape`` (a copy only where the strides need one).
    Any other view-like consumer of a layout-changing copy keeps the copy."""
    if node.target not in _IDENTITY or _same_strides(node, node.args[0]):
        return True
    users = list(node.users)
    if users and all(u.op == "call_function" and u.target in _VIEWS_NEEDING_STRIDES and u.args[0] is node
                     for u in users):
        for u in users:
            u.target = aten.reshape.default
        return True
    return not any(u.op == "call_function" and u.target in VIEW_OPS for u in users)


def drop_noops(graph: fx.Graph) -> int:
    """Replace no-op nodes by their input, and drop export's metadata assertions
    (``_assert_tensor_metadata``: checks on a cast that canonicalisation may remove);
    returns how many were removed. Values only: the captured graph is functional (see
    :func:`opfuse.graph.capture.capture`), so a dropped ``clone`` never shares storage
    with a later in-place write; layouts are kept where a ``view`` needs them
    (:func:`_droppable`)."""
    removed = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
            removed += 1
            continue
        if node.op == "call_function" and _is_noop(node) and isinstance(node.args[0], fx.Node) and _droppable(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
    return removed


def div_to_mul(graph: fx.Graph) -> int:
    """``div(x, c)`` with a Python number ``c`` -> ``mul(x, 1/c)``."""
    changed = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.div.Tensor and len(node.args) == 2 \
                and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool) \
                and node.args[1] != 0 and not node.kwargs.get("rounding_mode"):
            node.target = aten.mul.Tensor
            node.args = (node.args[0], 1.0 / node.args[1])
            changed += 1
        elif node.op == "call_function" and node.target is aten.div.Scalar:
            node.target = aten.mul.Tensor
            node.args = (node.args[0], 1.0 / node.args[1])
            changed += 1
    return changed


def normalize_dims(graph: fx.Graph) -> int:
    """Negative dims -> positive, using the input's rank; transpose dims sorted."""
    changed = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        rank = _rank(node.args[0]) if node.args else None
        if rank is None:
            continue
        if node.target is aten.transpose.int:
            a, b = sorted(d % rank for d in node.args[1:3])
            if (a, b) != tuple(node.args[1:3]):
                node.args = (node.args[0], a, b)
                changed += 1
        elif node.target in (aten.softmax.int, aten._softmax.default) and isinstance(node.args[1], int):
            if node.args[1] < 0:
                node.args = (node.args[0], node.args[1] % rank, *node.args[2:])
                changed += 1
    return changed


def softmax_dtype(graph: fx.Graph) -> int:
    """Drop a softmax ``dtype`` argument equal to the input's dtype (a no-op cast)."""
    changed = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.softmax.int and len(node.args) > 2:
            val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            if val is not None and node.args[2] == val.dtype:
                node.args = node.args[:2]
                changed += 1
    return changed


_CONSTANT_OPS = {aten.sqrt.default, aten.rsqrt.default, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor,
                 aten.sub.Tensor, aten.reciprocal.default, aten.pow.Tensor_Scalar, aten._to_copy.default,
                 aten.to.dtype} | _IDENTITY


def _constant_value(gm: fx.GraphModule, node, depth: int = 0):
    """The value of ``node`` when it is computed from unwritten constant tensors of at most
    one element and Python numbers only (else None): evaluated here, once."""
    if not isinstance(node, fx.Node):
        return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None
    if depth > 8:
        return None
    if node.op == "get_attr" and foldable(gm, node):
        value = attrgetter(node.target)(gm)
        return value.detach() if isinstance(value, torch.Tensor) and value.numel() == 1 else None
    if node.op != "call_function" or node.target not in _CONSTANT_OPS:
        return None
    args = [_constant_value(gm, a, depth + 1) for a in node.args]
    if any(v is None for v in args) or not any(isinstance(v, torch.Tensor) for v in args):
        return None
    with torch.no_grad():
        return node.target(*args, **node.kwargs)


def constant_divs(gm: fx.GraphModule) -> int:
    """``div.Tensor(x, c)`` with ``c`` a one-element constant computed from constants ->
    ``mul(x, 1/c)`` (a number), so the scale binds as a literal like ``x / math.sqrt(d)``."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.div.Tensor or node.kwargs.get("rounding_mode") \
                or not isinstance(node.args[1], fx.Node):
            continue
        c = _constant_value(gm, node.args[1])
        if isinstance(c, torch.Tensor) and c.dim() == 0 and c.is_floating_point() and float(c) != 0.0 \
                and math.isfinite(float(c)):
            node.target = aten.mul.Tensor
            node.args = (node.args[0], 1.0 / float(c))
            changed += 1
    return changed


def split_to_chunk(graph: fx.Graph) -> int:
    """``split.Tensor(x, s, d)`` into n ≥ 2 equal pieces -> ``chunk(x, n, d)`` with ``d``
    negative (from the last dim), so patterns written with ``chunk(2, -1)`` match either
    spelling at any rank."""
    changed = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (aten.split.Tensor, aten.chunk.default):
            continue
        rank = _rank(node.args[0])
        x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if rank is None or x is None or not isinstance(dim, int):
            continue
        neg = dim - rank if dim >= 0 else dim
        if node.target is aten.chunk.default:
            if neg != dim:
                node.args = (node.args[0], node.args[1], neg)
                node.kwargs = {}
                changed += 1
            continue
        size, piece = x.shape[dim], node.args[1]
        if isinstance(size, int) and isinstance(piece, int) and piece > 0 and size % piece == 0 and size // piece >= 2:
            node.target = aten.chunk.default
            node.args = (node.args[0], size // piece, neg)
            node.kwargs = {}
            changed += 1
    return changed


def _cast_dtype(node) -> torch.dtype | None:
    """Target dtype of a cast node, None if ``node`` is not a cast."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS):
        return None
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def softmax_casts(graph: fx.Graph) -> int:
    """Softmax computed in float32 on a half-precision input and cast back -> softmax."""
    changed = 0
    for node in list(graph.nodes):
        out_dtype = _cast_dtype(node)
        sm = node.args[0] if out_dtype is not None else None
        if not (isinstance(sm, fx.Node) and sm.target is aten.softmax.int and len(sm.users) == 1):
            continue
        src = sm.args[0]
        if _cast_dtype(src) == torch.float32 and isinstance(src.args[0], fx.Node) and len(src.users) == 1:
            x = src.args[0]
        elif len(sm.args) > 2 and sm.args[2] == torch.float32:
            x = src
        else:
            continue
        xval = x.meta.get("val")
        if not isinstance(xval, torch.Tensor) or xval.dtype != out_dtype:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(aten.softmax.int, (x, sm.args[1]))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        for dead in (node, sm, src):
            if isinstance(dead, fx.Node) and not dead.users and dead is not x:
                graph.erase_node(dead)
        changed += 1
    return changed


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def addmm_to_linear(gm: fx.GraphModule) -> int:
    """GPT-2's Conv1D (``addmm`` on a flattened input with a [K, N] weight) -> ``linear``
    with the weight transposed once into a new contiguous parameter."""
    changed = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default or node.kwargs:
            continue
        bias, mat1, weight = node.args[:3]
        if not (isinstance(weight, fx.Node) and foldable(gm, weight) and isinstance(mat1, fx.Node)
                and mat1.op == "call_function" and mat1.target in (aten.view.default, aten.reshape.default)):
            continue
        x = mat1.args[0]
        xs, ws = _shape(x), _shape(weight)
        users = list(node.users)
        if xs is None or ws is None or len(users) != 1 or users[0].target not in (aten.view.default, aten.reshape.default):
            continue
        out = users[0]
        if _shape(out) != xs[:-1] + (ws[1],):
            continue
        obj = attrgetter(weight.target)(gm)
        name = "opfuse_t_" + weight.target.replace(".", "_")
        if not hasattr(gm, name):
            gm.register_buffer(name, obj.detach().t().contiguous())
            note_derived(gm, name, [weight.target])
            # the [K, N] original is what the ``wt`` GEMM backend would copy back: it reads this
            gm.meta.setdefault("opfuse_transposed_of", {})[name] = obj
        with graph.inserting_before(out):
            wt = graph.get_attr(name)
            wt.meta["val"] = weight.meta["val"].new_empty((ws[1], ws[0]))
            lin = graph.call_function(aten.linear.default, (x, wt, bias))
        lin.meta.update(out.meta)
        out.replace_all_uses_with(lin)
        for dead in (out, node, mat1):
            if not dead.users:
                graph.erase_node(dead)
        changed += 1
    return changed


def canonicalize(gm_or_graph) -> fx.Graph:
    """Apply every canonicalisation pass in place; returns the graph."""
    graph = gm_or_graph.graph if isinstance(gm_or_graph, fx.GraphModule) else gm_or_graph
    drop_noops(graph)
    div_to_mul(graph)
    normalize_dims(graph)
    softmax_dtype(graph)
    softmax_casts(graph)
    split_to_chunk(graph)
    if isinstance(gm_or_graph, fx.GraphModule):
        constant_divs(gm_or_graph)
        addmm_to_linear(gm_or_graph)
    graph.lint()
    if isinstance(gm_or_graph, fx.GraphModule):
        gm_or_graph.recompile()
    return graph
