"""``opfuse bench MODEL``: opfuse vs eager, inductor and ONNX Runtime on one model and
input shape, one process, interleaved medians after warm-up.

Per peer: cold optimize/compile/export time, median latency, speed-up vs eager
(eager median / peer median), the ratio to the GEMM floor (the model's GEMM FLOPs at the
machine's best measured float32 GEMM rate: the time no float32 system can beat on this
core count), max |Δ| of the first output vs eager, or the reason it failed. Optional: the
Amdahl table (``amdahl=True``) and the θ sweep.
"""

from __future__ import annotations

import dataclasses

import torch

from . import machine
from .peers import build_peers
from .timing import interleaved

# (batch, seq, attention implementation) per model when not given
DEFAULT_SHAPES = {"minilm": (8, 128, "eager"), "bert-base": (1, 128, "sdpa"), "gpt2": (1, 256, "sdpa"),
                  "llama": (1, 256, "sdpa")}


def family_of(name: str) -> str:
    return "minilm" if name == "minilm" else name.split("-")[0]


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        import numba
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except Exception:  # noqa: BLE001  numba threading layer unavailable: kernels run as they are
        pass


def gemm_flops(model, args) -> int | None:
    """GEMM FLOPs of one forward (2·M·N·K per linear / matmul / bmm; the two GEMMs of each
    SDPA call, 4·B·H·Sq·Sk·D), counted on the captured unfused graph; None when it cannot
    be captured whole."""
    from opfuse.graph.capture import CaptureError, capture
    from opfuse.graph.meta import node_flops, node_value
    aten = torch.ops.aten
    try:
        gm = capture(model, tuple(args), {})
    except CaptureError:
        return None
    total = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in (aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default,
                        aten.bmm.default):
            total += node_flops(n)
        elif n.target is aten.scaled_dot_product_attention.default:
            q, k = node_value(n.args[0]), node_value(n.args[1])
            total += 4 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
    return total


def best_gemm_rate(n: int = 1024) -> dict:
    """float32 FLOP/s of an n³ GEMM through each library opfuse reaches (aten ``mm`` — MKL or
    OpenBLAS —, oneDNN's inner product and, at one thread, numpy's OpenBLAS: the ``blas``
    GEMM backend), best of a few runs, current thread count."""
    from opfuse.gemm import _blas_available
    from opfuse.kernels.cpu._gemm import blas_mm
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    rates = {"aten": 2 * n ** 3 / interleaved({"f": lambda: torch.mm(a, b, out=c)}, repeat=5, warmup=1)["f"]["min_s"]}
    if _blas_available():
        f = lambda: blas_mm(a, b, out=c)  # noqa: E731
        rates["openblas"] = 2 * n ** 3 / interleaved({"f": f}, repeat=5, warmup=1)["f"]["min_s"]
    try:
        f = lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")  # noqa: E731
        rates["onednn"] = 2 * n ** 3 / interleaved({"f": f}, repeat=5, warmup=1)["f"]["min_s"]
    except Exception:  # noqa: BLE001  no oneDNN in this torch build
        pass
    return rates


def bench_model(name: str, against=("inductor", "ort"), threads: int = 1, batch: int | None = None,
                seq: int | None = None, attn: str | None = None, repeat: int = 20, theta: float = 0.3,
                with_amdahl: bool = False, with_theta_sweep: bool = False, measure_device: bool = True,
                with_breakdown: bool = False, log=lambda s: None) -> dict:
    """Run the comparison and return it as plain data (see module docstring)."""
    from opfuse.models import load
    b, s, a = DEFAULT_SHAPES.get(name, (1, 128, "eager"))
    batch, seq, attn = batch or b, seq or s, attn or a
    set_threads(threads)
    result: dict = {"model": name, "batch": batch, "seq": seq, "attn": attn, "threads": threads, "theta": theta,
                    "repeat": repeat, "machine": machine.describe()}
    device = None
    if measure_device:
        from opfuse.cost.device import measured_cpu_profile
        log("measuring the device profile (cached)")
        device = measured_cpu_profile()
        result["device_profile"] = dataclasses.asdict(device)
    log(f"loading {name} {batch}x{seq} ({attn})")
    loaded = load(name, batch=batch, seq=seq, attn=attn)
    model, args = loaded.model, loaded.args
    peers = build_peers(list(against), model, args, family_of(name), name, threads, theta, log=log)
    ok = [p for p in peers if p.fn is not None]
    ref = ok[0].fn()  # eager
    for p in ok:
        try:
            out = p.fn()
            p.detail["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
            p.detail["pooled_cosine"] = pooled_cosine(out, ref, args[1] if len(args) > 1 else None)
        except Exception as exc:  # noqa: BLE001  a peer that builds but cannot run
            p.error, p.fn = f"run failed: {type(exc).__name__}: {str(exc)[:200]}", None
    ok = [p for p in peers if p.fn is not None]
    log(f"timing {', '.join(p.name for p in ok)} ({repeat} interleaved rounds)")
    times = interleaved({p.name: p.fn for p in ok}, repeat=repeat, warmup=3)
    eager = times["eager"]["median_s"]
    rates = best_gemm_rate()
    flops = gemm_flops(model, args)
    floor_s = flops / max(rates.values()) if flops else None
    result["gemm_floor"] = {"gemm_flops": flops, "gemm_rates_flops": rates, "floor_ms": 1e3 * floor_s if floor_s else None}
    rows = []
    for p in peers:
        t = times.get(p.name)
        rows.append({
            "peer": p.name, "status": "ok" if p.fn else "failed", "error": p.error,
            "cold_s": p.cold_s, "median_ms": 1e3 * t["median_s"] if t else None,
            "iqr_ms": 1e3 * t["iqr_s"] if t else None, "n": t["n"] if t else 0,
            "speedup_vs_eager": eager / t["median_s"] if t else None,
            "vs_gemm_floor": t["median_s"] / floor_s if t and floor_s else None,
            "max_abs_diff": p.detail.get("max_abs_diff"), "pooled_cosine": p.detail.get("pooled_cosine"),
            "notes": {k: v for k, v in p.detail.items() if k not in ("module", "max_abs_diff", "pooled_cosine")},
        })
    result["peers"] = rows
    fused = next((p.detail.get("module") for p in peers if p.name == "opfuse"), None)
    if fused is not None:
        result["fusion"] = fused.report.totals
    if with_breakdown:
        from .breakdown import breakdown
        log("profiling eager and opfuse (time by category)")
        result["breakdown"] = {p.name: breakdown(p.fn) for p in ok if p.name in ("eager", "opfuse")}
    if with_amdahl:
        from .amdahl import amdahl
        result["amdahl"] = amdahl(model, args, fused, theta=theta, repeat=max(5, repeat // 2), device=device, log=log)
    if with_theta_sweep:
        from .theta import theta_sweep
        result["theta_sweep"] = theta_sweep(model, args, name, repeat=max(5, repeat // 2), log=log)
    result["machine"]["loadavg_end"] = machine.load_average()
    return result


def peers_table(result: dict):
    from rich.table import Table
    m = result["machine"]
    table = Table(title=(f"{result['model']} {result['batch']}x{result['seq']} ({result['attn']} attention), "
                         f"{result['threads']} thread(s), median of {result['repeat']} interleaved runs — "
                         f"{m['cpu']}, load {m['loadavg_start']} → {m.get('loadavg_end')}"))
    floor = result.get("gemm_floor", {})
    if floor.get("floor_ms"):
        table.caption = (f"GEMM floor {floor['floor_ms']:.2f} ms = {floor['gemm_flops'] / 1e9:.2f} GFLOP at the best "
                         "measured float32 GEMM rate (" + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in
                                                                     floor["gemm_rates_flops"].items()) + " GFLOP/s)")
    for col in ("peer", "status", "cold s", "median ms", "IQR ms", "vs eager", "× floor", "max |Δ| vs eager",
                "min cos (pooled)", "notes"):
        table.add_column(col, justify="left" if col in ("peer", "status", "notes") else "right")
    for r in result["peers"]:
        if r["status"] != "ok":
            table.add_row(r["peer"], "[red]failed[/]", "", "", "", "", "", "", "", r["error"] or "")
            continue
        notes = r["notes"]
        note = " ".join(f"{k}:{v}" for k, v in notes.get("fused", {}).items()) if isinstance(notes.get("fused"), dict) else ""
        if notes.get("gemm"):
            note = f"{note} gemm " + " ".join(f"{k}:{v}" for k, v in notes["gemm"].items())
        if notes.get("export"):
            note = f"{notes['export']} {note}".strip()
        table.add_row(r["peer"], "ok", f"{r['cold_s']:.1f}", f"{r['median_ms']:.2f}", f"{r['iqr_ms']:.2f}",
                      f"{r['speedup_vs_eager']:.2f}x", f"{r['vs_gemm_floor']:.2f}" if r.get("vs_gemm_floor") else "",
                      f"{r['max_abs_diff']:.1e}",
                      f"{r['pooled_cosine']:.6f}" if r.get("pooled_cosine") is not None else "", note)
    return table


def pooled_cosine(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Smallest cosine, over the batch, between a peer's and eager's mean-pooled outputs:
    [B, S, H] hidden states averaged over the positions ``mask`` [B, S] keeps (all when
    None), as sentence-transformers pools an embedding; other shapes: the cosine of the
    flattened outputs. Computed in float64."""
    a, b = out.detach().double(), ref.detach().double()
    if a.dim() == 3 and a.shape == b.shape:
        keep = torch.ones(a.shape[:2], dtype=torch.float64) if mask is None or tuple(mask.shape) != a.shape[:2] \
            else mask.double()
        a, b = ((t * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1) for t in (a, b))
    else:
        a, b = a.reshape(1, -1), b.reshape(1, -1)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def csv_rows(result: dict) -> list[dict]:
    head = {k: result[k] for k in ("model", "batch", "seq", "attn", "threads")}
    head["cpu"] = result["machine"]["cpu"]
    return [{**head, **{k: v for k, v in r.items() if k != "notes"}} for r in result["peers"]]


def default_stem(result: dict) -> str:
    return f"cpu_{result['model']}_{result['batch']}x{result['seq']}_{result['attn']}_t{result['threads']}"
