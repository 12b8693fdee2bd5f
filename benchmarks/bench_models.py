"""Whole models: opfuse vs eager, torch.compile (inductor), ONNX Runtime and OpenVINO (a
thin wrapper of ``opfuse bench``), one JSON + CSV per model under benchmarks/results/.

    .venv/bin/python benchmarks/bench_models.py [MODEL ...] [--threads 1] [--amdahl] [--breakdown]

Default: minilm 8x128 (eager attention) and bert-base 1x128 (sdpa), against
eager,opfuse-aten,inductor,ort,openvino (opfuse-aten: opfuse with eager's GEMMs, the
fusions' share alone; ort brings ort-opt, openvino brings openvino-default). Every row is
also printed against the GEMM floor. ``--all`` adds bert-base 1x512 (eager attention),
gpt2 1x256 and llama 1x256.
"""

from __future__ import annotations

import argparse
import sys

from opfuse.cli import main as opfuse_main

# (model, batch, seq, attn)
DEFAULT_RUNS = [("minilm", 8, 128, "eager"), ("bert-base", 1, 128, "sdpa")]
ALL_RUNS = DEFAULT_RUNS + [("bert-base", 1, 512, "eager"), ("gpt2", 1, 256, "sdpa"), ("llama", 1, 256, "sdpa")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="minilm, bert-base, gpt2, llama (default: minilm bert-base)")
    ap.add_argument("--all", action="store_true", help="also bert-base 1x512 eager, gpt2 1x256, llama 1x256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--against", default="eager,opfuse-aten,inductor,ort,openvino")
    ap.add_argument("--amdahl", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="eager's and opfuse's time by category (profiler)")
    ap.add_argument("--repeat", type=int, default=20)
    ns = ap.parse_args()
    runs = ALL_RUNS if ns.all else DEFAULT_RUNS
    if ns.models:
        runs = [r for r in ALL_RUNS if r[0] in ns.models] or [(m, None, None, None) for m in ns.models]
    rc = 0
    for model, batch, seq, attn in runs:
        argv = ["bench", model, "--against", ns.against, "--threads", str(ns.threads), "--repeat", str(ns.repeat)]
        if batch:
            argv += ["--batch", str(batch), "--seq", str(seq), "--attn", attn]
            argv += ["--json", f"benchmarks/results/cpu_{model}_{batch}x{seq}_{attn}_t{ns.threads}.json"]
        if ns.amdahl:
            argv.append("--amdahl")
        if ns.breakdown:
            argv.append("--breakdown")
        rc |= opfuse_main(argv)
    return rc


if __name__ == "__main__":
    sys.exit(main())
