"""Serving benchmark: a stream of requests of random lengths, every system in one process.

Each request is a batch of ``batch`` token sequences whose lengths are drawn uniformly
from [lo, hi], padded to the longest (attention mask). Systems: PyTorch eager, opfuse with
one dynamic plan (``optimize(dynamic=True)``, planned once at a typical size before the
stream), ONNX Runtime on an export with dynamic batch and sequence axes, OpenVINO with
dynamic input shapes (float32); and, for the bf16 comparison, ``opfuse-bf16`` (the same
dynamic plan with ``precision="bf16"``) and ``openvino-default`` (OpenVINO at the device's
default precision: bf16 on a CPU with native bf16). Requests are served round-robin (every
system runs request i before anyone runs request i + 1; the order of systems rotates per
request), so machine noise hits all alike. Per system: total seconds over the stream, p50
/ p99 latency, the largest per-request latency, the p50 and p99 of each request's time
relative to eager's on the same request (a stall — a re-plan, a recompile — shows as a p99
far above the p50, whatever the lengths), max |Δ| of the first output vs eager over the
valid positions, and the one-time cost before the stream (optimize / export / compile).
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch

from .peers import FirstOutput, _one_line, _session


@dataclass
class System:
    name: str
    fn: object = None  # fn(ids, mask) -> tensor [batch, seq, hidden]
    cold_s: float = 0.0
    error: str = ""
    latencies: list = field(default_factory=list)
    max_err: float = 0.0
    fused: object = None  # opfuse's FusedModule (plans, re-plans for the result)
    precision: str = ""  # what it computed in, where the system says (OpenVINO's inference precision)


def make_requests(n: int, batch: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple]:
    """``n`` (input_ids, attention_mask) pairs [batch, longest] int64: lengths uniform in
    [lo, hi] per sequence, right padding, ids uniform in [min(1000, vocab / 2), vocab) (ordinary tokens; 0 is padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(lo, hi + 1, (batch,), generator=g)
        seq = int(lengths.max())
        ids = torch.randint(min(1000, vocab // 2), vocab, (batch, seq), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        out.append((ids * mask, mask))
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation (numpy's default)."""
    import numpy as np
    return float(np.quantile(np.asarray(values), q))


def _eager(model) -> System:
    def fn(ids, mask):
        with torch.inference_mode():
            return model(ids, mask)[0]
    return System("eager", fn)


def _opfuse(model, example, buckets=None, name: str = "opfuse", precision: str = "fp32") -> System:
    import opfuse
    t = time.perf_counter()
    try:
        fused = opfuse.optimize(model, example, dynamic=True, name="serving", buckets=buckets, precision=precision)
    except Exception as exc:  # noqa: BLE001  a failure is a reported result
        return System(name, error=f"optimize failed: {_one_line(exc)}")
    cold = time.perf_counter() - t

    def fn(ids, mask):
        with torch.no_grad():
            return fused(ids, mask)[0]
    return System(name, fn, cold_s=cold, fused=fused)


def _ort(model, example, threads: int, workdir: str) -> System:
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        return System("ort", error=f"onnxruntime not installed ({exc})")
    path = os.path.join(workdir, "serving.onnx")
    t = time.perf_counter()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            axes = {0: "batch", 1: "seq"}
            torch.onnx.export(FirstOutput(model).eval(), tuple(example), path, input_names=["input_ids", "attention_mask"],
                              output_names=["output"], dynamic_axes={"input_ids": axes, "attention_mask": axes,
                                                                     "output": axes}, opset_version=17, dynamo=False)
        sess = _session(path, threads)
    except Exception as exc:  # noqa: BLE001
        return System("ort", error=f"export/session failed: {_one_line(exc)}")
    cold = time.perf_counter() - t

    def fn(ids, mask):
        return torch.from_numpy(sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0])
    return System("ort", fn, cold_s=cold)


def _openvino(model, example, threads: int, name: str = "openvino", hint: str | None = "f32") -> System:
    """OpenVINO with dynamic [batch, seq] inputs; ``hint`` its INFERENCE_PRECISION_HINT
    (None: the device's default, reported in the system's ``precision``)."""
    try:
        import openvino as ov
    except ImportError as exc:
        return System(name, error=f"openvino not installed ({exc})")
    t = time.perf_counter()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            converted = ov.convert_model(FirstOutput(model).eval(), example_input=tuple(example))
        converted.reshape({inp.get_any_name(): ov.PartialShape([-1, -1]) for inp in converted.inputs})
        config = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
        if hint is not None:
            config["INFERENCE_PRECISION_HINT"] = hint
        compiled = ov.Core().compile_model(converted, "CPU", config)
        request = compiled.create_infer_request()
        precision = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    except Exception as exc:  # noqa: BLE001
        return System(name, error=f"conversion/compile failed: {_one_line(exc)}")
    cold = time.perf_counter() - t

    def fn(ids, mask):
        request.infer([ids.numpy(), mask.numpy()])
        return torch.from_numpy(request.get_output_tensor(0).data.copy())
    return System(name, fn, cold_s=cold, precision=precision)


def bench_serving(model, n: int = 200, batch: int = 1, lo: int = 8, hi: int = 384, threads: int = 1,
                  against=("eager", "opfuse", "ort", "openvino"), example_seq: int = 128, seed: int = 0,
                  buckets=None) -> dict:
    """Serve ``n`` requests (:func:`make_requests`) with every system of ``against``
    round-robin; returns {"config": ..., "systems": {name: {total_s, p50_s, p99_s, max_s,
    cold_s, max_abs_err, error}}, "opfuse": {plans, replans, dynamic}}.

    ``model``: a BERT-style encoder taking (input_ids, attention_mask); the opfuse plan is
    made at [batch, example_seq] before the stream (its cost is ``cold_s``), with
    ``optimize``'s ``buckets`` (a plan per token bucket where measured faster)."""
    torch.set_num_threads(threads)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 30522)
    requests = make_requests(n, batch, lo, hi, vocab, seed)
    example = make_requests(1, batch, example_seq, example_seq, vocab, seed + 1)[0]
    builders = {"eager": lambda: _eager(model), "opfuse": lambda: _opfuse(model, example, buckets),
                "ort": lambda: _ort(model, example, threads, tempfile.mkdtemp(prefix="opfuse-serving-")),
                "openvino": lambda: _openvino(model, example, threads),
                "opfuse-bf16": lambda: _opfuse(model, example, buckets, "opfuse-bf16", "bf16"),
                "openvino-default": lambda: _openvino(model, example, threads, "openvino-default", None)}
    systems = [builders[name]() for name in against]
    live = [s for s in systems if s.fn is not None]
    for i, (ids, mask) in enumerate(requests):
        order = live[i % len(live):] + live[:i % len(live)] if live else []
        outs = {}
        for s in order:
            t = time.perf_counter()
            outs[s.name] = s.fn(ids, mask)
            s.latencies.append(time.perf_counter() - t)
        ref = outs.get("eager")
        if ref is not None:
            valid = mask.bool()
            for s in live:
                s.max_err = max(s.max_err, float((outs[s.name][valid] - ref[valid]).abs().max()))
    result = {"config": {"requests": n, "batch": batch, "lengths": [lo, hi], "threads": threads,
                         "example": [batch, example_seq], "buckets": buckets}, "systems": {}}
    eager = next((s for s in live if s.name == "eager"), None)
    for s in systems:
        if s.error:
            result["systems"][s.name] = {"error": s.error}
            continue
        lat = s.latencies
        result["systems"][s.name] = {"total_s": sum(lat), "p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99),
                                     "max_s": max(lat), "cold_s": s.cold_s, "max_abs_err": s.max_err}
        if s.precision:
            result["systems"][s.name]["precision"] = s.precision
        if eager is not None:  # stalls independent of the length: time per request relative to eager's
            rel = [a / b for a, b in zip(lat, eager.latencies)]
            result["systems"][s.name].update(rel_p50=percentile(rel, 0.5), rel_p99=percentile(rel, 0.99))
        if s.name == "opfuse-bf16":
            p = s.fused.report.precision
            result["systems"][s.name]["precision"] = (
                f"bf16 regions {sum(g['precision'] == 'bf16' for g in p.get('gemms', []))}/{len(p.get('gemms', []))}, "
                f"replans {len(s.fused.replans)}")
        if s.name == "opfuse":
            fused = s.fused
            result["opfuse"] = {"plans": len(fused.reports), "replans": list(fused.replans),
                                "fused": fused.report.counts(), "dynamic": fused.report.dynamic,
                                "buckets": [bucket_row(r) for r in fused.reports]}
    return result


def bucket_row(report) -> dict:
    """One plan of a dynamic FusedModule: its token bucket (None: not a bucket plan),
    decided-at sizes, fused counts per pattern and GEMM backends chosen (count per name)."""
    from collections import Counter
    return {"tokens": report.dynamic.get("tokens"), "decided_at": report.dynamic.get("decided_at"),
            "fused": report.counts(), "gemm": dict(Counter(g["backend"] for g in report.gemm))}


def serving_table(result: dict):
    """A rich Table of :func:`bench_serving`'s result (ratios vs eager's total)."""
    from rich.table import Table
    c = result["config"]
    table = Table(title=f"serving {c['requests']} requests, batch {c['batch']}, lengths {c['lengths'][0]}–"
                        f"{c['lengths'][1]}, {c['threads']} thread(s)")
    for col in ("system", "total s", "vs eager", "p50 ms", "p99 ms", "max ms", "rel. p50", "rel. p99",
                "before stream s", "max|Δ| vs eager", "precision"):
        table.add_column(col, justify="left" if col in ("system", "precision") else "right")
    base = result["systems"].get("eager", {}).get("total_s")
    for name, r in result["systems"].items():
        if "error" in r:
            table.add_row(name, r["error"][:80], *[""] * 9)
            continue
        table.add_row(name, f"{r['total_s']:.1f}", f"{base / r['total_s']:.2f}x" if base else "",
                      f"{r['p50_s'] * 1e3:.1f}", f"{r['p99_s'] * 1e3:.1f}", f"{r['max_s'] * 1e3:.1f}",
                      f"{r.get('rel_p50', float('nan')):.2f}", f"{r.get('rel_p99', float('nan')):.2f}",
                      f"{r['cold_s']:.1f}", f"{r['max_abs_err']:.1e}", r.get("precision", ""))
    return table
