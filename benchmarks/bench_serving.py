"""Serving loop: random-length requests through eager, opfuse (one dynamic plan, or one per token bucket), ONNX
Runtime (dynamic axes) and OpenVINO (dynamic shapes), in one process, round-robin.

    .venv/bin/python benchmarks/bench_serving.py --model bert-base --requests 200 --batch 1
    .venv/bin/python benchmarks/bench_serving.py --model bert-base --requests 40 --batch 8
    .venv/bin/python benchmarks/bench_serving.py ... --buckets   # opfuse: a plan per token bucket

Targets (issue 17): opfuse's total ahead of both peers; no stall (its p99 time per request
relative to eager within 1.2x of its p50); writes benchmarks/results/cpu_serving_*.json.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "src"))

from opfuse.bench.machine import describe  # noqa: E402
from opfuse.bench.serving import bench_serving, serving_table  # noqa: E402
from opfuse.models import load  # noqa: E402
from opfuse.report.text import wide_console  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lo", type=int, default=8)
    ap.add_argument("--hi", type=int, default=384)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--against", default="eager,opfuse,ort,openvino")
    ap.add_argument("--buckets", action="store_true", help="opfuse: a plan per token bucket where measured faster")
    ns = ap.parse_args()
    loaded = load(ns.model, batch=ns.batch, seq=128, attn=ns.attn)
    result = bench_serving(loaded.model, n=ns.requests, batch=ns.batch, lo=ns.lo, hi=ns.hi, threads=ns.threads,
                           against=tuple(ns.against.split(",")), buckets=ns.buckets or None)
    result["config"].update(model=ns.model, attn=ns.attn, machine=describe())
    console = wide_console()
    console.print(serving_table(result))
    if "opfuse" in result:
        console.print(f"opfuse: {result['opfuse']['plans']} plan(s), re-plans {result['opfuse']['replans']}")
        for row in result["opfuse"]["buckets"]:
            console.print(f"  tokens {row['tokens']}: decided at {row['decided_at']}, fused {row['fused']}, "
                          f"GEMMs {row['gemm']}")
    tag = "_buckets" if ns.buckets else ""
    out = Path(__file__).parent / "results" / f"cpu_serving_{ns.model}_b{ns.batch}_n{ns.requests}_t{ns.threads}{tag}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
