"""Spellings: hand-written forms of standard ops, rewritten to the canonical ATen op
before matching so one fusion row covers them (the respell pass). Each row is exact:
the same function, only spelled differently; the GELU forms stay distinct.

  gelu_tanh      0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))     -> aten.gelu(x, approximate="tanh")
                 (Hendrycks & Gimpel 2016, eq. for the tanh approximation; GPT-2's "gelu_new")
  gelu_tanh_factored  x·0.5·(1 + tanh(c·x·(1 + 0.044715·x²))), c = √(2/π) or Bloom's
                 0.79788456 (√(2/π) to 8 digits: 1e-9 relative on tanh's argument, below
                 float32 resolution)                              -> aten.gelu(x, approximate="tanh")
  gelu_erf       x·0.5·(1 + erf(x/√2))                           -> aten.gelu(x)   (exact GELU)
  layer_norm     mean, subtract, pow(2).mean | var(unbiased=False), + eps, rsqrt | sqrt+div,
                 · γ + β                                          -> aten.layer_norm(x, [N], γ, β, eps)
                 (Ba, Kiros & Hinton 2016)
  linear         x @ W.T | matmul(x, W.t()), W 2-D                -> aten.linear(x, W)   (Falcon's Linear)
"""

from __future__ import annotations

import math

import torch

from .common import check_vector, first_problem, shape
from .engine import IGNORE, Pattern

aten = torch.ops.aten
_EPS = 1e-5  # any value: bound from the model ("eps")


def gelu_tanh_pow(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh_cube(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def gelu_tanh_factored(x):
    return x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def gelu_tanh_bloom(x):
    """Bloom's ``bloom_gelu_forward`` (Megatron-DeepSpeed), its constant to 8 digits."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def gelu_erf(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_erf_b(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def ln_sqrt_div(x, g, b):
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    return g * ((x - u) / torch.sqrt(s + _EPS)) + b


def ln_rsqrt(x, g, b):
    u = x.mean(-1, keepdim=True)
    d = x - u
    return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + _EPS) * g + b


def ln_var(x, g, b):
    u = x.mean(-1, keepdim=True)
    v = x.var(-1, keepdim=True, unbiased=False)
    return (x - u) / torch.sqrt(v + _EPS) * g + b


def linear_matmul_permute(x, w):
    return torch.matmul(x, w.permute(1, 0))  # ``x @ w.T`` as torch.export records it


def linear_matmul_t(x, w):
    return torch.matmul(x, w.t())


def _x():
    return (torch.randn(2, 4, 8),)


def _xw():
    return torch.randn(2, 4, 8), torch.randn(6, 8)


def _check_linear_t(match) -> str | None:
    """``x @ W.T`` is ``linear(x, W)`` when W is 2-D and x has at least 2 dims (a 1-D x
    is a vector-matrix product there too, but linear's shapes are kept to eager's common case)."""
    w, x = shape(match.inputs["w"]), shape(match.inputs["x"])
    if w is None or len(w) != 2:
        return f"the transposed operand has shape {w}, not a 2-D weight"
    if x is None or len(x) < 2:
        return f"x has shape {x}: fewer than 2 dims"
    return None


def _build_linear(graph, inputs, literals, params):
    return [graph.call_function(aten.linear.default, (inputs["x"], inputs["w"]))]


def _xgb():
    return torch.randn(2, 4, 8), torch.randn(8), torch.randn(8)


def _build_gelu(approximate: str):
    def build(graph, inputs, literals, params):
        return [graph.call_function(aten.gelu.default, (inputs["x"],), {"approximate": approximate})]
    return build


def _check_ln(match) -> str | None:
    for node in match.region:  # every reduction must be over the last dim only
        if node.target in (aten.mean.dim, aten.var.correction):
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            rank = len(shape(node.args[0]) or ())
            if dims is None or [d % rank for d in dims] != [rank - 1]:
                return f"{node.name} reduces over dims {dims}, not the last one"
    n = (shape(match.inputs["x"]) or (0,))[-1]
    eps = match.literals.get("eps")
    if not isinstance(eps, (int, float)):
        return f"eps {eps!r} is not a constant"
    return first_problem(check_vector(match, "g", n, optional=False), check_vector(match, "b", n, optional=False))


def _build_ln(graph, inputs, literals, params):
    return [graph.call_function(aten.layer_norm.default, (inputs["x"], [params["n"]], inputs["g"], inputs["b"],
                                                          float(literals["eps"])))]


def _check_ln_params(match) -> str | None:
    problem = _check_ln(match)
    if problem is None:
        match.params["n"] = shape(match.inputs["x"])[-1]
    return problem


# A "+ eps" literal is the 'other' argument of add: bind it; the dims are checked above.
_LN_LITERALS = {"other": "eps", "dim": IGNORE}

SPELLINGS: list[Pattern] = [
    Pattern("gelu", "tanh_pow", gelu_tanh_pow, _x, _build_gelu("tanh")),
    Pattern("gelu", "tanh_cube", gelu_tanh_cube, _x, _build_gelu("tanh")),
    Pattern("gelu", "tanh_factored", gelu_tanh_factored, _x, _build_gelu("tanh")),
    Pattern("gelu", "tanh_bloom", gelu_tanh_bloom, _x, _build_gelu("tanh")),
    Pattern("gelu", "erf", gelu_erf, _x, _build_gelu("none")),
    Pattern("gelu", "erf_b", gelu_erf_b, _x, _build_gelu("none")),
    Pattern("layer_norm", "sqrt_div", ln_sqrt_div, _xgb, _build_ln, _check_ln_params, literals=_LN_LITERALS),
    Pattern("layer_norm", "rsqrt", ln_rsqrt, _xgb, _build_ln, _check_ln_params, literals=_LN_LITERALS),
    Pattern("layer_norm", "var", ln_var, _xgb, _build_ln, _check_ln_params, literals=_LN_LITERALS),
    Pattern("linear", "matmul_T", linear_matmul_permute, _xw, _build_linear, _check_linear_t),
    Pattern("linear", "matmul_t", linear_matmul_t, _xw, _build_linear, _check_linear_t),
]
