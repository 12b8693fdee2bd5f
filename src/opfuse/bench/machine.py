"""What machine a result was measured on: CPU model (``/proc/cpuinfo``), cores, torch
threads, library versions and the load average (read at start and at end of a run)."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

LIBRARIES = ("torch", "numpy", "numba", "transformers", "onnxruntime", "onnx", "onnxscript", "opfuse")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_flags(wanted=("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")) -> list[str]:
    """The vector-ISA flags of ``/proc/cpuinfo`` that matter for the kernels."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def describe() -> dict:
    """Machine description for a result file (call again at the end for ``loadavg_end``)."""
    import torch
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "cpu": cpu_model(),
        "isa": isa_flags(),
        "machine": platform.machine(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "torch_threads": torch.get_num_threads(),
        "versions": versions(),
        "loadavg_start": load_average(),
        "note": ("shared machine: figures are medians of interleaved runs; compare ratios measured "
                 "in the same process, not absolute times across runs"),
    }
