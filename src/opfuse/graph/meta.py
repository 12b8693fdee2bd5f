"""Bytes and FLOPs of one FX node, read from its FakeTensor metadata.

Convention (the seed's memory-traffic model): an unfused op reads each of its tensor
inputs once and writes each of its outputs once; view-like ops (view, transpose,
expand, split, getitem...) move no bytes. FLOP counts follow the usual conventions
(a GEMM [M,K]x[K,N] is 2·M·N·K; see e.g. Kaplan et al. 2020, "Scaling laws", Table 1).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import fx

aten = torch.ops.aten

VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.t.default, aten.alias.default,
    aten.detach.default, aten.unflatten.int, aten.flatten.using_ints,
}

# FLOPs per output element for element-wise and normalisation ops (approximate, stated
# once here: add/mul 1; GELU ~8 (erf polynomial); softmax 5 (max, sub, exp, sum, div);
# LayerNorm 8 (two reductions, normalise, affine)).
_FLOPS_PER_ELEMENT = {
    aten.add.Tensor: 1, aten.sub.Tensor: 1, aten.mul.Tensor: 1, aten.div.Tensor: 1,
    aten.gelu.default: 8, aten.silu.default: 4, aten.tanh.default: 4, aten.softmax.int: 5,
    aten._softmax.default: 5, aten.layer_norm.default: 8, aten.rsqrt.default: 1,
    aten.pow.Tensor_Scalar: 1, aten.mean.dim: 1, aten.where.self: 1, aten.where.ScalarOther: 1,
    aten.neg.default: 1, aten.exp.default: 4,
}


def tensor_values(value) -> list[torch.Tensor]:
    """Flatten a node value (tensor, tuple, list) to its tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensor_values(v)]
    return []


#: {symbol name: size} a dynamic plan is decided at (the example inputs' sizes; the capture's
#: own hints are those of its widened inputs), set by :func:`decided_at`.
_SIZES: list[dict] = [{}]


@contextmanager
def decided_at(sizes: dict):
    """Within the block, :func:`concrete` evaluates symbolic sizes at ``sizes`` ({symbol
    name: int}) instead of the capture's hints."""
    _SIZES.append(sizes)
    try:
        yield
    finally:
        _SIZES.pop()


def concrete(x) -> int:
    """``x`` as a Python int: a symbolic size (``torch.SymInt`` of a dynamic capture) at
    the size the plan is decided at (:func:`decided_at`, else ``optimization_hint``); no
    guard is added, so a cost decision never specialises the graph."""
    if isinstance(x, torch.SymInt):
        expr = x.node.expr
        sizes = _SIZES[-1]
        if sizes and all(sym.name in sizes for sym in expr.free_symbols):
            return int(expr.xreplace({sym: sizes[sym.name] for sym in expr.free_symbols}))
        from torch.fx.experimental.symbolic_shapes import optimization_hint
        return int(optimization_hint(x))
    return x


def nbytes(value) -> int:
    """Bytes of the tensors in ``value`` (numel × element size), 0 for non-tensors; a
    dynamic capture's symbolic sizes count at their example values (:func:`concrete`)."""
    return sum(concrete(t.numel()) * t.element_size() for t in tensor_values(value))


def node_value(node) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def input_nodes(node: fx.Node) -> list[fx.Node]:
    """Distinct tensor-producing input nodes of ``node``, in argument order."""
    seen: dict[fx.Node, None] = {}
    for n in node.all_input_nodes:
        if tensor_values(node_value(n)):
            seen[n] = None
    return list(seen)


def reshape_copies(node: fx.Node) -> bool:
    """``node`` is a ``reshape`` whose input's strides allow no view of the new shape, so it
    materialises a copy: HF's ``repeat_kv`` (``expand`` of the K/V heads, then ``reshape``)
    writes n_rep copies of the cache per layer and step."""
    if node.op != "call_function" or node.target is not aten.reshape.default:
        return False
    src, out = node_value(node.args[0]) if isinstance(node.args[0], fx.Node) else None, node_value(node)
    if src is None or out is None:
        return False
    try:
        src.view(out.shape)
    except (RuntimeError, ValueError):  # eager raises RuntimeError, FakeTensor's view ValueError
        return True
    except Exception:  # noqa: BLE001  no fake mode to ask: counted as the view it usually is
        return False
    return False


def node_bytes(node: fx.Node) -> tuple[int, int]:
    """(bytes read, bytes written) of ``node`` run as its own kernel (views are free; a
    reshape that must copy, :func:`reshape_copies`, reads its input and writes its output)."""
    if node.op != "call_function" or node.target is __import__("operator").getitem:
        return 0, 0
    if node.target in VIEW_OPS and not reshape_copies(node):
        return 0, 0
    read = sum(nbytes(node_value(n)) for n in input_nodes(node))
    return read, nbytes(node_value(node))


def node_flops(node: fx.Node) -> int:
    """Floating-point operations of ``node`` (multiply and add counted separately; symbolic
    sizes at their example values)."""
    return concrete(_node_flops(node))


def _node_flops(node: fx.Node):
    if node.op != "call_function":
        return 0
    out = node_value(node)
    t = node.target
    if t in (aten.linear.default, aten.addmm.default, aten.mm.default):
        x, w = (node.args[0], node.args[1]) if t is not aten.addmm.default else (node.args[1], node.args[2])
        xv, wv = node_value(x), node_value(w)
        if xv is None or wv is None:
            return 0
        k = xv.shape[-1]
        return 2 * out.numel() * k
    if t in (aten.matmul.default, aten.bmm.default):
        k = node_value(node.args[0]).shape[-1]
        return 2 * out.numel() * k
    if t is aten.scaled_dot_product_attention.default:
        q, k = node_value(node.args[0]), node_value(node.args[1])
        b_h = math.prod(q.shape[:-2])
        sq, d = q.shape[-2], q.shape[-1]
        sk = k.shape[-2]
        return b_h * (4 * sq * sk * d + 5 * sq * sk)
    per = _FLOPS_PER_ELEMENT.get(t, 0)
    return per * sum(v.numel() for v in tensor_values(out))


def input_signature(args: tuple, kwargs: dict, wildcards: frozenset = frozenset()) -> tuple:
    """(shape, dtype, device, contiguity) of every tensor input, plus non-tensor values: the
    key of a plan (FusedModule, the compile backend) and of a region's measured times.
    ``wildcards``: (input, dim) pairs — input a positional index or a keyword name — whose
    size is left out (None): the key of a dynamic plan (:mod:`opfuse.graph.dynamic`)."""
    def one(v, where=None):
        if isinstance(v, torch.Tensor):
            shape = tuple(v.shape)
            if wildcards and where is not None:
                shape = tuple(None if (where, d) in wildcards else n for d, n in enumerate(shape))
            return ("T", shape, v.dtype, v.device.type, v.is_contiguous())
        if isinstance(v, (list, tuple)):
            return tuple(one(x) for x in v)
        return ("V", repr(v))
    return (tuple(one(a, i) for i, a in enumerate(args)), tuple(sorted((k, one(v, k)) for k, v in kwargs.items())))
