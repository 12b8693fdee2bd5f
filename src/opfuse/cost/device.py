"""Device profiles for the roofline: bandwidth (bytes/s), peak FLOP/s, cache size
(bytes) and kernel-launch overhead (s).

``profile_for("cpu")`` is :func:`measured_cpu_profile` (copy bandwidth, in-cache
bandwidth, GEMM FLOP/s measured once per CPU model and thread count, ~1 s, cached under
``OPFUSE_CACHE_DIR``) unless ``OPFUSE_MEASURE_DEVICE=0`` asks for the static profile below
(deterministic: the test tier's default).

CPU figures: cache sizes from ``/sys/devices/system/cpu``; bandwidth and peak are
conservative defaults for one AVX2 core (2 FMA × 8 fp32 lanes × 2 × ~3 GHz ≈ 96 GFLOP/s;
~20 GB/s streaming per core). GPU data-sheet figures: NVIDIA H200 (4.8 TB/s HBM3e,
989 TFLOP/s dense bf16), H100 SXM (3.35 TB/s, 989 TFLOP/s), A100 SXM 80GB (2.0 TB/s,
312 TFLOP/s).
"""

from __future__ import annotations

import os
import time
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
    cache_bandwidth: float = 0.0  # bytes / s for cache-resident data; 0: not modelled (all at `bandwidth`)

    def time(self, flops: int, nbytes: int, kernels: int = 1, cached_bytes: int = 0) -> float:
        """Roofline time (s): max(FLOPs / peak, bytes / bandwidth) + launches × overhead;
        ``cached_bytes`` of ``nbytes`` (intermediates that fit in cache) move at
        ``cache_bandwidth`` when the profile has one."""
        cached = min(cached_bytes, nbytes) if self.cache_bandwidth > 0 else 0
        memory = (nbytes - cached) / self.bandwidth + (cached / self.cache_bandwidth if cached else 0.0)
        return max(flops / self.peak_flops, memory) + kernels * self.launch_overhead


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


def _measure_cpu(seconds: float = 1.0) -> dict:
    """Microbenchmark with the current torch threads (~1 s): main-memory copy bandwidth
    (64 MiB ``copy_``, bytes read + written), in-cache copy bandwidth (a quarter of L2) and
    float32 GEMM FLOP/s (1024³ ``mm`` with a preallocated output). Best of a few runs."""
    import torch

    from opfuse.bench.timing import interleaved

    def best(fn, n: int) -> float:
        return interleaved({"fn": fn}, repeat=n, warmup=1)["fn"]["min_s"]

    big = torch.ones(16 * 1024 * 1024)                  # 64 MiB: far out of cache
    big_out = torch.empty_like(big)
    bandwidth = 2 * big.nbytes / best(lambda: big_out.copy_(big), 5)
    l2 = _cpu_cache_bytes()
    small = torch.ones(max(1024, l2 // 4 // 4))        # a quarter of L2 (in + out = half)
    small_out = torch.empty_like(small)
    reps = max(1, int(64 * 1024 * 1024 // small.nbytes))
    def many():
        for _ in range(reps):
            small_out.copy_(small)
    cache_bw = 2 * small.nbytes * reps / best(many, 3)
    n = 1024
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    flops = 2 * n ** 3 / best(lambda: torch.mm(a, b, out=c), 3)
    return {"bandwidth": bandwidth, "cache_bandwidth": cache_bw, "peak_flops": flops, "cache_bytes": l2,
            "threads": torch.get_num_threads()}


def cache_dir() -> Path:
    """``OPFUSE_CACHE_DIR`` (default ``~/.cache/opfuse``)."""
    return Path(os.environ.get("OPFUSE_CACHE_DIR") or Path.home() / ".cache" / "opfuse")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("cpu" where it cannot be read): part of
    every measurement cache key."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "cpu"


def busy() -> str | None:
    """Why timings taken now must not be cached (None when the machine is quiet): the
    1-minute load average above the CPUs this process may use means other work shares the
    cores, and a region timed then can run 100x slower than alone (measured: a MiniLM
    attention region at 47.8 ms unfused vs ~0.1 ms quiet, while a CI run shared the 2 CPUs).
    Such timings still decide this optimize — they are the best evidence it has — but are
    not stored for later ones."""
    try:
        load, cpus = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return None
    return f"load average {load:.1f} on {cpus} CPUs" if load > cpus else None


#: A timing window in which this process got less than this share of a CPU (its CPU time
#: over the wall time) ran beside other work or under hypervisor steal: not cached.
ON_CPU_MIN = 0.9


class TimingWindow:
    """``with TimingWindow() as w: <timed calls>``; then ``w.busy()`` says why the timings
    taken inside must not be cached (None when they may): :func:`busy` (the load average),
    or this process ran less than :data:`ON_CPU_MIN` of the window on a CPU
    (``time.process_time`` over ``time.perf_counter``), i.e. it waited for a core. The load
    average alone missed that here: region timings taken beside a test run (1-minute load
    below the CPU count) were cached with an add+LayerNorm 33% slower fused than unfused and
    a qkv merge rejected, and every later BERT plan on the machine left them unfused."""

    def __enter__(self) -> TimingWindow:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        self.share = 1.0
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._wall
        self.share = (time.process_time() - self._cpu) / wall if wall > 0 else 1.0

    def busy(self) -> str | None:
        if self.share < ON_CPU_MIN:
            return f"this process ran {self.share:.0%} of the timing window on a CPU (it waited for a core)"
        return busy()


def load_cache(name: str) -> dict:
    """The JSON table ``cache_dir()/name`` ({} when missing or unreadable)."""
    import json
    try:
        return json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}


def save_cache(name: str, table: dict) -> None:
    """Write ``table`` to ``cache_dir()/name``; a read-only cache directory is not an error."""
    import json
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True))
    except OSError:
        pass


def measured_cpu_profile(refresh: bool = False) -> DeviceProfile:
    """CPU profile measured by :func:`_measure_cpu` on first use and cached on disk under
    :func:`cache_dir` (one entry per CPU model and torch thread count)."""
    import torch
    key = f"{cpu_model()} | threads={torch.get_num_threads()}"
    table = load_cache("device_cpu.json")
    m = None if refresh else table.get(key)
    if m is None:
        m = _measure_cpu()
        table[key] = m
        save_cache("device_cpu.json", table)
    return DeviceProfile("cpu (measured)", bandwidth=m["bandwidth"], peak_flops=m["peak_flops"],
                         cache_bytes=int(m["cache_bytes"]), launch_overhead=5e-6,
                         cache_bandwidth=m["cache_bandwidth"])


KNOWN_GPUS = {
    "h200": DeviceProfile("NVIDIA H200", 4.8e12, 989e12, 228 * 1024, 4e-6),
    "h100": DeviceProfile("NVIDIA H100", 3.35e12, 989e12, 228 * 1024, 4e-6),
    "a100": DeviceProfile("NVIDIA A100", 2.0e12, 312e12, 164 * 1024, 5e-6),
}


def profile_for(device) -> DeviceProfile:
    """Profile for a ``torch.device`` (or its type string); unknown GPUs get the H100 figures."""
    kind = getattr(device, "type", str(device or "cpu"))
    if kind == "cpu":  # measured (cached) unless OPFUSE_MEASURE_DEVICE=0 asks for the static one
        return cpu_profile() if os.environ.get("OPFUSE_MEASURE_DEVICE") == "0" else measured_cpu_profile()
    try:
        import torch
        name = torch.cuda.get_device_name(device).lower()
    except Exception:  # no CUDA runtime
        name = ""
    return next((p for key, p in KNOWN_GPUS.items() if key in name), KNOWN_GPUS["h100"])
