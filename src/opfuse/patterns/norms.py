"""Normalisation fusions.

add_layernorm (SkipLayerNorm; post-LN residual block, BERT)::

    x [..., N]   r [..., N]
        \\        /
          add              s: written + read once more unfused (2·|s| bytes)
           |   (s may have other consumers: the kernel then also writes s)
       layer_norm(N, γ, β, eps)
           |
          out       ==>   opfuse.add_layernorm(x, r, γ, β, eps)  [ + s ]

layernorm_gelu (LN then GELU in one pass, the seed's example)::

    x -> layer_norm(γ, β, eps) -> gelu(erf | tanh) -> out   ==>  opfuse.layernorm_gelu(x, γ, β, eps, form)

Statistics are shifted two-pass in float32 (see ../shared/design/KERNELS.md).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from .common import check_float, check_same_shape, check_vector, first_problem, shape
from .engine import Pattern

_EPS = 1e-5  # any value: bound from the model ("eps")


def add_layernorm(x, r, g, b):
    return F.layer_norm(x + r, (8,), g, b, _EPS)


def layernorm_gelu_erf(x, g, b):
    return F.gelu(F.layer_norm(x, (8,), g, b, _EPS))


def layernorm_gelu_tanh(x, g, b):
    return F.gelu(F.layer_norm(x, (8,), g, b, _EPS), approximate="tanh")


def _example(residual: bool):
    xs = (torch.randn(2, 4, 8), torch.randn(2, 4, 8)) if residual else (torch.randn(2, 4, 8),)
    return xs + (torch.randn(8), torch.randn(8))


def _check_ln(match, x: str) -> str | None:
    ns = match.literals.get("normalized_shape")
    sx = shape(match.inputs[x])
    if ns is None or len(ns) != 1 or sx is None or ns[0] != sx[-1]:
        return f"layer_norm normalizes over {ns}; the kernel supports only the last dim ({sx and sx[-1]})"
    if match.inputs.get("g") is None:
        return "layer_norm has no affine weight (elementwise_affine=False); no kernel variant for it"
    eps = match.literals.get("eps")
    if not isinstance(eps, (int, float)):
        return f"eps {eps!r} is not a constant number"
    return first_problem(check_vector(match, "g", ns[0], optional=False), check_vector(match, "b", ns[0]),
                         check_float(match, x))


def check_add_layernorm(match) -> str | None:
    return first_problem(check_same_shape(match, "x", "r"), _check_ln(match, "x"), check_float(match, "r"))


def check_layernorm_gelu(match) -> str | None:
    return _check_ln(match, "x")


def build_add_layernorm(graph, inputs, literals, params):
    args = (inputs["x"], inputs["r"], inputs["g"], inputs["b"], float(literals["eps"]))
    if params.get("emit"):
        both = graph.call_function(torch.ops.opfuse.add_layernorm_sum.default, args)
        return [graph.call_function(operator.getitem, (both, 0)), graph.call_function(operator.getitem, (both, 1))]
    return [graph.call_function(torch.ops.opfuse.add_layernorm.default, args)]


def _build_layernorm_gelu(form: str):
    def build(graph, inputs, literals, params):
        return [graph.call_function(torch.ops.opfuse.layernorm_gelu.default,
                                    (inputs["x"], inputs["g"], inputs["b"], float(literals["eps"]), form))]
    return build


_LN = {"normalized_shape": "normalized_shape"}

PATTERNS = [
    Pattern("add_layernorm", "post_ln", add_layernorm, lambda: _example(True), build_add_layernorm,
            check_add_layernorm, literals=_LN, emits=("add",)),
    *[Pattern("layernorm_gelu", form, fn, lambda: _example(False), _build_layernorm_gelu(approx),
              check_layernorm_gelu, literals=_LN)
      for form, fn, approx in [("erf", layernorm_gelu_erf, "none"), ("tanh", layernorm_gelu_tanh, "tanh")]],
]
