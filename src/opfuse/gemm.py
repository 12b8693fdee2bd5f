"""GEMM backend choice per shape: measured once at optimize time, cached, applied to the graph.

After fusion, 72–91% of a Transformer's CPU time is GEMMs, and the same BLAS call runs at
different speeds depending on the weight's layout and on the library. Measured on this
project's 2-core AMD EPYC machines (float32, one thread, GFLOP/s, median):

    M×K×N            F.linear (eager)   Wᵀ contiguous   oneDNN linear
    128×768×2304          25–26             29–31            32
    128×768×3072          26–28             28–31            32
    128×3072×768          29–30             30–32            31
    1024×384×1536         33                33               32

so no single choice wins everywhere. Each backend is a row of :data:`BACKENDS`:

* ``aten``  — what eager runs: ``F.linear`` → ``addmm(b, x, W.t())`` (weight read as a
  transposed view). The baseline; the graph is left as it is.
* ``wt``    — the weight pre-transposed once into a contiguous ``Wᵀ [K, N]`` buffer (a
  folded constant of the plan) and passed on as the view ``Wᵀ.t()``: same values, same
  ``[N, K]`` shape, so ``aten.linear`` and opfuse's GEMM kernels (which call ``weight.t()``)
  hand BLAS a non-transposed operand. Costs K·N·4 extra bytes per weight.
* ``onednn`` — ``torch.ops.mkldnn._linear_pointwise`` (oneDNN's inner-product primitive,
  the kernel inductor's CPU ``freezing`` path uses); only for plain ``aten.linear`` nodes.

:func:`choose` times every available backend on the real (M, K, N) with random data,
interleaved round-robin (the machines are shared and noisy), takes medians and keeps
``aten`` unless another backend is at least :data:`MARGIN` faster. Results are cached per
CPU model, torch version, thread count, shape and dtype in ``OPFUSE_CACHE_DIR``/gemm_cpu.json.
:func:`apply_gemm_choices` is the pipeline pass; the report lists every choice with its
times (``FusionReport.gemm``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from operator import attrgetter

import torch
from torch import fx

from .cost.device import cache_dir
from .rewrite import drop_unused_parameters

aten = torch.ops.aten
MARGIN = 0.03           # a backend replaces aten only when ≥ 3% faster (median vs median)
ROUNDS = 9              # interleaved timing rounds per shape (after 2 warm-up rounds)


@dataclass(frozen=True)
class GemmBackend:
    """One way to run ``y[M,N] = x[M,K] @ W[N,K]ᵀ (+ b)``."""

    name: str
    available: Callable[[], bool]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (x, W, b) -> y
    prepare: Callable[[torch.Tensor], torch.Tensor]  # W [N,K] -> weight operand the run takes
    linear_only: bool = False  # usable only where the graph calls aten.linear (not inside a fused kernel)


def _linear(x, w, b):
    return torch.nn.functional.linear(x, w, b)


def _onednn(x, w, b):
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _transposed(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()  # [N, K] view of a contiguous [K, N] buffer


BACKENDS = [
    GemmBackend("aten", lambda: True, _linear, lambda w: w),
    GemmBackend("wt", lambda: True, _linear, _transposed),
    GemmBackend("onednn", lambda: torch.backends.mkldnn.is_available(), _onednn, lambda w: w, linear_only=True),
]


@dataclass(frozen=True)
class GemmChoice:
    """The backend chosen for one GEMM node. Times in seconds (median of the measurement)."""

    node: str
    op: str
    m: int
    k: int
    n: int
    backend: str
    times_s: dict
    reason: str
    extra_bytes: int = 0  # weight copies this choice keeps (bytes)


# opfuse ops with a GEMM inside: op -> (x arg index, weight arg index, bias arg index or None)
def _gemm_args() -> dict:
    ops = torch.ops.opfuse
    table = {aten.linear.default: (0, 1, 2)}
    for name, spec in {"linear_bias_gelu": (0, 1, 2), "linear_residual": (0, 1, 2), "swiglu": (0, 1, None),
                       "linear_add_layernorm": (0, 1, 2), "linear_add_layernorm_sum": (0, 1, 2)}.items():
        if hasattr(ops, name):
            table[getattr(ops, name).default] = spec
    return table


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return "cpu"


def _cache_path():
    return cache_dir() / "gemm_cpu.json"


def _load_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(table: dict) -> None:
    try:
        path = _cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True))
    except OSError:
        pass


def measure(m: int, k: int, n: int, bias: bool, backends: list[GemmBackend],
            dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Median seconds of ``y = x @ Wᵀ (+ b)`` for each backend on random [M,K]·[N,K]ᵀ data,
    timed round-robin (``ROUNDS`` rounds after two warm-up rounds)."""
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    prepared = {be.name: be.prepare(w) for be in backends}
    samples: dict[str, list[float]] = {be.name: [] for be in backends}
    with torch.no_grad():
        for r in range(ROUNDS + 2):
            for be in backends:
                t = time.perf_counter()
                be.run(x, prepared[be.name], b)
                dt = time.perf_counter() - t
                if r >= 2:
                    samples[be.name].append(dt)
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def choose(m: int, k: int, n: int, bias: bool, linear_only_allowed: bool,
           dtype: torch.dtype = torch.float32, cache: dict | None = None) -> tuple[str, dict, str]:
    """(backend name, median times, reason) for one GEMM shape; measured once, then cached."""
    backends = [be for be in BACKENDS if be.available() and (linear_only_allowed or not be.linear_only)]
    key = (f"{_cpu_model()} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
           f"{m}x{k}x{n} | bias {int(bias)} | {str(dtype).replace('torch.', '')} | "
           + ",".join(be.name for be in backends))
    table = _load_cache() if cache is None else cache
    times = table.get(key)
    if times is None:
        times = measure(m, k, n, bias, backends, dtype)
        table[key] = times
        if cache is None:
            _save_cache(table)
    base = times["aten"]
    best = min(times, key=times.__getitem__)
    if best != "aten" and times[best] <= base * (1 - MARGIN):
        return best, times, f"{best} {base / times[best]:.2f}x faster than aten (median of {ROUNDS})"
    return "aten", times, (f"aten kept: best alternative {best} within {MARGIN:.0%}" if best != "aten"
                           else "aten fastest")


def _mode() -> str:
    return os.environ.get("OPFUSE_GEMM", "auto")


def apply_gemm_choices(gm: fx.GraphModule, mode: str | None = None) -> list[GemmChoice]:
    """Pipeline pass: for every float32 CPU GEMM whose weight is a parameter (``aten.linear``
    and opfuse ops with a GEMM inside), choose a backend (:func:`choose`) and rewrite:
    ``wt`` folds a pre-transposed copy of the weight into the plan, ``onednn`` replaces the
    ``aten.linear`` node by ``mkldnn._linear_pointwise``.

    ``mode`` (default ``OPFUSE_GEMM`` or ``"auto"``): ``"auto"`` measures; ``"aten"`` keeps
    eager's GEMMs; a backend name forces it where usable. Returns the choices (for the report).
    """
    mode = mode or _mode()
    if mode not in ("auto", *(be.name for be in BACKENDS)):
        raise ValueError(f"opfuse: unknown GEMM mode {mode!r}; expected auto, "
                         + ", ".join(be.name for be in BACKENDS))
    if mode == "aten":
        return []
    table = _gemm_args()
    cache = _load_cache()
    size_before = len(cache)
    choices: list[GemmChoice] = []
    transposed: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        spec = table.get(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        xi, wi, bi = spec
        x, w = node.args[xi], node.args[wi]
        b = node.args[bi] if bi is not None and len(node.args) > bi else None
        xv = getattr(x, "meta", {}).get("val")
        wv = w.meta.get("val") if isinstance(w, fx.Node) else None
        if wv is None and isinstance(w, fx.Node) and w.op == "get_attr":
            wv = attrgetter(w.target)(gm)  # a folded constant (concatenated QKV weight)
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and isinstance(xv, torch.Tensor)
                and isinstance(wv, torch.Tensor) and wv.dim() == 2 and wv.dtype == torch.float32
                and xv.dtype == torch.float32 and xv.device.type == "cpu" and wv.is_contiguous()):
            continue
        n, k = wv.shape
        m = prod(xv.shape[:-1])
        if m == 0:
            continue
        is_linear = node.target is aten.linear.default
        has_bias = isinstance(b, fx.Node)
        if mode == "auto":
            name, times, reason = choose(m, k, n, has_bias, is_linear, cache=cache)
        else:
            usable = next(be for be in BACKENDS if be.name == mode)
            if usable.linear_only and not is_linear or not usable.available():
                continue
            name, times, reason = mode, {}, f"forced by OPFUSE_GEMM={mode}"
        extra = 0
        if name == "wt":
            view = transposed.get(w.target)
            if view is None:
                weight = attrgetter(w.target)(gm)
                buf = f"opfuse_folded_wt_{w.target.replace('.', '_')}"
                gm.register_buffer(buf, weight.detach().t().contiguous())
                with gm.graph.inserting_before(node):
                    attr = gm.graph.get_attr(buf)
                    view = gm.graph.call_function(aten.t.default, (attr,))
                attr.meta["val"] = wv.t().contiguous()
                view.meta["val"] = attr.meta["val"].t()
                transposed[w.target] = view
                extra = wv.numel() * wv.element_size()
            node.replace_input_with(w, view)
        elif name == "onednn":
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(torch.ops.mkldnn._linear_pointwise.default,
                                             (x, w, b if has_bias else None, "none", [], ""))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
        choices.append(GemmChoice(node.name, str(node.target).replace("aten.", "").replace("opfuse.", ""),
                                  m, k, n, name, {kk: round(v, 9) for kk, v in times.items()}, reason, extra))
    if len(cache) != size_before:
        _save_cache(cache)
    if choices:
        drop_unused_parameters(gm)  # weights now read only through their transposed copy
        gm.graph.lint()
        gm.recompile()
    return choices
