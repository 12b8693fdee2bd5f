"""θ sweep: for θ in {0, 0.1, …, 0.9}, the fused regions, predicted memory traffic and
measured latency of opfuse (medians interleaved with eager)."""

from __future__ import annotations

import time

import torch

from .timing import interleaved

THETAS = tuple(round(0.1 * i, 1) for i in range(10))


def theta_sweep(model, args, name: str, thetas=THETAS, repeat: int = 10, log=lambda s: None) -> list[dict]:
    import opfuse
    from .peers import first_tensor
    fused = {}
    rows = []
    for th in thetas:
        log(f"optimize θ={th}")
        t = time.perf_counter()
        fused[th] = opfuse.optimize(model, args, theta=th, name=name)
        rep = fused[th].report
        tot = rep.totals
        rows.append({"theta": th, "fused_regions": tot["fused_regions"], "per_pattern": tot["per_pattern"],
                     "mb_unfused": tot["bytes_unfused"] / 1e6, "mb_fused": tot["bytes_fused"] / 1e6,
                     "reduction": tot["reduction"], "optimize_s": time.perf_counter() - t})
    fns = {"eager": lambda: first_tensor(model(*args))}
    fns.update({f"θ={th}": (lambda m=m: first_tensor(m(*args))) for th, m in fused.items()})
    log("timing")
    with torch.inference_mode():
        t = interleaved(fns, repeat=repeat)
    eager = t["eager"]["median_s"]
    for row in rows:
        ms = t[f"θ={row['theta']}"]["median_s"]
        row.update(latency_ms=1e3 * ms, vs_eager=eager / ms)
    return rows


def theta_table(rows: list[dict], eager_ms: float | None = None):
    from rich.table import Table
    table = Table(title="θ sweep (latency: median, interleaved with eager)")
    for col in ("θ", "fused", "per pattern", "MB unfused", "MB fused", "traffic saved", "latency ms", "vs eager"):
        table.add_column(col, justify="left" if col == "per pattern" else "right")
    for r in rows:
        pp = " ".join(f"{k}:{v}" for k, v in sorted(r["per_pattern"].items()))
        table.add_row(f"{r['theta']:.1f}", str(r["fused_regions"]), pp, f"{r['mb_unfused']:.1f}",
                      f"{r['mb_fused']:.1f}", f"{100 * r['reduction']:.1f}%", f"{r['latency_ms']:.2f}",
                      f"{r['vs_eager']:.2f}x")
    return table
