"""Normalisation fusions.

add_layernorm (SkipLayerNorm; post-LN residual block, BERT)::

    x [..., N]   r [..., N]
        \\        /
          add              s: written + read once more unfused (2·|s| bytes)
           |   (s may have other consumers: the kernel then also writes s)
       layer_norm(N, γ, β, eps)
           |
          out       ==>   opfuse.add_layernorm(x, r, γ, β, eps)  [ + s ]

linear_add_layernorm (GEMM + residual + LayerNorm; the pre-LN block of GPT-2 / ViT, whose sum
is also the next residual, and the post-LN dense → +residual → LN of BERT)::

    x [..., K] --linear(W [N,K], b [N])--> y     r [..., N]
                                            \\   /
                                             add   s   (s may have other consumers: also written)
                                              |
                                 layer_norm(N, γ, β, eps)
                                              |
          out   ==>   opfuse.linear_add_layernorm(x, W, b, r, γ, β, eps)  [ _sum: + s ]
    y never leaves the kernel (the GEMM accumulates into r + b), s is read by no second kernel.

layernorm_gelu (LN then GELU in one pass, the seed's example)::

    x -> layer_norm(γ, β, eps) -> gelu(erf | tanh) -> out   ==>  opfuse.layernorm_gelu(x, γ, β, eps, form)

rmsnorm / add_rmsnorm (Zhang & Sennrich 2019; HF LlamaRMSNorm, statistics in float32)::

    [x + r ->] s -> pow(2) -> mean(-1) -> + eps -> rsqrt -> s · _ -> γ · _ -> out
                   (six element-wise/reduction kernels unfused)
    ==>  opfuse.rmsnorm(x, γ, eps)   |   opfuse.add_rmsnorm(x, r, γ, eps) -> (out, s)

Statistics are shifted two-pass in float32 (see ../shared/design/KERNELS.md).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..cost.model import Cost, tensor_bytes, unfused_cost
from .common import check_float, check_linear, check_same_shape, check_vector, first_problem, shape, val
from .engine import IGNORE, Pattern

aten = torch.ops.aten

_EPS = 1e-5  # any value: bound from the model ("eps")


def add_layernorm(x, r, g, b):
    return F.layer_norm(x + r, (8,), g, b, _EPS)


def linear_add_layernorm(x, w, lb, r, g, b):
    return F.layer_norm(F.linear(x, w, lb) + r, (8,), g, b, _EPS)


def layernorm_gelu_erf(x, g, b):
    return F.gelu(F.layer_norm(x, (8,), g, b, _EPS))


def layernorm_gelu_tanh(x, g, b):
    return F.gelu(F.layer_norm(x, (8,), g, b, _EPS), approximate="tanh")


def rmsnorm(x, g):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _EPS))


def rmsnorm_cast(x, g):  # half-precision models: statistics in float32, cast back before γ
    xf = x.to(torch.float32)
    return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _EPS)).to(x.dtype)


def add_rmsnorm(x, r, g):
    s = x + r
    return g * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + _EPS))


def add_rmsnorm_cast(x, r, g):
    s = x + r
    sf = s.to(torch.float32)
    return g * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + _EPS)).to(s.dtype)


def _rms_example(residual: bool, dtype=torch.float32):
    xs = (torch.randn(2, 4, 8, dtype=dtype),) * (2 if residual else 1)
    xs = tuple(x.clone() for x in xs)
    return xs + (torch.randn(8, dtype=dtype),)


def check_rmsnorm(match) -> str | None:
    x = "x"
    sx = shape(match.inputs[x])
    for node in match.region:
        if node.target is torch.ops.aten.mean.dim:
            rank = len(shape(node.args[0]) or ())
            if [d % rank for d in node.args[1]] != [rank - 1]:
                return f"{node.name} reduces over dims {node.args[1]}, the kernel normalizes the last dim only"
    eps = match.literals.get("eps")
    if not isinstance(eps, (int, float)):
        return f"eps {eps!r} is not a constant number"
    problems = [check_vector(match, "g", sx[-1], optional=False), check_float(match, x)]
    if "r" in match.inputs:
        problems.insert(0, check_same_shape(match, "x", "r"))
    return first_problem(*problems)


def build_rmsnorm(graph, inputs, literals, params):
    return [graph.call_function(torch.ops.opfuse.rmsnorm.default, (inputs["x"], inputs["g"], float(literals["eps"])))]


def build_add_rmsnorm(graph, inputs, literals, params):
    both = graph.call_function(torch.ops.opfuse.add_rmsnorm.default,
                               (inputs["x"], inputs["r"], inputs["g"], float(literals["eps"])))
    outs = [graph.call_function(operator.getitem, (both, 0))]
    if params.get("emit"):
        outs.append(graph.call_function(operator.getitem, (both, 1)))
    return outs


def _example(residual: bool):
    xs = (torch.randn(2, 4, 8), torch.randn(2, 4, 8)) if residual else (torch.randn(2, 4, 8),)
    return xs + (torch.randn(8), torch.randn(8))


def _example_linear_add_ln():
    return (torch.randn(2, 4, 16), torch.randn(8, 16), torch.randn(8), torch.randn(2, 4, 8), torch.randn(8),
            torch.randn(8))


def _check_ln(match, x: str) -> str | None:
    ns = match.literals.get("normalized_shape")
    sx = shape(match.inputs[x])
    if ns is None or len(ns) != 1 or sx is None or ns[0] != sx[-1]:
        return f"layer_norm normalizes over {ns}; the kernel supports only the last dim ({sx and sx[-1]})"
    if match.inputs.get("g") is None:
        return (f"layer_norm of {match.inputs[x].name} has no affine weight (elementwise_affine=False); "
                f"no kernel variant for it")
    eps = match.literals.get("eps")
    if not isinstance(eps, (int, float)):
        return f"eps {eps!r} is not a constant number"
    return first_problem(check_vector(match, "g", ns[0], optional=False), check_vector(match, "b", ns[0]),
                         check_float(match, x))


def _full_and_broadcast(match) -> tuple[str, str]:
    """(operand with the sum's shape, the other): add commutes exactly, so the kernel's x is
    whichever operand already has the full shape."""
    return ("r", "x") if shape(match.inputs["x"]) != shape(match.outputs[0]) else ("x", "r")


def check_add_layernorm(match) -> str | None:
    full, other = _full_and_broadcast(match)
    match.params["swap"] = full == "r"
    fs, os_ = shape(match.inputs[full]), shape(match.inputs[other])
    problem = None
    if fs != shape(match.outputs[0]):
        problem = check_same_shape(match, "x", "r")  # neither operand has the sum's shape
    elif os_ != fs:
        padded = (1,) * (len(fs) - len(os_)) + tuple(os_)
        if len(os_) > len(fs) or padded[-1:] != fs[-1:] or any(a not in (1, b) for a, b in zip(padded, fs)):
            user = next((n.name for n in match.region if match.inputs[other] in n.all_input_nodes), "?")
            problem = (f"check row-broadcast failed at {user}: {match.inputs[other].name} has shape "
                       f"{list(os_ or [])}, which does not broadcast to {list(fs)} over the leading dims only "
                       "(the kernel expands a residual row-wise, never within a row)")
    return first_problem(problem, _check_ln(match, full), check_float(match, "x", "r"))


def _linear_node(match):
    return next(n for n in match.region if n.target is aten.linear.default)


def check_linear_add_layernorm(match) -> str | None:
    lin = _linear_node(match)
    w, r = match.inputs["w"], match.inputs["r"]
    if w.op != "get_attr":
        return (f"check weight-is-parameter failed at {lin.name}: weight {w.name} is computed at run time, "
                f"not a parameter")
    problem = check_linear(match, "x", "w", "lb")
    if problem:
        return f"check linear failed at {lin.name}: {problem}"
    if shape(r) != shape(lin):
        add = next(u for u in lin.users if u in match.region)
        return (f"check equal-shapes failed at {add.name}: residual {r.name} has shape {list(shape(r) or [])} but "
                f"{lin.name} gives {list(shape(lin) or [])}; broadcasting residuals are not folded")
    dtypes = {n: val(match.inputs[n]).dtype for n in ("x", "w", "r")}
    if len(set(dtypes.values())) > 1:
        return f"check same-dtype failed at {lin.name}: x, weight and residual dtypes differ {dtypes}"
    return first_problem(_check_ln(match, "r"), check_float(match, "x", "w", "r"))


def linear_add_layernorm_cost(match, device) -> Cost:
    """Fused traffic: x, W, b, r, γ, β read once, out written once (+ the sum when emitted);
    FLOPs as unfused (the GEMM's 2MNK dominates)."""
    read = sum(tensor_bytes(val(match.inputs[n])) for n in ("x", "w", "lb", "r", "g", "b"))
    written = sum(tensor_bytes(val(n)) for n in [*match.outputs, *match.emitted])
    return Cost(unfused_cost(match.region).flops, read, written)


def build_linear_add_layernorm(graph, inputs, literals, params):
    args = (inputs["x"], inputs["w"], inputs["lb"], inputs["r"], inputs["g"], inputs["b"], float(literals["eps"]))
    if params.get("emit"):
        both = graph.call_function(torch.ops.opfuse.linear_add_layernorm_sum.default, args)
        return [graph.call_function(operator.getitem, (both, 0)), graph.call_function(operator.getitem, (both, 1))]
    return [graph.call_function(torch.ops.opfuse.linear_add_layernorm.default, args)]


def check_layernorm_gelu(match) -> str | None:
    return _check_ln(match, "x")


def build_add_layernorm(graph, inputs, literals, params):
    x, r = inputs["x"], inputs["r"]
    if params.get("swap"):  # x is the row-broadcast operand: the kernel's x must have the full shape
        x, r = r, x
    args = (x, r, inputs["g"], inputs["b"], float(literals["eps"]))
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
_RMS = {"other": "eps", "dim": IGNORE}

PATTERNS = [
    Pattern("add_layernorm", "post_ln", add_layernorm, lambda: _example(True), build_add_layernorm,
            check_add_layernorm, literals=_LN, emits=("add",)),
    Pattern("linear_add_layernorm", "linear_add_ln", linear_add_layernorm, _example_linear_add_ln,
            build_linear_add_layernorm, check_linear_add_layernorm, literals=_LN, emits=("add",),
            fused_cost=linear_add_layernorm_cost, decide_by="epilogue"),
    *[Pattern("layernorm_gelu", form, fn, lambda: _example(False), _build_layernorm_gelu(approx),
              check_layernorm_gelu, literals=_LN)
      for form, fn, approx in [("erf", layernorm_gelu_erf, "none"), ("tanh", layernorm_gelu_tanh, "tanh")]],
    Pattern("rmsnorm", "llama", rmsnorm, lambda: _rms_example(False), build_rmsnorm, check_rmsnorm, literals=_RMS),
    *[Pattern("rmsnorm", f"llama_{str(dt)[6:]}", rmsnorm_cast, lambda dt=dt: _rms_example(False, dt), build_rmsnorm,
              check_rmsnorm, literals=_RMS) for dt in (torch.float16, torch.bfloat16)],
    Pattern("add_rmsnorm", "llama", add_rmsnorm, lambda: _rms_example(True), build_add_rmsnorm, check_rmsnorm,
            literals=_RMS, emits=("add",)),
    *[Pattern("add_rmsnorm", f"llama_{str(dt)[6:]}", add_rmsnorm_cast, lambda dt=dt: _rms_example(True, dt),
              build_add_rmsnorm, check_rmsnorm, literals=_RMS, emits=("add",)) for dt in (torch.float16, torch.bfloat16)],
]
