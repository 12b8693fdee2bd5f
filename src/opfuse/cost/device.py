"""Device profiles for the roofline: bandwidth (bytes/s), peak FLOP/s, cache size
(bytes) and kernel-launch overhead (s).

CPU figures: cache sizes from ``/sys/devices/system/cpu``; bandwidth and peak are
conservative defaults for one AVX2 core (2 FMA × 8 fp32 lanes × 2 × ~3 GHz ≈ 96 GFLOP/s;
~20 GB/s streaming per core). GPU data-sheet figures: NVIDIA H200 (4.8 TB/s HBM3e,
989 TFLOP/s dense bf16), H100 SXM (3.35 TB/s, 989 TFLOP/s), A100 SXM 80GB (2.0 TB/s,
312 TFLOP/s).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline parameters of one device."""

    name: str
    bandwidth: float          # bytes / s, main memory
    peak_flops: float         # FLOP / s
    cache_bytes: int          # per-core (CPU L2) or per-SM-shared budget for resident intermediates
    launch_overhead: float    # seconds per kernel launch / op dispatch

    def time(self, flops: int, nbytes: int, kernels: int = 1) -> float:
        """Roofline time (s): max(FLOPs / peak, bytes / bandwidth) + launches × overhead."""
        return max(flops / self.peak_flops, nbytes / self.bandwidth) + kernels * self.launch_overhead


def _cpu_cache_bytes(level: int = 2, default: int = 512 * 1024) -> int:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in sorted(base.glob("index*")):
            if (idx / "level").read_text().strip() == str(level) and \
                    (idx / "type").read_text().strip() in ("Unified", "Data"):
                text = (idx / "size").read_text().strip().upper()
                mult = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
                return int(text.rstrip("KM")) * mult
    except OSError:
        pass
    return default


def cpu_profile() -> DeviceProfile:
    return DeviceProfile("cpu", bandwidth=20e9, peak_flops=96e9 * 1, cache_bytes=_cpu_cache_bytes(),
                         launch_overhead=5e-6)


KNOWN_GPUS = {
    "h200": DeviceProfile("NVIDIA H200", 4.8e12, 989e12, 228 * 1024, 4e-6),
    "h100": DeviceProfile("NVIDIA H100", 3.35e12, 989e12, 228 * 1024, 4e-6),
    "a100": DeviceProfile("NVIDIA A100", 2.0e12, 312e12, 164 * 1024, 5e-6),
}


def profile_for(device) -> DeviceProfile:
    """Profile for a ``torch.device`` (or its type string); unknown GPUs get the H100 figures."""
    kind = getattr(device, "type", str(device or "cpu"))
    if kind == "cpu":
        return cpu_profile()
    try:
        import torch
        name = torch.cuda.get_device_name(device).lower()
    except Exception:  # no CUDA runtime
        name = ""
    return next((p for key, p in KNOWN_GPUS.items() if key in name), KNOWN_GPUS["h100"])
