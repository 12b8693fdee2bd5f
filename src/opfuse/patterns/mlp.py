"""GEMM epilogues and the feed-forward block.

bias_gelu (GELU as a GEMM epilogue; erf and tanh GELU are different rows)::

    x [M,K] --linear(W [N,K], b [N])--> y [M,N] --gelu--> out     ==>  opfuse.linear_bias_gelu(x, W, b, form)
                                       (y written and read again unfused: 2·|y| bytes)

out_proj_residual (output projection with the residual folded into the GEMM's C)::

    x --linear(W, b)--> y --add(r)--> out    ==>  opfuse.linear_residual(x, W, b, r)   (C = r + b, beta = 1)

ffn (Linear → GELU → Linear, rows processed in blocks so the [rows, H] activation stays
in cache; W1/W2 are re-read once per block, which the cost model charges)::

    x --linear(W1,b1)--> h --gelu--> a --linear(W2,b2)--> out   ==>  opfuse.ffn(x, W1, b1, W2, b2, form, rows)

swiglu (Shazeer 2020, "GLU variants"; Llama's MLP: gate and up projections share x, so one
GEMM on [W_gate; W_up] and a SiLU·mul epilogue; the [M, 2H] GEMM output is read once)::

    x --linear(Wg)--> g --silu--> a \
    x --linear(Wu)--> u ------------ mul --> out    ==>  opfuse.swiglu(x, [Wg; Wu], H)

geglu (the same with GELU on the gate: T5 v1.1 ``gated-gelu`` and Gemma with tanh GELU,
ModernBERT's packed ``Wi`` + ``chunk(2, -1)`` with erf GELU; erf and tanh are different
rows, and neither is ever taken for SwiGLU)::

    x --linear(Wg)--> g --gelu(form)--> a \
    x --linear(Wu)--> u ----------------- mul --> out    ==>  opfuse.geglu(x, [Wg; Wu], H, form)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..cost.model import Cost, tensor_bytes, unfused_cost
from ..graph.meta import concrete
from .common import check_float, check_linear, check_same_shape, first_problem, shape, val, zeros_vector
from .engine import Pattern


def bias_gelu_erf(x, w, b):
    return F.gelu(F.linear(x, w, b))


def bias_gelu_tanh(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def out_proj_residual(x, w, b, r):
    return F.linear(x, w, b) + r


def ffn_erf(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def ffn_tanh(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def swiglu(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def _example_swiglu():
    return torch.randn(2, 4, 8), torch.randn(16, 8), torch.randn(16, 8)


def check_swiglu(match) -> str | None:
    wg, wu = match.inputs["wg"], match.inputs["wu"]
    for w in (wg, wu):
        if w.op != "get_attr":
            return f"weight {w.name} is computed at run time; cannot pre-concatenate [W_gate; W_up]"
    if shape(wg) != shape(wu):
        return f"gate {list(shape(wg))} and up {list(shape(wu))} projections differ in shape"
    match.params["hidden"] = shape(wg)[0]
    return first_problem(check_linear(match, "x", "wg", None), check_float(match, "x"))


def build_swiglu(graph, inputs, literals, params):
    w = graph.call_function(torch.ops.aten.cat.default, ([inputs["wg"], inputs["wu"]], 0))
    return [graph.call_function(torch.ops.opfuse.swiglu.default, (inputs["x"], w, int(params["hidden"])))]


def swiglu_packed(x, w):
    """Phi-3's MLP: one packed ``gate_up_proj`` [2H, K], ``chunk(2, -1)``, ``up * silu(gate)``
    — already the kernel's [W_gate; W_up] layout, so nothing is concatenated."""
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return up * F.silu(gate)


def _example_swiglu_packed():
    return torch.randn(2, 4, 8), torch.randn(32, 8)


def check_swiglu_packed(match) -> str | None:
    w = shape(match.inputs["w"])
    if w is None or len(w) != 2 or w[0] % 2:
        return f"packed gate/up weight {match.inputs['w'].name} has shape {list(w or [])}, not [2H, K]"
    match.params["hidden"] = w[0] // 2
    return first_problem(check_linear(match, "x", "w", None), check_float(match, "x"))


def build_swiglu_packed(graph, inputs, literals, params):
    return [graph.call_function(torch.ops.opfuse.swiglu.default, (inputs["x"], inputs["w"], int(params["hidden"])))]


def geglu_erf(x, wg, wu):
    return F.gelu(F.linear(x, wg)) * F.linear(x, wu)


def geglu_tanh(x, wg, wu):
    return F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu)


def geglu_packed_erf(x, w):
    """ModernBERT: ``input, gate = Wi(x).chunk(2, -1)``; ``act(input) * gate``."""
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.gelu(gate) * up


def geglu_packed_tanh(x, w):
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _build_geglu(form: str, packed: bool):
    def build(graph, inputs, literals, params):
        w = inputs["w"] if packed else graph.call_function(torch.ops.aten.cat.default, ([inputs["wg"], inputs["wu"]], 0))
        return [graph.call_function(torch.ops.opfuse.geglu.default, (inputs["x"], w, int(params["hidden"]), form))]
    return build


def _example_linear():
    return torch.randn(2, 4, 8), torch.randn(16, 8), torch.randn(16)


def _example_residual():
    return torch.randn(2, 4, 8), torch.randn(8, 8), torch.randn(8), torch.randn(2, 4, 8)


def _example_ffn():
    return torch.randn(2, 4, 8), torch.randn(16, 8), torch.randn(16), torch.randn(8, 16), torch.randn(8)


def _zero_bias(graph, inputs: dict, b: str, w: str, n: int):
    """``inputs[b]``, or zeros [n] of the weight's dtype for a linear without a bias (Falcon)."""
    return inputs[b] if inputs.get(b) is not None else zeros_vector(graph, inputs[w], n)


def check_bias_gelu(match) -> str | None:
    match.params["n"] = (shape(match.inputs["w"]) or (0,))[0]
    return first_problem(check_linear(match, "x", "w", "b"), check_float(match, "x", "w"))


def check_out_proj_residual(match) -> str | None:
    problem = check_linear(match, "x", "w", "b")
    if problem:
        return problem
    out = shape(match.outputs[0])
    if shape(match.inputs["r"]) != out:
        return (f"residual {match.inputs['r'].name} has shape {list(shape(match.inputs['r']) or [])}, "
                f"the projection gives {list(out)}; broadcasting residuals are not folded")
    return check_float(match, "x", "w", "r")


def check_ffn(match) -> str | None:
    match.params["n1"] = (shape(match.inputs["w1"]) or (0,))[0]
    match.params["n2"] = (shape(match.inputs["w2"]) or (0,))[0]
    return first_problem(check_linear(match, "x", "w1", "b1"), check_float(match, "x"),
                         None if shape(match.inputs["w2"])[1] == shape(match.inputs["w1"])[0]
                         else "W2 in_features != W1 out_features")


def ffn_block_rows(hidden: int, cache_bytes: int, itemsize: int = 4) -> int:
    """Rows per block so one [rows, hidden] float32 activation block fits in ``cache_bytes``
    (multiple of 16, at least 16)."""
    return max(16, (cache_bytes // max(1, hidden * itemsize)) // 16 * 16)


def ffn_fused_cost(match, device) -> Cost:
    """Fused FFN traffic: x read once, out written once, and W1, b1, W2, b2 read once
    per row block (bytes); FLOPs as unfused."""
    x, w1, b1, w2, b2 = (val(match.inputs[n]) for n in ("x", "w1", "b1", "w2", "b2"))
    out = val(match.outputs[0])
    rows = concrete(math.prod(x.shape[:-1]))
    block = ffn_block_rows(w1.shape[0], device.cache_bytes)
    match.params["block_rows"] = block
    blocks = math.ceil(rows / block)
    weights = tensor_bytes(w1) + tensor_bytes(b1) + tensor_bytes(w2) + tensor_bytes(b2)
    match.params["cost_note"] = (f"W1/W2 re-read once per block of {block} rows: {blocks} × "
                                 f"{weights / 1e6:.2f} MB")
    return Cost(unfused_cost(match.region).flops, tensor_bytes(x) + blocks * weights, tensor_bytes(out))


def _build_bias_gelu(form):
    def build(graph, inputs, literals, params):
        b = _zero_bias(graph, inputs, "b", "w", params["n"])
        return [graph.call_function(torch.ops.opfuse.linear_bias_gelu.default, (inputs["x"], inputs["w"], b, form))]
    return build


def _build_ffn(form):
    def build(graph, inputs, literals, params):
        b1 = _zero_bias(graph, inputs, "b1", "w1", params["n1"])
        b2 = _zero_bias(graph, inputs, "b2", "w2", params["n2"])
        return [graph.call_function(torch.ops.opfuse.ffn.default,
                                    (inputs["x"], inputs["w1"], b1, inputs["w2"], b2,
                                     form, int(params.get("block_rows", 256))))]
    return build


def build_out_proj_residual(graph, inputs, literals, params):
    return [graph.call_function(torch.ops.opfuse.linear_residual.default,
                                (inputs["x"], inputs["w"], inputs["b"], inputs["r"]))]


PATTERNS = [
    Pattern("bias_gelu", "erf", bias_gelu_erf, _example_linear, _build_bias_gelu("none"), check_bias_gelu,
            decide_by="epilogue"),
    Pattern("bias_gelu", "tanh", bias_gelu_tanh, _example_linear, _build_bias_gelu("tanh"), check_bias_gelu,
            decide_by="epilogue"),
    Pattern("out_proj_residual", "linear_add", out_proj_residual, _example_residual, build_out_proj_residual,
            check_out_proj_residual, decide_by="epilogue"),
    Pattern("ffn", "erf", ffn_erf, _example_ffn, _build_ffn("none"), check_ffn, fused_cost=ffn_fused_cost),
    Pattern("ffn", "tanh", ffn_tanh, _example_ffn, _build_ffn("tanh"), check_ffn, fused_cost=ffn_fused_cost),
    Pattern("swiglu", "gate_up", swiglu, _example_swiglu, build_swiglu, check_swiglu),
    Pattern("swiglu", "packed_chunk", swiglu_packed, _example_swiglu_packed, build_swiglu_packed,
            check_swiglu_packed),
    Pattern("geglu", "erf", geglu_erf, _example_swiglu, _build_geglu("none", False), check_swiglu),
    Pattern("geglu", "tanh", geglu_tanh, _example_swiglu, _build_geglu("tanh", False), check_swiglu),
    Pattern("geglu", "packed_chunk_erf", geglu_packed_erf, _example_swiglu_packed, _build_geglu("none", True),
            check_swiglu_packed),
    Pattern("geglu", "packed_chunk_tanh", geglu_packed_tanh, _example_swiglu_packed, _build_geglu("tanh", True),
            check_swiglu_packed),
]
