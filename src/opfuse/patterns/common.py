"""Helpers shared by pattern rows: metadata access and small legality checks."""

from __future__ import annotations

import torch
from torch import fx

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def val(node) -> torch.Tensor | None:
    """FakeTensor of ``node`` (None for literals/None)."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def shape(node) -> tuple[int, ...] | None:
    v = val(node)
    return tuple(v.shape) if v is not None else None


def check_float(match, *names: str) -> str | None:
    for name in names:
        v = val(match.inputs.get(name))
        if v is not None and v.dtype not in FLOAT_DTYPES:
            return f"input '{name}' ({match.inputs[name].name}) has dtype {v.dtype}; kernels support {FLOAT_DTYPES}"
    return None


def check_same_shape(match, a: str, b: str) -> str | None:
    sa, sb = shape(match.inputs[a]), shape(match.inputs[b])
    if sa != sb:
        user = next((n.name for n in match.region if match.inputs[a] in n.all_input_nodes), "?")
        return (f"check equal-shapes failed at {user}: operands broadcast: {match.inputs[a].name} has shape {list(sa or [])} but "
                f"{match.inputs[b].name} has shape {list(sb or [])}; the kernel needs equal shapes")
    return None


def check_vector(match, name: str, n: int, optional: bool = True) -> str | None:
    node = match.inputs.get(name)
    if node is None:
        return None if optional else f"input '{name}' is missing (None); the kernel needs it"
    s = shape(node)
    if s == (n,):
        return None
    x = shape(match.inputs.get("x"))
    if s and s[-1] == n and all(d == 1 for d in s[:-1]) and x is not None and len(s) <= len(x):
        # per-feature, broadcast-shaped ((1, 1, N) LayerNorm weights): the same values as an
        # [N] vector, and no wider result than x's rank; the rewrite passes it reshaped
        match.params.setdefault("as_vector", {})[name] = n
        return None
    return (f"'{name}' ({node.name}) has shape {list(s or [])}, kernel supports only [{n}] (or [1, …, 1, {n}] "
            f"of at most x's rank {len(x) if x else '?'})")


def vector_inputs(graph: fx.Graph, inputs: dict, params: dict) -> dict:
    """``inputs`` with every broadcast-shaped per-feature vector that :func:`check_vector`
    accepted (``params["as_vector"]``) reshaped to [N] by one ``aten.reshape`` node."""
    wanted = params.get("as_vector") or {}
    if not wanted:
        return inputs
    out = dict(inputs)
    for name, n in wanted.items():
        if isinstance(out.get(name), fx.Node):
            src = out[name]
            out[name] = graph.call_function(torch.ops.aten.reshape.default, (src, [n]))
            if val(src) is not None:  # shapes for the matcher and checks of later passes
                out[name].meta["val"] = val(src).reshape(n)
    return out


def zeros_vector(graph: fx.Graph, like: fx.Node, n: int) -> fx.Node:
    """``new_zeros(like, [n])``: zeros [n] of ``like``'s dtype, the bias of a linear that has
    none (``x @ Wᵀ + 0`` is ``x @ Wᵀ``); the rewrite folds it into a constant once."""
    return graph.call_function(torch.ops.aten.new_zeros.default, (like, [int(n)]))


def check_linear(match, x: str, w: str, b: str | None) -> str | None:
    sw = shape(match.inputs[w])
    sx = shape(match.inputs[x])
    if sw is None or len(sw) != 2:
        return f"weight {match.inputs[w]} has shape {list(sw or [])}, not a 2-D [out_features, in_features] tensor"
    if sx is None or sx[-1] != sw[1]:
        return (f"input {match.inputs[x]} last dim (in_features) {sx and sx[-1]} != weight {match.inputs[w]} "
                f"in_features {sw[1]}")
    if b is not None:
        return check_vector(match, b, sw[0])
    return None


def first_problem(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r), None)
