"""Where a forward's time goes: GEMMs, attention, opfuse's fused epilogues, other ATen ops,
and what no op accounts for (graph interpreter, Python launchers, dispatch).

::

    torch.profiler over ``calls`` forwards, each inside record_function(CALL)
      top-level ops = the profiler events whose parent is the CALL range (what the graph's
                      Python code or the eager model dispatches), classified by name:
        GEMM        aten::addmm / mm / bmm / baddbmm / matmul / linear, mkldnn::_linear_pointwise
        attention   aten::scaled_dot_product_attention (and its kernels), opfuse::attention
        fused       opfuse::* except attention, *minus* the GEMMs inside them (a
                    linear_add_layernorm's addmm counts as GEMM, its LayerNorm as fused)
        other ATen  every other op (LayerNorm, add, GELU, views, copies, masks …)
      overhead    = CALL time − Σ top-level op times: the Python between ops (FX graph
                    code, opfuse's launchers before they dispatch, HF's own Python in eager,
                    dynamo's guards); the ops inside ``torch.compile``'d regions (opfuse's
                    generate graphs) count as top-level ops

The profiler adds a few µs per op, so shares are of the profiled run (its total is listed
beside the unprofiled median the peers table gives). Times are CPU seconds per call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CALL = "opfuse.breakdown.call"
CATEGORIES = ("GEMM", "attention", "fused", "other ATen", "overhead")
_GEMM = {"aten::addmm", "aten::addmm_", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
         "aten::_addmm_activation", "mkldnn::_linear_pointwise"}


#: Profiler ranges that wrap the ops of a compiled graph (``torch.compile``, opfuse's
#: ``fused.generate``): descended into; their own time (dynamo's guards, the graph's Python
#: code) is overhead.
_WRAPPERS = ("Torch-Compiled Region", "TorchDynamo Cache Lookup", "CompiledFunction")


def _ops(event):
    """The ops directly dispatched under ``event``, looking through :data:`_WRAPPERS`:
    (op events, µs of the wrappers' own time)."""
    ops, wrapped = [], 0.0
    for child in event.cpu_children:
        if child.name.startswith(_WRAPPERS):
            inner, own = _ops(child)
            ops += inner
            wrapped += own + child.cpu_time_total - sum(e.cpu_time_total for e in child.cpu_children)
        else:
            ops.append(child)
    return ops, wrapped


def category(name: str) -> str:
    """The breakdown category of a top-level op named ``name`` (a profiler event name)."""
    if name in _GEMM:
        return "GEMM"
    if "scaled_dot_product" in name or name == "opfuse::attention":
        return "attention"
    if name.startswith("opfuse::"):
        return "fused"
    return "other ATen"


def _gemm_inside(event) -> float:
    """µs of the outermost GEMM events below ``event``."""
    total = 0.0
    for child in event.cpu_children:
        total += child.cpu_time_total if child.name in _GEMM else _gemm_inside(child)
    return total


def breakdown(fn: Callable[[], object], calls: int = 5, warmup: int = 2) -> dict:
    """Profile ``calls`` runs of ``fn`` (after ``warmup`` unprofiled ones) and split each
    call's CPU time into :data:`CATEGORIES`.

    Returns ``{"per_call_s": {category: seconds}, "share": {category: fraction},
    "total_s": profiled seconds per call, "ops_per_call": top-level ops dispatched per call,
    "top": [(op name, category, seconds per call, calls per call)] (the 12 largest)}``.
    """
    from torch.profiler import ProfilerActivity, profile, record_function
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                with record_function(CALL):
                    fn()
    events = prof.events()
    roots = [e for e in events if e.name == CALL]
    per = dict.fromkeys(CATEGORIES, 0.0)
    by_op: dict[str, list] = {}
    n_ops = 0
    for root in roots:
        inside = 0.0
        children, _ = _ops(root)
        for e in children:
            cat = category(e.name)
            t = e.cpu_time_total
            inside += t
            n_ops += 1
            if cat == "fused":
                g = _gemm_inside(e)
                per["GEMM"] += g
                t -= g
            per[cat] += t
            row = by_op.setdefault(e.name, [cat, 0.0, 0])
            row[1] += e.cpu_time_total
            row[2] += 1
        per["overhead"] += max(0.0, root.cpu_time_total - inside)
    n = max(1, len(roots))
    per_call = {k: v / n * 1e-6 for k, v in per.items()}  # profiler times are µs
    total = sum(per_call.values())
    top = sorted(((name, cat, t / n * 1e-6, c / n) for name, (cat, t, c) in by_op.items()),
                 key=lambda r: -r[2])[:12]
    return {"per_call_s": per_call, "share": {k: v / total if total else 0.0 for k, v in per_call.items()},
            "total_s": total, "ops_per_call": n_ops / n, "top": top}


def step_breakdown(generate: Callable[[int], object], steps: int = 16, calls: int = 2) -> dict:
    """Per decode step of ``generate(n)`` (n new tokens): :func:`breakdown` of ``generate(1 +
    steps)`` minus that of ``generate(1)`` (prefill and the loop's set-up cancel), divided by
    ``steps``; the same keys as :func:`breakdown` (no ``top``)."""
    long = breakdown(lambda: generate(1 + steps), calls=calls, warmup=1)
    short = breakdown(lambda: generate(1), calls=calls, warmup=1)
    per = {k: max(0.0, (long["per_call_s"][k] - short["per_call_s"][k]) / steps) for k in CATEGORIES}
    total = sum(per.values())
    return {"per_call_s": per, "share": {k: v / total if total else 0.0 for k, v in per.items()}, "total_s": total,
            "ops_per_call": (long["ops_per_call"] - short["ops_per_call"]) / steps}


def breakdown_table(results: dict, per: str = "call"):
    """A rich table: one column per system (``results``: name -> :func:`breakdown` or
    :func:`step_breakdown` result; ``per`` names the unit: "call" or "decode step")."""
    from rich.table import Table
    table = Table(title=f"where the time goes (torch.profiler, CPU ms per {per} and share)")
    table.add_column("category")
    for name in results:
        table.add_column(name, justify="right")
    for cat in CATEGORIES:
        table.add_row(cat, *(f"{r['per_call_s'][cat] * 1e3:.1f} ({r['share'][cat]:.0%})" for r in results.values()))
    table.add_row("profiled total", *(f"{r['total_s'] * 1e3:.1f}" for r in results.values()))
    table.add_row(f"ops dispatched per {per}", *(f"{r['ops_per_call']:.0f}" for r in results.values()))
    return table
