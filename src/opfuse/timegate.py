"""Fusion decided by time: after the ρ ≥ θ gate, a selected CPU region is fused only when
its fused replacement, run on the region's recorded inputs, is measured faster than its
unfused ops (the seed's traffic criterion first, then the clock).

::

    select (ρ ≥ θ, roofline, overlaps) ── fused candidates
        └─ time each: fused module vs unfused module, interleaved, on the recorded inputs
           (verify.fused_region_module / unfused_region_module), each with the GEMM
           backends the plan's GEMM pass gives it (opfuse.gemm, the plan's mode), cached per
           CPU model, thread count, GEMM mode, pattern, variant and input signature in
           OPFUSE_CACHE_DIR — unless the timing was a close call (within CACHE_CLEAR) or taken
           while the machine was busy (cost.device.TimingWindow): those are measured again
        └─ fused not MARGIN (3%) faster than unfused: rejected ("decided by time"), the others re-selected (a region
           it overlapped may now fuse), until no chosen region is slower

Measured, not predicted: the blocked ``ffn`` kernel ran 0.51–0.63x of eager on these
machines while the byte-based cost model preferred it. ``decide="rho"`` (or
``OPFUSE_DECIDE=rho``) keeps the traffic decision alone — deterministic, for golden plans.
Only CPU regions are timed (a GPU region would need synchronised timing on the device).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from .cost.device import TimingWindow, cpu_model, load_cache, save_cache
from .cost.select import select
from .graph.meta import input_signature

CACHE = "region_times.json"
MODES = ("time", "rho")
#: Rounds per region: interleaved fused / unfused calls after one warm-up, minimum taken.
ROUNDS = 5
#: A region fuses only when measured at least this fraction faster than its unfused ops: a
#: tie within the timing noise is no gain (measured on a decode step of Llama: add+RMSNorm
#: on one row timed 54.4 vs 54.7 µs and was taken, while the step ran slower).
MARGIN = 0.03
#: A timing is cached only when fused and unfused differ by at least this fraction: a
#: close call (within the noise of five rounds on a shared machine) is measured again.
CACHE_CLEAR = 0.06


def check_mode(mode: str | None) -> str:
    """The decision mode: ``mode``, else ``OPFUSE_DECIDE``, else ``"time"``.

    Raises:
        ValueError: an unknown mode.
    """
    mode = mode or os.environ.get("OPFUSE_DECIDE") or "time"
    if mode not in MODES:
        raise ValueError(f"opfuse: decide must be one of {MODES}, got {mode!r}")
    return mode


def _with_gemm_backends(module: torch.fx.GraphModule, feeds: list, gemm: str | None) -> None:
    """Give ``module``'s GEMMs the backends the plan's GEMM pass would give them
    (:func:`opfuse.gemm.apply_gemm_choices` in mode ``gemm``, None: the pass's default; its
    choices are cached per shape, so the pass reuses them): every node's value recorded
    first (the pass reads the row counts from ``meta["val"]``)."""
    from .gemm import _mode, apply_gemm_choices, sites
    table = sites()
    if (gemm or _mode()) == "aten" or not any(n.op == "call_function" and n.target in table
                                              for n in module.graph.nodes):
        return

    class _Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["val"] = out
            return out
    _Record(module).run(*feeds)
    apply_gemm_choices(module, gemm)


def measure_region(cand, env: dict, gemm: str | None = None) -> tuple[float, float]:
    """(fused s, unfused s): minimum of :data:`ROUNDS` interleaved runs of ``cand``'s fused
    replacement and of its original nodes on the recorded input values, each with the GEMM
    backends the plan's GEMM pass gives it in mode ``gemm`` (:mod:`opfuse.gemm`). Timed
    with eager's GEMMs on both sides, Llama's SwiGLU at 4×128 rows was fused with its GEMM
    on MKL (18 ms a call under ``gemm="lean"``), while the plan then ran the unfused
    projections on oneDNN at twice the speed (Zen 5). The fused time is ``inf`` when its
    kernel raises; an unfused side the GEMM pass cannot rewrite is timed as it is."""
    from .bench.timing import interleaved
    from .verify import fused_region_module, unfused_region_module
    fused, fused_feeds = fused_region_module(cand.match, env, fold=True)  # weights folded, as in the plan
    unfused, unfused_feeds = unfused_region_module(cand.match, env, fold=True)
    with torch.no_grad():
        try:
            _with_gemm_backends(fused, fused_feeds, gemm)
            fused(*fused_feeds)
        except Exception:  # noqa: BLE001  a kernel that raises is never faster
            return math.inf, 0.0
        try:
            _with_gemm_backends(unfused, unfused_feeds, gemm)
        except Exception:  # noqa: BLE001  timed with the GEMMs it has (the pass is an optimisation)
            unfused, unfused_feeds = unfused_region_module(cand.match, env)
        times = interleaved({"fused": lambda: fused(*fused_feeds), "unfused": lambda: unfused(*unfused_feeds)},
                            repeat=ROUNDS, warmup=1)
    return times["fused"]["min_s"], times["unfused"]["min_s"]


@functools.cache
def kernels_version() -> str:
    """Hash of the kernel sources (opfuse/kernels/**/*.py): a cached timing is only reused
    by the kernels that were timed (a faster launcher must be re-measured, not judged by
    the old one's time)."""
    root = Path(__file__).parent / "kernels"
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def _key(cand, env: dict, gemm: str | None = None) -> str:
    from .gemm import _mode
    m = cand.match
    feeds = [env[n] if isinstance(n, torch.fx.Node) else n for n in m.inputs.values()]
    return (f"v6 | {kernels_version()} | {cpu_model()} | threads={torch.get_num_threads()} | gemm={gemm or _mode()} | "
            f"{m.pattern.name}/{m.pattern.variant} | {input_signature(tuple(feeds), {})!r}")


def decide_by_time(cands: list, env: dict, theta: float, timer: Callable | None = None,
                   gemm: str | None = None) -> int:
    """Pipeline pass: time every ``fused`` CPU candidate (``timer(cand, env)`` ->
    (fused s, unfused s), default :func:`measure_region` with the plan's GEMM mode ``gemm``,
    cached), reject the slower ones and re-select the rest; returns how many were rejected
    by time. Each timed candidate gets ``extra["measured"] = {"fused_s", "unfused_s"}`` and
    its reason says so."""
    measured = timer is None
    timer = (lambda c, e: measure_region(c, e, gemm)) if measured else timer
    cache = load_cache(CACHE) if measured else {}
    size = len(cache)
    rejected = 0
    for _ in range(8):  # each round can only reject; the re-selection settles in a few
        slower = []
        for c in cands:
            if c.decision != "fused" or "measured" in c.extra or not _on_cpu(c, env):
                continue
            key = _key(c, env, gemm)
            if key in cache:
                tf, tu = cache[key]
            else:
                with TimingWindow() as window:
                    tf, tu = timer(c, env)
                noisy = window.busy()
                if measured and math.isfinite(tf) and noisy is None and abs(tf / tu - 1) >= CACHE_CLEAR:
                    cache[key] = [tf, tu]  # a close call is measured again by the next optimize, not frozen
                elif noisy is not None:
                    c.extra["busy"] = noisy
            c.extra["measured"] = {"fused_s": tf, "unfused_s": tu}
            if tf >= tu * (1.0 - MARGIN):
                slower.append(c)
        if not slower:
            break
        rejected += len(slower)
        for c in slower:
            tf, tu = c.extra["measured"]["fused_s"], c.extra["measured"]["unfused_s"]
            c.legal, c.decision = False, "rejected"
            c.reason = (f"decided by time: fused {tf * 1e6:.1f} µs vs unfused {tu * 1e6:.1f} µs measured on the "
                        f"example inputs, not {MARGIN:.0%} faster, although the traffic gate passed it ({c.reason})")
        for c in cands:
            if c.legal and c.decision == "fused":
                c.decision = "rejected"  # re-selected below, with the slower regions out of the way
        select(cands, theta)
    for c in cands:
        if c.decision == "fused" and "measured" in c.extra:
            tf, tu = c.extra["measured"]["fused_s"], c.extra["measured"]["unfused_s"]
            c.reason += f"; measured fused {tf * 1e6:.1f} µs < unfused {tu * 1e6:.1f} µs"
        if c.extra.get("busy"):
            c.reason += f" (timed while the machine was busy: {c.extra['busy']}; not cached)"
    if measured and len(cache) != size:
        save_cache(CACHE, cache)
    return rejected


def _on_cpu(cand, env: dict) -> bool:
    values = [env.get(n) for n in cand.match.inputs.values() if isinstance(n, torch.fx.Node)]
    return all(v.device.type == "cpu" for v in values if isinstance(v, torch.Tensor))
