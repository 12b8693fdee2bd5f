"""Token generation benchmark (issue #13): prefill and decode tokens/s of HF eager, HF
StaticCache + torch.compile and opfuse (``fused.generate``), ONNX Runtime / OpenVINO as
failed peers with the reason, beside the weight-bandwidth floor; one JSON + CSV per model,
batch and thread count under benchmarks/results/ (machine description included).

    python benchmarks/bench_generate.py                      # llama, gpt2, qwen2; batch 1 and 4; 1 thread
    python benchmarks/bench_generate.py --models llama --batches 1 --threads 1 2 --no-compile
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from opfuse.bench.generate import GENERATE_MODELS, bench_generate, csv_rows, generate_table
from opfuse.bench.results import write_csv, write_json

OUT = Path(__file__).parent / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(GENERATE_MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--threads", nargs="+", type=int, default=[1])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip HF StaticCache + torch.compile (cold ~1 min)")
    ap.add_argument("--bf16", action="store_true", help="also opfuse with precision='bf16' (peer opfuse-bf16)")
    ap.add_argument("--lean", action="store_true", help="also opfuse with gemm='aten': no weight copies (peer opfuse-aten)")
    ap.add_argument("--nocopy", action="store_true",
                    help="also opfuse with gemm='lean': backends measured among those without weight copies (opfuse-lean)")
    ap.add_argument("--breakdown", action="store_true", help="time per decode step by category (profiler)")
    ns = ap.parse_args()
    console = Console()
    against = ("ort", "openvino") if ns.no_compile else ("static-compile", "ort", "openvino")
    against += ("opfuse-bf16",) if ns.bf16 else ()
    against += ("opfuse-aten",) if ns.lean else ()
    against += ("opfuse-lean",) if ns.nocopy else ()
    for threads in ns.threads:
        for name in ns.models:
            for batch in ns.batches:
                with console.status(f"{name} batch {batch}, {threads} thread(s)") as status:
                    result = bench_generate(name, batch=batch, prompt=ns.prompt, new=ns.new, threads=threads,
                                            against=against, repeat=ns.repeat, log=status.update,
                                            with_breakdown=ns.breakdown)
                console.print(generate_table(result))
                if result["breakdown"]:
                    from opfuse.bench.breakdown import breakdown_table
                    console.print(breakdown_table(result["breakdown"], per="decode step"))
                path = OUT / f"cpu_generate_{name}_b{batch}_p{ns.prompt}_n{ns.new}_t{threads}.json"
                write_json(result, path)
                write_csv(csv_rows(result),
                          str(path).removesuffix(".json") + ".csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
