"""Median timing. ``interleaved`` runs every candidate once per round, round after round,
so slow drifts of a shared machine (other jobs, frequency) hit all of them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_s(fn: Callable[[], object], repeat: int = 20, warmup: int = 2) -> float:
    """Median wall time (s) of ``fn()`` over ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], object]], repeat: int = 20, warmup: int = 2,
                budget_s: float | None = None, before: Callable[[], object] | dict | None = None) -> dict[str, dict]:
    """Time every ``fns[name]()`` ``repeat`` times in rounds (one call each per round).

    Returns ``{name: {"median_s", "min_s", "iqr_s", "n"}}``. ``budget_s`` stops early (after
    at least 3 rounds) when the rounds so far took longer than that. ``before`` (untimed)
    runs before every timed call (e.g. :func:`evict_caches`); a dict gives each name its own.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    for i in range(repeat):
        for name, fn in fns.items():
            hook = before.get(name) if isinstance(before, dict) else before
            if hook is not None:
                hook()
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
        if budget_s is not None and i >= 2 and time.perf_counter() - start > budget_s:
            break
    out = {}
    for name, xs in samples.items():
        q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
        out[name] = {"median_s": statistics.median(xs), "min_s": min(xs), "iqr_s": q[2] - q[0], "n": len(xs)}
    return out


#: Bytes :func:`evict_caches` streams: more than the last-level caches of this project's
#: machines (48 MiB L3 on the 2-vCPU Xeon, 32 MiB per CCD on the EPYCs).
EVICT_BYTES = 96 << 20
_SCRATCH: list = []


def evict_caches() -> None:
    """Read :data:`EVICT_BYTES` of a scratch buffer, so what a timed call reads next comes
    from memory, as a weight does in a model's forward (each weight is read once per step;
    a decode step streams ~160 MB of them). The buffer is made once per process."""
    import torch
    if not _SCRATCH:
        _SCRATCH.append(torch.ones(EVICT_BYTES // 4))
    _SCRATCH[0].sum()
