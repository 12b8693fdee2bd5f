"""Command line: ``opfuse demo | optimize MODEL | explain MODEL | bench MODEL | patterns``.

Errors (unknown model, missing directory, capture failure) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from rich.console import Console
from rich.table import Table


def latency_table(model, fused, args, kwargs, repeat: int) -> tuple[Table, dict]:
    """Eager vs opfuse median latency (ms), one thread and all threads, interleaved (one call
    of each per round, so machine noise hits both alike)."""
    import torch

    from opfuse.bench.timing import interleaved
    threads_all = torch.get_num_threads()
    table = Table(title=f"Latency (median of {repeat} runs)")
    for col in ("threads", "eager ms", "opfuse ms", "speed-up"):
        table.add_column(col, justify="right")
    results = {}
    for threads in sorted({1, threads_all}):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            t = interleaved({"eager": lambda: model(*args, **kwargs), "opfuse": lambda: fused(*args, **kwargs)},
                            repeat=repeat)
        eager, ours = 1e3 * t["eager"]["median_s"], 1e3 * t["opfuse"]["median_s"]
        results[threads] = (eager, ours)
        table.add_row(str(threads), f"{eager:.2f}", f"{ours:.2f}", f"{eager / ours:.2f}x")
    torch.set_num_threads(threads_all)
    from opfuse.bench.machine import load_average
    load = load_average()
    if load and load[0] >= os.cpu_count() - 0.5:
        table.caption = (f"load average {load[0]:.1f} on {os.cpu_count()} CPUs: other processes share the cores, "
                         "so multi-thread timings stall and their ratios mean little; compare the 1-thread row")
    return table, results


def cmd_demo(ns, console: Console) -> int:
    import torch

    import opfuse
    from opfuse.models import load
    from opfuse.report.text import print_report

    with console.status("loading all-MiniLM-L6-v2 (real weights, offline)"):
        loaded = load("minilm", batch=ns.batch, seq=0, attn=ns.attn)
    model, args = loaded.model, loaded.args
    console.print(f"[bold]all-MiniLM-L6-v2[/] ({ns.attn} attention), {len(args[0])} real sentences, "
                  f"input_ids {list(args[0].shape)}")
    with console.status("capture → match → cost → verify → rewrite"):
        t = time.perf_counter()
        fused = opfuse.optimize(model, args, theta=ns.theta, name="all-MiniLM-L6-v2")
        cold = time.perf_counter() - t
    print_report(fused.report, console)
    console.print(f"optimize (cold): {cold:.2f} s")
    _write_html(fused.report, ns.report, console)
    with torch.inference_mode():
        ref = model(*args).last_hidden_state
        out = fused(*args).last_hidden_state
    mask = args[1].unsqueeze(-1).to(ref.dtype)
    pool = lambda h: (h * mask).sum(1) / mask.sum(1)  # noqa: E731  sentence-transformers mean pooling
    cos = torch.nn.functional.cosine_similarity(pool(ref), pool(out), dim=-1)
    delta = (out - ref).abs().max().item()
    ok = cos.min().item() >= 0.99999
    console.print(f"[bold]Correctness[/]: max |Δ| last_hidden_state = {delta:.2e}; "
                  f"cosine of mean-pooled embeddings: min {cos.min().item():.7f} "
                  f"[{'green' if ok else 'red'}]{'OK' if ok else 'FAIL'} (≥ 0.99999)[/]")
    table, _ = latency_table(model, fused, args, {}, ns.repeat)
    console.print(table)
    return 0 if ok else 1


def cmd_optimize(ns, console: Console, explain_only: bool = False) -> int:
    import opfuse
    from opfuse.models import load
    from opfuse.report.text import print_report

    with console.status(f"loading {ns.model}"):
        loaded = load(ns.model, batch=ns.batch, seq=ns.seq, attn=ns.attn)
    with console.status("capture → match → cost" + ("" if explain_only else " → verify → rewrite")):
        if explain_only:
            report = opfuse.explain(loaded.model, loaded.args, theta=ns.theta, name=ns.model,
                                    example_kwargs=loaded.kwargs)
        else:
            fused = opfuse.optimize(loaded.model, loaded.args, theta=ns.theta, name=ns.model,
                                    example_kwargs=loaded.kwargs, dynamic=bool(getattr(ns, "dynamic", False)),
                                    gemm=getattr(ns, "gemm", None), precision=getattr(ns, "precision", "fp32"))
            report = fused.report
    print_report(report, console, limit=None if ns.all else 40)
    if not explain_only and getattr(ns, "save", None):
        opfuse.save(fused, ns.save)
        console.print(f"saved the plan to {ns.save} (opfuse load {ns.save} runs it without the model)")
    if ns.json:
        report.to_json(ns.json)
        console.print(f"wrote {ns.json}")
    _write_html(report, ns.report, console)
    return 0


def _inputs_of(report, batch: int, seq: int) -> tuple:
    """Inputs like the saved plan's (``report.inputs``: ``arg0:[2, 16]:int64``) at ``batch``
    × ``seq`` where the plan is dynamic (else its own shapes): token ids 0..99 for the
    first integer input, ones (an all-valid mask) for the others, normal floats."""
    import ast

    import torch
    out = []
    dynamic = bool(report.dynamic.get("dims"))
    for i, spec in enumerate(report.inputs):
        _name, shape, dtype = spec.rsplit(":", 2)
        shape = ast.literal_eval(shape)
        if dynamic and len(shape) >= 2:
            shape[0] = batch
            if dtype.startswith(("int", "bool")) or len(shape) == 3:
                shape[1] = seq
        dt = getattr(torch, dtype)
        if dt.is_floating_point:
            out.append(torch.randn(shape, dtype=dt))
        else:
            out.append(torch.randint(0, 100, shape, dtype=dt) if i == 0 else torch.ones(shape, dtype=dt))
    return tuple(out)


def cmd_load(ns, console: Console) -> int:
    """``opfuse load DIR``: load a saved plan (no model), print its report, the load time and
    the median of ``--repeat`` forwards at ``--batch`` × ``--seq``."""
    import time

    import torch

    import opfuse
    from opfuse.report.text import dynamic_line, print_report
    t0 = time.perf_counter()
    fused = opfuse.load(ns.dir)
    load_s = time.perf_counter() - t0
    print_report(fused.report, console, limit=None if ns.all else 40)
    args = _inputs_of(fused.report, ns.batch, ns.seq)
    times = []
    with torch.no_grad():
        for _ in range(ns.repeat + 1):
            t = time.perf_counter()
            fused(*args)
            times.append(time.perf_counter() - t)
    times = sorted(times[1:])
    console.print(f"loaded {ns.dir} in {load_s * 1e3:.0f} ms; {dynamic_line(fused.report) or 'static plan'}; "
                  f"forward on {', '.join(str(list(a.shape)) for a in args)}: median "
                  f"{times[len(times) // 2] * 1e3:.2f} ms over {ns.repeat}")
    return 0


def _write_html(report, path: str | None, console: Console) -> None:
    """``--report PATH``: the self-contained HTML page (graph, table, plots)."""
    if path:
        with console.status(f"writing {path} (graphviz + plotly)"):
            report.to_html(path)
        console.print(f"wrote {path}")


def _spelling(fn) -> str:
    """The torch code a pattern row matches: its function body without the ``def`` line."""
    import inspect
    try:
        lines = inspect.getsource(fn).splitlines()[1:]
    except (OSError, TypeError):
        return fn.__name__
    body = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith(('"""', "#"))]
    text = "; ".join(body).replace("return ", "")
    return text if len(text) <= 160 else text[:157] + "..."


def cmd_patterns(ns, console: Console) -> int:
    from opfuse.patterns import LIBRARY
    table = Table(title="Pattern library")
    for col in ("pattern", "variant", "source spelling"):
        table.add_column(col)
    for p in LIBRARY:
        table.add_row(p.name, p.variant + (" (retarget)" if p.retarget else ""), _spelling(p.fn))
    console.print(table)
    return 0


def cmd_bench(ns, console: Console) -> int:
    """``opfuse bench MODEL``: peers table (+ Amdahl, θ sweep); JSON/CSV with the machine."""
    from opfuse.bench import models as bench
    from opfuse.bench.results import write_csv, write_json
    if ns.generate:
        return _bench_generate(ns, console)
    with console.status("benchmarking") as status:
        result = bench.bench_model(ns.model, against=ns.against.split(","), threads=ns.threads, batch=ns.batch,
                                   seq=ns.seq, attn=ns.attn, repeat=ns.repeat, theta=ns.theta,
                                   with_amdahl=ns.amdahl, with_theta_sweep=ns.theta_sweep,
                                   with_breakdown=ns.breakdown, log=lambda s: status.update(s))
    console.print(bench.peers_table(result))
    if "amdahl" in result:
        from opfuse.bench.amdahl import amdahl_table
        console.print(amdahl_table(result["amdahl"]))
    if "breakdown" in result:
        from opfuse.bench.breakdown import breakdown_table
        console.print(breakdown_table(result["breakdown"]))
    if "theta_sweep" in result:
        from opfuse.bench.theta import theta_table
        console.print(theta_table(result["theta_sweep"]))
    console.print("[dim]shared, noisy machine: medians of interleaved runs; compare ratios, not absolute ms[/]")
    if ns.json:
        write_json(result, ns.json)
        write_csv(bench.csv_rows(result), str(ns.json).removesuffix(".json") + ".csv")
        console.print(f"wrote {ns.json} (+ .csv)")
    return 0


def _bench_generate(ns, console: Console) -> int:
    """``opfuse bench MODEL --generate``: prefill / decode tokens/s vs HF eager and HF
    StaticCache + torch.compile (``inductor`` in ``--against``), with the weight-bandwidth floor."""
    from opfuse.bench.generate import bench_generate, csv_rows, generate_table
    from opfuse.bench.results import write_csv, write_json
    against = [{"inductor": "static-compile"}.get(a.strip(), a.strip()) for a in ns.against.split(",")]
    with console.status("benchmarking generate") as status:
        result = bench_generate(ns.model, batch=ns.batch or 1, prompt=ns.prompt, new=ns.new, threads=ns.threads,
                                against=against, repeat=max(1, min(ns.repeat, 5)), log=lambda s: status.update(s),
                                with_breakdown=ns.breakdown)
    console.print(generate_table(result))
    if result["breakdown"]:
        from opfuse.bench.breakdown import breakdown_table
        console.print(breakdown_table(result["breakdown"], per="decode step"))
    opfuse_row = next((r for r in result["peers"] if r["peer"] == "opfuse" and r.get("plans")), None)
    if opfuse_row:
        from opfuse.report.text import generation_table
        console.print(generation_table(opfuse_row["plans"]))
    console.print("[dim]shared, noisy machine: medians of interleaved runs; compare ratios, not absolute ms[/]")
    if ns.json:
        write_json(result, ns.json)
        write_csv(csv_rows(result),
                  str(ns.json).removesuffix(".json") + ".csv")
        console.print(f"wrote {ns.json} (+ .csv)")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="opfuse", description="pattern-aware operator fusion for Transformer inference")
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="the main job: all-MiniLM-L6-v2, real weights, real sentences")
    demo.add_argument("--theta", type=float, default=0.3)
    demo.add_argument("--batch", type=int, default=8, help="number of sentences (≤ 8)")
    demo.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    demo.add_argument("--repeat", type=int, default=30)
    demo.add_argument("--report", metavar="PATH", help="also write the HTML report (graph, table, plots)")
    for name in ("optimize", "explain"):
        p = sub.add_parser(name, help=f"{name} MODEL and print the report")
        p.add_argument("model", help="minilm, bert-base, gpt2, llama, vit, bert-tiny, gpt2-tiny, llama-tiny, vit-tiny, "
                                     "an architecture of the tier (bloom, gemma, deberta-v3, …: opfuse.zoo) "
                                     "or a local Hugging Face directory")
        p.add_argument("--theta", type=float, default=0.3)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--seq", type=int, default=128)
        p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
        p.add_argument("--json", help="also write report.to_dict() to this file")
        p.add_argument("--report", metavar="PATH", help="also write the HTML report (graph, table, plots)")
        p.add_argument("--all", action="store_true", help="list every region")
        if name == "optimize":
            p.add_argument("--dynamic", action="store_true",
                           help="one plan for every batch and sequence length (opfuse.optimize(dynamic=True))")
            p.add_argument("--save", metavar="DIR", help="save the plan to DIR (opfuse.save); run it with opfuse load")
            p.add_argument("--gemm", default=None,
                           help="GEMM backend: auto (measured, default), lean (measured, no weight copies), aten, wt, "
                                "onednn, packed, gemv")
            p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                           help="bf16: GEMM regions in bf16 where measured error and time allow (opfuse.precision)")
    ld = sub.add_parser("load", help="load a plan saved by opfuse optimize --save DIR, print its report and time it")
    ld.add_argument("dir")
    ld.add_argument("--batch", type=int, default=1, help="batch of the timed forward (dynamic plans)")
    ld.add_argument("--seq", type=int, default=128, help="sequence length of the timed forward (dynamic plans)")
    ld.add_argument("--repeat", type=int, default=10)
    ld.add_argument("--all", action="store_true", help="list every region")
    b = sub.add_parser("bench", help="latency of opfuse vs eager, torch.compile and ONNX Runtime on MODEL")
    b.add_argument("model", help="minilm, bert-base, gpt2, llama, an architecture of the tier (bloom, gemma, "
                                 "deberta-v3, …: opfuse.zoo) or any name opfuse.models.load knows")
    b.add_argument("--against", default="eager,inductor,ort,openvino",
                   help="comma list of eager, opfuse-aten (opfuse with eager's GEMMs), inductor, ort (brings ort-opt), "
                        "openvino (f32; brings openvino-default, the device's default precision)")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--batch", type=int, default=None, help="default per model (minilm 8, others 1)")
    b.add_argument("--seq", type=int, default=None, help="default per model (128 or 256)")
    b.add_argument("--attn", default=None, choices=["eager", "sdpa"], help="default per model")
    b.add_argument("--theta", type=float, default=0.3)
    b.add_argument("--repeat", type=int, default=20)
    b.add_argument("--generate", action="store_true",
                   help="token generation (llama, gpt2, qwen2): prefill and decode tokens/s, HF eager / "
                        "HF StaticCache + torch.compile / opfuse, and the weight-bandwidth floor")
    b.add_argument("--prompt", type=int, default=128, help="--generate: prompt tokens")
    b.add_argument("--new", type=int, default=128, help="--generate: new tokens per sequence")
    b.add_argument("--amdahl", action="store_true", help="per-pattern p and S_fused -> predicted vs measured")
    b.add_argument("--theta-sweep", action="store_true", help="regions, traffic, latency for θ = 0, 0.1 … 0.9")
    b.add_argument("--breakdown", action="store_true",
                   help="eager's and opfuse's time per call: GEMM, attention, fused, other ATen, overhead (profiler)")
    b.add_argument("--json", help="write the result (with the machine description) here, and a .csv beside it")
    sub.add_parser("patterns", help="list the pattern library")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    from opfuse.report.text import wide_console
    console = wide_console()
    from opfuse.api import OptimizeError
    from opfuse.graph.capture import CaptureError
    from opfuse.models import ModelNotFound
    from opfuse.persist import LoadError, SaveError
    try:
        if ns.cmd == "demo":
            return cmd_demo(ns, console)
        if ns.cmd in ("optimize", "explain"):
            return cmd_optimize(ns, console, explain_only=ns.cmd == "explain")
        if ns.cmd == "bench":
            return cmd_bench(ns, console)
        if ns.cmd == "load":
            return cmd_load(ns, console)
        return cmd_patterns(ns, console)
    except (ModelNotFound, OptimizeError, CaptureError, FileNotFoundError, LoadError, SaveError) as exc:
        print(f"opfuse: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # anything else (a broken config.json, ...): one line, no traceback
        if os.environ.get("OPFUSE_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"opfuse: error: {type(exc).__name__}: {first} (OPFUSE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
