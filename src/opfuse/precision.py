"""Mixed precision by measurement: ``optimize(..., precision="bf16")`` runs a GEMM in
bfloat16 only where its measured error on the example inputs stays within ``tolerance``
*and* it is measured faster than its float32 form; the whole model is then checked against
the float32 plan and GEMMs are put back to float32 until it passes.

::

    float32 plan (GEMM backends chosen) ── record every value on the example inputs
      └─ for each plain GEMM (aten.linear / oneDNN linear without post-op):
           error  = max|y_bf16 − y_fp32| / max|y_fp32|   on the recorded input x
           time   = bf16 vs the node's float32 form, interleaved medians (cached per shape)
           bf16 when error ≤ tolerance and time ≤ (1 − MARGIN) · float32 time
      └─ rewrite: x → bf16, GEMM on a bf16 copy of the weight (folded once, float32
         accumulation inside oneDNN), result → float32, + bias in float32
      └─ end to end vs the float32 plan: max|Δ| / max(1, max|ref|) ≤ E2E_FACTOR · tolerance
         and the cosine of every floating output ≥ COSINE_MIN; otherwise the GEMMs with
         the largest errors go back to float32 (half of them per round) until it passes

What stays float32: the residual stream, every normalisation (LayerNorm / RMSNorm
statistics), softmax and attention, and the GEMMs inside opfuse's fused ops (their
epilogues are float32 kernels). On a CPU without native bf16 (no ``avx512_bf16`` /
``amx_bf16``) oneDNN emulates bf16: measured on the Intel Ice Lake machines (one thread)
a 128×768×768 GEMM ran 4.6x *slower* in bf16, a one-row GEMV over a 32000×512 LM head
1.5x faster (half the weight bytes), so the time gate keeps float32 where emulation loses
and the report says the CPU has no native bf16. ``precision="fp16"`` has no CPU path: the
report says so and the plan stays float32. ``precision="fp32"`` (the default) changes
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from math import prod

import torch
from torch import fx

from .cost.device import busy, cpu_model, load_cache, save_cache
from .gemm import COLD_ROWS, is_wt_copy
from .graph.meta import concrete as as_int
from .graph.state import note_derived

aten = torch.ops.aten
PRECISIONS = ("fp32", "bf16", "fp16")
#: Per-GEMM budget: max|y_bf16 − y_fp32| / max|y_fp32| on the example inputs (bf16 keeps 8
#: significant bits: one rounding of x and W gives ~2⁻⁹ relative per product; sums of K
#: products with float32 accumulation measured 2–5e-3 on Transformer GEMMs).
DEFAULT_TOLERANCE = 1e-2
#: End-to-end budget as a multiple of ``tolerance`` (errors of successive layers add up).
E2E_FACTOR = 4.0
#: Smallest cosine between any floating output of the bf16 plan and the float32 plan.
COSINE_MIN = 0.9995
MARGIN = 0.03     # bf16 replaces float32 only when ≥ 3% faster (median vs median)
ROUNDS = 7
CACHE = "gemm_cpu.json"


def check_precision(precision: str, tolerance: float | None) -> None:
    """Raise ValueError for an unknown ``precision`` or a ``tolerance`` that is not a
    positive finite number."""
    if precision not in PRECISIONS:
        raise ValueError(f"opfuse: precision must be one of {PRECISIONS}, got {precision!r}")
    if tolerance is not None and not (isinstance(tolerance, (int, float)) and 0 < tolerance < math.inf):
        raise ValueError(f"opfuse: tolerance must be a positive number (relative error), got {tolerance!r}")


def native_bf16() -> str | None:
    """The CPU flag giving native bf16 arithmetic (``amx_bf16``, ``avx512_bf16``), or None."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return None
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


@dataclass(frozen=True)
class PrecisionChoice:
    """One GEMM's precision decision; ``error``: max|y_bf16 − y_fp32| / max|y_fp32| on the
    example inputs; times in seconds (medians)."""

    node: str
    m: int
    k: int
    n: int
    precision: str
    error: float
    times_s: dict
    reason: str


def bf16_linear(x: torch.Tensor, weight_bf16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ weight_bf16 [N, K]ᵀ in bfloat16 with float32 accumulation
    (oneDNN's inner product), the result back in float32, + bias [N] in float32."""
    y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight_bf16, None, "none", [], "").float()
    return y if bias is None else y + bias


def _sites(gm: fx.GraphModule) -> list[fx.Node]:
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.kwargs:
            continue
        if n.target is aten.linear.default or (
                n.target is torch.ops.mkldnn._linear_pointwise.default and len(n.args) > 3 and n.args[3] == "none"):
            out.append(n)
        elif n.target is aten.matmul.default and is_wt_copy(n.args[1]):  # opfuse.gemm.direct_wt_matmuls' form
            out.append(n)
    return out


def _dense_weight(gm: fx.GraphModule, w, transposed: bool = False) -> tuple[torch.Tensor, str] | None:
    """(float32 [N, K] weight, the attribute it is read from) of a GEMM's weight argument:
    a parameter, a prepacked oneDNN copy, the ``aten.t`` view of a pre-transposed copy, or
    (``transposed``: a ``matmul``'s [K, N] operand) the pre-transposed copy itself."""
    from operator import attrgetter
    if not isinstance(w, fx.Node):
        return None
    if transposed:
        t = attrgetter(w.target)(gm)
        return (t.detach().t(), w.target) if w.op == "get_attr" and t.layout == torch.strided else None
    if w.op == "call_function" and w.target is aten.t.default and isinstance(w.args[0], fx.Node) \
            and w.args[0].op == "get_attr":
        t = attrgetter(w.args[0].target)(gm)
        return (t.detach().t(), w.args[0].target) if t.layout == torch.strided else None
    if w.op == "get_attr":
        t = attrgetter(w.target)(gm).detach()
        return (t.to_dense() if t.is_mkldnn else t), w.target
    return None


def _outputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    from .graph.state import StateSnapshot, copy_inputs
    snap = StateSnapshot.take(gm)
    a, k = copy_inputs(args, kwargs)
    try:
        with torch.no_grad():
            return [t for t in tree_leaves(gm(*a, **k)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    finally:
        snap.restore()


def end_to_end(out: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """``{"max_error": max|Δ| / max(1, max|ref|), "min_cosine": ...}`` over the outputs
    (:func:`opfuse.verify.compare`'s scaling; cosine of each output flattened, in float64)."""
    from .verify import compare
    err = max((compare(o, r) for o, r in zip(out, ref)), default=0.0)
    cos = 1.0
    for o, r in zip(out, ref):
        a, b = o.detach().double().flatten(), r.detach().double().flatten()
        if a.numel() and torch.isfinite(a).all() and torch.isfinite(b).all():
            na, nb = a.norm(), b.norm()
            c = 1.0 if na == 0 and nb == 0 else float(a @ b / (na * nb)) if na * nb > 0 else 0.0
            cos = min(cos, c)
    return {"max_error": err, "min_cosine": cos}


def _measure(fp32: Callable, bf16: Callable, rows: int) -> dict:
    """Median seconds of each form; with the caches evicted before each call at ≤
    :data:`opfuse.gemm.COLD_ROWS` rows (a weight stream, as in a decode step: there bf16's
    half-size weight is what can gain)."""
    from .bench.timing import evict_caches, interleaved
    with torch.no_grad():
        times = interleaved({"fp32": fp32, "bf16": bf16}, repeat=ROUNDS, warmup=1,
                            before=evict_caches if rows <= COLD_ROWS else None)
    return {k: v["median_s"] for k, v in times.items()}


def apply_precision(gm: fx.GraphModule, args: tuple, kwargs: dict, precision: str = "fp32",
                    tolerance: float | None = None, errors: dict | None = None, timer: Callable | None = None) -> dict:
    """Pipeline pass (after the GEMM backends): lower GEMMs to ``precision`` where measured
    error and time allow (module docstring). ``errors`` / ``timer`` inject measurements
    (tests): ``errors[node name]`` replaces a measured error; ``timer(node, fp32, bf16)`` ->
    ``{"fp32": s, "bf16": s}`` replaces the clock. Returns the report's ``precision`` entry
    (plain data; ``{}`` for ``"fp32"``).

    Raises:
        ValueError: unknown precision or bad tolerance."""
    check_precision(precision, tolerance)
    if precision == "fp32":
        return {}
    tol = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)
    info: dict = {"requested": precision, "tolerance": tol, "native": native_bf16(), "gemms": [],
                  "end_to_end": None, "reverted": 0}
    values = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    if precision == "fp16":
        info["note"] = "fp16: no CPU path (float16 GEMMs are a GPU feature here); the plan stays float32"
        return info
    if any(t.device.type != "cpu" for t in values) or not torch.backends.mkldnn.is_available():
        info["note"] = "bf16 is implemented for CPU GEMMs through oneDNN only; the plan stays float32"
        return info
    info["note"] = ("native bf16 (" + info["native"] + ")" if info["native"] else
                    "this CPU has no native bf16 (no avx512_bf16 / amx_bf16): oneDNN emulates it, so bf16 is kept "
                    "only where measured faster")
    from .verify import record_values
    env = record_values(gm, args, kwargs)
    ref = _outputs(gm, args, kwargs)
    cache = load_cache(CACHE) if timer is None else {}
    size = len(cache)
    chosen: list[tuple[fx.Node, list[fx.Node], float]] = []
    converted: dict[str, fx.Node] = {}
    for node in _sites(gm):
        x_node, w_arg = node.args[0], node.args[1]
        b_arg = node.args[2] if len(node.args) > 2 else None
        dense = _dense_weight(gm, w_arg, transposed=node.target is aten.matmul.default)
        x = env.get(x_node) if isinstance(x_node, fx.Node) else None
        y = env.get(node)
        b = env.get(b_arg) if isinstance(b_arg, fx.Node) else None
        if dense is None or not isinstance(x, torch.Tensor) or x.dtype != torch.float32 \
                or not isinstance(y, torch.Tensor) or (b_arg is not None and not isinstance(b, torch.Tensor)):
            continue
        w32, source = dense
        n_out, k = w32.shape
        m = as_int(prod(x.shape[:-1]))
        wb = w32.to(torch.bfloat16).contiguous()
        with torch.no_grad():
            y16 = bf16_linear(x, wb, b)
        scale = float(y.abs().max()) if y.numel() else 0.0
        err = float((y16 - y).abs().max()) / scale if scale > 0 else 0.0
        if errors is not None and node.name in errors:
            err = errors[node.name]
        node_args = [env.get(a, a) if isinstance(a, fx.Node) else a for a in node.args]
        key = (f"{cpu_model()} | torch {torch.__version__} | threads {torch.get_num_threads()} | bf16 vs "
               f"{node.target}({m}x{k}, {n_out}x{k}, bias={b is not None})" + (" | cold" if m <= COLD_ROWS else ""))
        times = timer(node, lambda: node.target(*node_args), lambda: bf16_linear(x, wb, b)) if timer else cache.get(key)
        if times is None:
            times = _measure(lambda: node.target(*node_args), lambda: bf16_linear(x, wb, b), m)
            if busy() is None:
                cache[key] = times
        faster = times["bf16"] <= times["fp32"] * (1 - MARGIN)
        if err > tol:
            why = f"float32: bf16 error {err:.1e} > tolerance {tol:.0e}"
        elif not faster:
            why = f"float32: bf16 not {MARGIN:.0%} faster ({times['bf16'] * 1e6:.0f} vs {times['fp32'] * 1e6:.0f} µs)"
        else:
            why = f"bf16: error {err:.1e} ≤ {tol:.0e}, {times['fp32'] / times['bf16']:.2f}x faster"
        choice = PrecisionChoice(node.name, m, k, n_out, "bf16" if err <= tol and faster else "fp32",
                                 err, {kk: round(v, 9) for kk, v in times.items()}, why)
        info["gemms"].append(asdict(choice))
        if choice.precision == "bf16":
            chain = _lower(gm, node, converted, source, wb)
            chosen.append((node, chain, err))
    if len(cache) != size:
        save_cache(CACHE, cache)
    if chosen:
        gm.recompile()
        check = end_to_end(_outputs(gm, args, kwargs), ref)
        while chosen and not (check["max_error"] <= E2E_FACTOR * tol and check["min_cosine"] >= COSINE_MIN):
            chosen.sort(key=lambda c: -c[2])
            back, chosen = chosen[: max(1, len(chosen) // 2)], chosen[max(1, len(chosen) // 2):]
            for node, chain, _ in back:
                chain[-1].replace_all_uses_with(node)
                for c in reversed(chain):
                    gm.graph.erase_node(c)
                for g in info["gemms"]:
                    if g["node"] == node.name:
                        g["precision"] = "fp32"
                        g["reason"] = (f"float32: put back, the whole model was over budget (max error "
                                       f"{check['max_error']:.1e}, cosine {check['min_cosine']:.6f})")
            info["reverted"] += len(back)
            gm.recompile()
            check = end_to_end(_outputs(gm, args, kwargs), ref)
        info["end_to_end"] = check
    for node, _, _ in chosen:
        gm.graph.erase_node(node)  # the float32 GEMM, kept unused while the budget was checked
    from .rewrite import drop_unused_parameters
    drop_unused_parameters(gm)
    gm.graph.lint()
    gm.recompile()
    return info


def _lower(gm: fx.GraphModule, node: fx.Node, converted: dict, source: str, wb: torch.Tensor) -> list[fx.Node]:
    """Insert the bf16 form of the GEMM ``node`` after it and route its users there; the
    float32 node stays (unused) until the end-to-end check. Returns the inserted nodes."""
    attr = converted.get(source)
    if attr is None:
        buf = f"opfuse_folded_bf16_{source.replace('.', '_')}"
        gm.register_buffer(buf, wb)
        note_derived(gm, buf, [source])
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(buf)
        converted[source] = attr
    x, b = node.args[0], node.args[2] if len(node.args) > 2 else None
    with gm.graph.inserting_after(node):
        xb = gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    with gm.graph.inserting_after(xb):
        yb = gm.graph.call_function(torch.ops.mkldnn._linear_pointwise.default, (xb, attr, None, "none", [], ""))
    with gm.graph.inserting_after(yb):
        y = gm.graph.call_function(aten._to_copy.default, (yb,), {"dtype": torch.float32})
    chain = [xb, yb, y]
    if b is not None:
        with gm.graph.inserting_after(y):
            chain.append(gm.graph.call_function(aten.add.Tensor, (y, b)))
    for c in chain:
        c.meta["opfuse_precision"] = "bf16"
    chain[-1].meta["val"] = node.meta.get("val")
    node.replace_all_uses_with(chain[-1], delete_user_cb=lambda u: u not in chain)
    return chain
