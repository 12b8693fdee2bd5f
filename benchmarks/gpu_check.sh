#!/usr/bin/env bash
# One prepared GPU check for opfuse's Triton kernels (written for an H200: torch 2.11,
# triton 3.6, no package registry, repo copied WITHOUT .venv). Runs with the machine's
# system python and PYTHONPATH=src; finishes in under 8 minutes (hard stop at 470 s):
#   1. correctness of every kernel on real shapes vs float64 oracles and torch eager
#   2. copy bandwidth, per-kernel GB/s (memory-bound) / TFLOP/s (GEMM epilogues, attention)
#      vs torch eager
#   3. end-to-end latency of a BERT-base-like and a Llama-like block (eager vs fused ops,
#      vs opfuse.optimize; HF transformers parts are skipped with a message if missing)
# Usage: bash benchmarks/gpu_check.sh [--dry-run] [--quick] [--sections ...] [--out DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="src${PYTHONPATH:+:${PYTHONPATH}}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
LIMIT="${GPU_CHECK_LIMIT_S:-470}"
if command -v timeout >/dev/null 2>&1; then
  exec timeout --signal=INT --kill-after=10 "${LIMIT}" "${PY}" benchmarks/gpu_check.py --budget "$((LIMIT - 20))" "$@"
else
  exec "${PY}" benchmarks/gpu_check.py --budget "$((LIMIT - 20))" "$@"
fi
