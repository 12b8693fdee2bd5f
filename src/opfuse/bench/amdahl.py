"""Amdahl's law check: predict the whole-model speed-up from per-pattern measurements,
then measure it.

    p_i        share of the unfused model's run time spent in pattern i's fused regions:
               torch.profiler on the captured (unfused) graph, each node run under a
               ``record_function("node:<name>")`` label, so a region's time is the sum of
               its own ATen ops (exact mapping, no guessing from op names)
    S_i        Σ unfused time / Σ fused time of pattern i's regions, each timed in isolation
               on the recorded inputs (``verify.record_values``): the region's unfused
               ATen nodes vs the fused op (the graph ``verify.run_region`` builds)
    GEMMs      the GEMM backend choice (``opfuse.gemm``, times from its optimize-time
               measurement): a GEMM inside a fused region lowers that pattern's fused time
               by (aten − chosen); GEMMs outside regions form one more row, p = their aten
               time / the unfused graph's median time, S = Σ aten / Σ chosen
    S_overall  1 / ((1 − Σ p_i) + Σ p_i / S_i)        (predicted)
    measured   unfused captured graph / fused graph, and eager / opfuse, interleaved medians

The roofline's own prediction of S_i (cost model: Σ time_unfused / Σ time_fused) is shown
beside the measured one.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx

from .timing import interleaved


def plan_unfused(model, args, theta: float, device=None):
    """The pipeline up to ``select`` on a fresh capture (``explain``'s run):
    (canonicalised graph module, candidates)."""
    from opfuse import pipeline
    plan = pipeline.run(model, args, {}, theta=theta, device=device, verify=False, rewrite_graph=False)
    return plan.gm, plan.candidates


def region_modules(cand, env: dict) -> tuple[fx.GraphModule, fx.GraphModule, list]:
    """(unfused module, fused module, [unfused feeds, fused feeds]) of one candidate on
    recorded values (the modules verification builds)."""
    from opfuse.verify import fused_region_module, unfused_region_module
    unfused, feeds = unfused_region_module(cand.match, env)
    fused, ffeeds = fused_region_module(cand.match, env)
    return unfused, fused, [feeds, ffeeds]


def node_times(gm: fx.GraphModule, args: tuple, iters: int = 3) -> dict[str, float]:
    """CPU time (s, per run) of every node of ``gm`` from torch.profiler, each node labelled
    ``node:<name>`` with ``record_function``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    class Labelled(fx.Interpreter):
        def run_node(self, n):
            if n.op != "call_function":
                return super().run_node(n)
            with record_function(f"node:{n.name}"):
                return super().run_node(n)

    flat = gm.graph._codegen.process_inputs(tuple(args), {})
    with torch.inference_mode():
        Labelled(gm).run(*flat)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(iters):
                Labelled(gm).run(*flat)
    times: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.name.startswith("node:"):
            times[ev.name[5:]] += ev.cpu_time_total * 1e-6 / iters
    return dict(times)


def op_breakdown(gm: fx.GraphModule, times: dict[str, float]) -> dict[str, float]:
    """Share of profiled time per ATen op (``aten::addmm`` ...), largest first."""
    by_op: dict[str, float] = defaultdict(float)
    for n in gm.graph.nodes:
        if n.name in times:
            by_op["aten::" + str(n.target).replace("aten.", "").split(".")[0]] += times[n.name]
    total = sum(by_op.values()) or 1.0
    return dict(sorted(((k, v / total) for k, v in by_op.items()), key=lambda kv: -kv[1]))


GEMM_OPS = ("aten::linear", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::baddbmm")


def amdahl(model, args, fused_module=None, theta: float = 0.3, repeat: int = 10, device=None,
           log=lambda s: None) -> dict:
    """The Amdahl table (see module docstring) as plain data."""
    from opfuse.verify import record_values
    gm, cands = plan_unfused(model, args, theta, device)
    chosen = [c for c in cands if c.decision == "fused"]
    log("profiling the unfused graph")
    times = node_times(gm, args)
    total = sum(times.values())
    env = record_values(gm, args, {})
    log(f"timing {len(chosen)} regions in isolation")
    per: dict[str, dict] = defaultdict(lambda: {"regions": 0, "p": 0.0, "t_unfused_s": 0.0, "t_fused_s": 0.0,
                                                "roofline_unfused_s": 0.0, "roofline_fused_s": 0.0, "ops": set()})
    with torch.inference_mode():
        for c in chosen:
            unfused, fused, (feeds, ffeeds) = region_modules(c, env)
            t = interleaved({"u": lambda: unfused(*feeds), "f": lambda: fused(*ffeeds)}, repeat=repeat, warmup=1)
            row = per[c.match.pattern.name]
            row["regions"] += 1
            row["p"] += sum(times.get(n.name, 0.0) for n in c.match.region) / total
            row["t_unfused_s"] += t["u"]["median_s"]
            row["t_fused_s"] += t["f"]["median_s"]
            row["roofline_unfused_s"] += c.time_unfused
            row["roofline_fused_s"] += c.time_fused
            row["ops"] |= {"aten::" + str(n.target).replace("aten.", "").split(".")[0] for n in c.match.region
                           if n.op == "call_function"}
    log("measuring the whole model")
    fns = {"unfused graph": lambda: gm(*args), "eager": lambda: model(*args)}
    if fused_module is None:
        import opfuse
        fused_module = opfuse.optimize(model, args, theta=theta)
    fns["opfuse"] = lambda: fused_module(*args)
    with torch.inference_mode():
        t = interleaved(fns, repeat=repeat)
    measured = t["unfused graph"]["median_s"] / t["opfuse"]["median_s"]
    outside = []
    for g in (fused_module.report.gemm if fused_module.report else []):
        if not g["times_s"]:
            continue
        if g["pattern"] in per:  # inside a fused region: that region runs the chosen backend
            row = per[g["pattern"]]
            saved = g["times_s"]["aten"] - g["times_s"][g["backend"]]
            row["t_fused_s"] = max(row["t_fused_s"] - saved, 0.25 * row["t_fused_s"])  # two measurements: clamp
        elif not g["pattern"]:
            outside.append(g)
    patterns = []
    for name, row in sorted(per.items(), key=lambda kv: -kv[1]["p"]):
        s = row["t_unfused_s"] / row["t_fused_s"] if row["t_fused_s"] else 1.0
        s_roof = row["roofline_unfused_s"] / row["roofline_fused_s"] if row["roofline_fused_s"] else 1.0
        patterns.append({"pattern": name, "regions": row["regions"], "p": row["p"], "s_fused": s,
                         "s_roofline": s_roof, "t_unfused_ms": 1e3 * row["t_unfused_s"],
                         "t_fused_ms": 1e3 * row["t_fused_s"], "aten_ops": sorted(row["ops"])})
    if outside:
        t_aten = sum(g["times_s"]["aten"] for g in outside)
        t_chosen = sum(g["times_s"][g["backend"]] for g in outside)
        patterns.append({"pattern": "GEMMs outside regions", "regions": len(outside),
                         "p": min(1.0, t_aten / t["unfused graph"]["median_s"]), "s_fused": t_aten / t_chosen,
                         "s_roofline": 1.0, "t_unfused_ms": 1e3 * t_aten, "t_fused_ms": 1e3 * t_chosen,
                         "aten_ops": sorted({f"{g['op']}→{g['backend']}" for g in outside})})
    p_all = sum(r["p"] for r in patterns)
    predicted = 1.0 / ((1.0 - p_all) + sum(r["p"] / r["s_fused"] for r in patterns)) if patterns else 1.0
    predicted_roof = 1.0 / ((1.0 - p_all) + sum(r["p"] / r["s_roofline"] for r in patterns)) if patterns else 1.0
    breakdown = op_breakdown(gm, times)
    return {
        "patterns": patterns, "p_total": p_all, "predicted": predicted, "predicted_roofline": predicted_roof,
        "measured": measured, "measured_vs_eager": t["eager"]["median_s"] / t["opfuse"]["median_s"],
        "error": (predicted - measured) / measured,
        "gemm_share": sum(v for k, v in breakdown.items() if k in GEMM_OPS),
        "op_breakdown": {k: v for k, v in list(breakdown.items())[:12]},
        "latency_ms": {k: 1e3 * v["median_s"] for k, v in t.items()},
    }


def amdahl_table(result: dict):
    from rich.table import Table
    table = Table(title=(f"Amdahl: predicted S_overall {result['predicted']:.3f}x (roofline S_i: "
                         f"{result['predicted_roofline']:.3f}x), measured {result['measured']:.3f}x "
                         f"(unfused graph / opfuse; {result['measured_vs_eager']:.3f}x vs eager), "
                         f"error {100 * result['error']:+.1f}%; GEMMs {100 * result['gemm_share']:.0f}% of unfused time"))
    for col in ("pattern", "regions", "p (share)", "S_fused measured", "S_fused roofline", "unfused ms", "fused ms",
                "ATen ops"):
        table.add_column(col, justify="left" if col in ("pattern", "ATen ops") else "right")
    for r in result["patterns"]:
        table.add_row(r["pattern"], str(r["regions"]), f"{r['p']:.3f}", f"{r['s_fused']:.2f}x",
                      f"{r['s_roofline']:.2f}x", f"{r['t_unfused_ms']:.2f}", f"{r['t_fused_ms']:.2f}",
                      " ".join(o.replace("aten::", "") for o in r["aten_ops"]))
    table.add_row("Σ / overall", "", f"{result['p_total']:.3f}", f"pred {result['predicted']:.3f}x",
                  f"pred {result['predicted_roofline']:.3f}x", "", "", f"measured {result['measured']:.3f}x")
    return table
