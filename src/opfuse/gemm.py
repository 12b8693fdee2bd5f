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
  the kernel inductor's CPU ``freezing`` path uses) on the weight as it is, with its GELU
  (erf) or residual-add post-op; replaces ``aten.linear``, ``linear_bias_gelu`` and
  ``linear_residual`` nodes.
* ``packed`` — the weight prepacked once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, a folded constant of the plan, K·N·4 extra
  bytes) for **every** site: ``aten.linear`` becomes ``_linear_pointwise`` on it, and the
  opfuse ops with a GEMM inside (linear_add_layernorm(_sum), linear_residual, bias_gelu
  in both GELU forms, swiglu, geglu) keep their own epilogue kernels and run their GEMM on
  oneDNN (:mod:`opfuse.kernels.cpu._gemm` dispatches on the weight's layout).
* ``blas`` — numpy's OpenBLAS on one thread (offered only while torch runs one thread:
  :mod:`opfuse.kernels.cpu._gemm` explains why) on a row-padded copy of Wᵀ
  (:func:`opfuse.kernels.cpu._gemm.blas_layout`, K·(N+16)·4 extra bytes, the layout that
  sends the fused ops' GEMMs to OpenBLAS); ``aten.linear`` becomes ``opfuse.linear_blas``.
  Measured on the Zen 2 machines (one thread, 12–48 weights cycled, caches cold, GFLOP/s):
  78–81 against oneDNN prepacked 68–71 and MKL 54–66 at 128×768×768 … 128×3072×768; on
  the weight as it is (no copy) OpenBLAS ran 74–79.
* ``gemv`` — at ≤ :data:`COLD_ROWS` rows, ``aten.linear`` becomes ``opfuse.linear_gemv``
  (:mod:`opfuse.kernels.cpu.linear_gemv`: one float32 dot product per row and output on the
  weight as it is, no copy); above that many rows it runs ATen's GEMM.

:func:`choose` times every available backend on the real (M, K, N) with random data,
interleaved round-robin (the machines are shared and noisy), takes medians and keeps
``aten`` unless another backend is at least :data:`MARGIN` faster. Results are cached per
CPU model, torch version, thread count, shape and dtype in ``OPFUSE_CACHE_DIR``/gemm_cpu.json.
:func:`apply_gemm_choices` is the pipeline pass; the report lists every choice with its
times (``FusionReport.gemm``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from operator import attrgetter

import torch
from torch import fx

from .cost.device import TimingWindow, cpu_model, load_cache, save_cache
from .graph.meta import concrete as as_int
from .graph.meta import decided_at
from .graph.state import foldable, note_derived
from .kernels.cpu._gemm import BLAS_PAD, blas_layout, blas_view, openblas
from .rewrite import drop_unused_parameters

aten = torch.ops.aten
MARGIN = 0.03           # a backend replaces aten only when ≥ 3% faster (median vs median)
SIZE_CAP = 0.10         # dynamic plans: a backend > 10% slower than aten at one of their sizes is out
ROUNDS = 7              # interleaved timing rounds per shape
WARMUP = 1              # untimed rounds first (oneDNN creates its primitive on the first call)
#: At most this many rows (M), a GEMM is a weight stream (≤ 2·M/4 FLOP per weight byte, under
#: these CPUs' balance of ~4–5 FLOP/B) whose weight comes from memory in a real forward: it is
#: timed with the caches evicted before each call (:func:`opfuse.bench.timing.evict_caches`).
#: Hot, a decode step's [1, 512] × [512, 1376] GEMV chose eager's layout; cold, the
#: pre-transposed weight is faster (measured here: 227 vs 275 µs, 160 MB of weights cycled).
COLD_ROWS = 8
CACHE = "gemm_cpu.json"  # measured medians, under OPFUSE_CACHE_DIR


def _onednn_linear(x, w, b, node_args):
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _onednn_bias_gelu(x, w, b, node_args):  # oneDNN GEMM with its eltwise GELU(erf) post-op
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [], "none")


def _onednn_residual(x, w, b, node_args):  # oneDNN GEMM with its binary-add post-op
    return torch.ops.mkldnn._linear_pointwise.binary(x, node_args[3], w, b, "add")


def _gemv(x, w, b, node_args):  # opfuse's weight-stream kernel (few rows; ATen's GEMM above)
    return torch.ops.opfuse.linear_gemv(x, w, b)


def _blas(x, w, b, node_args):  # numpy's OpenBLAS, one thread, on the row-padded Wᵀ
    return torch.ops.opfuse.linear_blas(x, w, b)


def _blas_available() -> bool:
    return torch.get_num_threads() == 1 and openblas() is not None


def _blas_usable(kind, args) -> bool:
    b = args[2] if len(args) > 2 else None
    return kind != "linear" or b is None or (isinstance(b, torch.Tensor) and b.dim() == 1)


def _gemv_usable(kind, args) -> bool:
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    return (kind == "linear" and isinstance(x, torch.Tensor) and as_int(prod(x.shape[:-1])) <= COLD_ROWS
            and (b is None or (isinstance(b, torch.Tensor) and b.dim() == 1)))


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """oneDNN's prepacked layout of a float32 [N, K] weight for GEMMs of about ``rows`` rows
    (an opaque ``torch._mkldnn`` tensor of shape [N, K]; any row count runs on it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), max(1, int(rows)))


@dataclass(frozen=True)
class Site:
    """An op with a GEMM inside: where its x / weight / bias arguments are, and how to run it
    (``run(x, w, b, node_args)``, the op itself on other operands) for timing."""

    kind: str
    x: int
    w: int
    b: int | None
    run: Callable


def _call(target):
    def run(x, w, b, args):
        args = list(args)
        args[0], args[1] = x, w
        if len(args) > 2 and (args[2] is None or isinstance(args[2], torch.Tensor)):
            args[2] = b
        return target(*args)
    return run


def sites() -> dict:
    """call target -> :class:`Site` for ``aten.linear`` and every registered opfuse op with a
    GEMM inside."""
    ops = torch.ops.opfuse
    table = {aten.linear.default: Site("linear", 0, 1, 2, _call(aten.linear.default))}
    for name, b in {"linear_bias_gelu": 2, "linear_residual": 2, "swiglu": None, "geglu": None,
                    "linear_add_layernorm": 2, "linear_add_layernorm_sum": 2}.items():
        if hasattr(ops, name):
            target = getattr(ops, name).default
            table[target] = Site(name, 0, 1, b, _call(target))
    return table


@dataclass(frozen=True)
class GemmBackend:
    """One way to run a GEMM site. ``transposed``: the weight operand is the [N, K] view of a
    contiguous [K, N] copy (folded once into the plan). ``replace``: site kind -> function
    ``(x, w, b, node_args) -> y`` that replaces the whole op (None: the op stays, only its
    weight operand changes); ``packed``: the weight operand is oneDNN's prepacked copy
    (:func:`pack`, folded once); ``every_site``: serves the sites without a ``replace`` entry
    too (their op runs on the new weight operand); ``usable(node_args)`` says whether it
    applies to this call."""

    name: str
    available: Callable[[], bool]
    transposed: bool = False
    replace: dict = field(default_factory=dict)
    usable: Callable = lambda kind, args: True
    packed: bool = False
    every_site: bool = False
    blas: bool = False  # every site reads the row-padded Wᵀ (blas_layout)

    def serves(self, kind: str) -> bool:
        return not self.replace or self.every_site or kind in self.replace

    @property
    def copies(self) -> bool:
        """Whether the plan keeps a copy of the weight (pre-transposed, prepacked or row-padded)."""
        return self.transposed or self.packed or self.blas

    def weight(self, w: torch.Tensor, rows: int) -> torch.Tensor:
        """The weight operand this backend gives its sites: ``w`` [N, K] itself or its copy
        in the backend's layout (for GEMMs of about ``rows`` rows)."""
        if self.transposed:
            return w.t().contiguous().t()
        if self.packed:
            return pack(w, rows)
        if self.blas:
            return blas_view(blas_layout(w), w.shape[0])
        return w


def _onednn_usable(kind, args) -> bool:
    b = args[2] if len(args) > 2 else None
    if isinstance(b, torch.Tensor) and b.dim() != 1:
        return False  # oneDNN's inner product takes a [N] bias only (a broadcast [1, N] fails)
    if kind == "linear_bias_gelu":
        return args[3] == "none"  # oneDNN's tanh GELU post-op measured slower than eager; erf only
    if kind == "linear_residual":  # the post-op's operand must be the output's exact shape
        x, w, res = args[0], args[1], args[3]
        return isinstance(res, torch.Tensor) and tuple(res.shape) == (*x.shape[:-1], w.shape[0])
    return True


def _packed_usable(kind, args) -> bool:
    b = args[2] if len(args) > 2 else None
    return kind != "linear" or not (isinstance(b, torch.Tensor) and b.dim() != 1)


BACKENDS = [
    GemmBackend("aten", lambda: True),
    GemmBackend("wt", lambda: True, transposed=True),
    GemmBackend("onednn", lambda: torch.backends.mkldnn.is_available(),
                replace={"linear": _onednn_linear, "linear_bias_gelu": _onednn_bias_gelu,
                         "linear_residual": _onednn_residual},
                usable=_onednn_usable),
    GemmBackend("packed", lambda: torch.backends.mkldnn.is_available(), packed=True, every_site=True,
                replace={"linear": _onednn_linear}, usable=_packed_usable),
    GemmBackend("blas", _blas_available, replace={"linear": _blas}, every_site=True, blas=True,
                usable=_blas_usable),
    GemmBackend("gemv", lambda: True, replace={"linear": _gemv}, usable=_gemv_usable),
]
_ONEDNN_OPS = {"linear": lambda: torch.ops.mkldnn._linear_pointwise.default,
               "linear_bias_gelu": lambda: torch.ops.mkldnn._linear_pointwise.default,
               "linear_residual": lambda: torch.ops.mkldnn._linear_pointwise.binary}


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
    pattern: str = ""     # the fused region's pattern when the GEMM is inside one


def _value(gm: fx.GraphModule, value, concrete: bool):
    """A node argument as a value: parameters as they are; run-time tensors as their recorded
    (fake) value, or with ``concrete`` as random data of that shape/dtype (for timing);
    literals unchanged. Raises ValueError when a run-time tensor has no recorded value."""
    if isinstance(value, fx.Node):
        if value.op == "get_attr":
            return attrgetter(value.target)(gm).detach()
        v = value.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"no recorded value for {value.name}")
        return torch.randn(tuple(map(as_int, v.shape)), dtype=v.dtype) if concrete else v
    if isinstance(value, (list, tuple)):
        return type(value)(_value(gm, v, concrete) for v in value)
    return value


def measure(site: Site, args: list, backends: list[GemmBackend]) -> dict[str, float]:
    """Median seconds of the site's op for each backend on ``args`` (concrete values), timed
    round-robin (:func:`opfuse.bench.timing.interleaved`, ``ROUNDS`` rounds) after one
    untimed call each (``WARMUP``: oneDNN creates its primitive on the first call); at ≤
    :data:`COLD_ROWS` rows each timed call meets a cold weight and a warm code path, as in a
    decode step: the caches evicted, then the same backend run once on a copy of the
    weight (evicting alone also evicted the code: Python-dispatched kernels measured 7–10x
    their warm time and lost where they won in the decode step). A
    backend that raises there, or whose result differs from aten's beyond float32 round-off
    (1e-4 relative), is not a candidate (time inf)."""
    from .bench.timing import evict_caches, interleaved
    x, w = args[site.x], args[site.w]
    b = args[site.b] if site.b is not None and len(args) > site.b else None
    rows = prod(x.shape[:-1])
    calls, warm = {}, {}
    for be in backends:
        run = be.replace.get(site.kind) or site.run
        weight = be.weight(w, rows)
        calls[be.name] = lambda run=run, weight=weight: run(x, weight, b, args)
        if rows <= COLD_ROWS:  # the same call on a copy of its weight: the code warm, this weight cold
            copy = be.weight(w.clone(), rows)
            warm[be.name] = lambda run=run, weight=copy: (evict_caches(), run(x, weight, b, args))
    cold = warm or None
    results, failed = {}, set()
    with torch.no_grad():
        for name, call in calls.items():
            try:
                y = call()
            except RuntimeError:  # a library refusing this shape/layout: not a candidate
                if name == "aten":
                    raise
                failed.add(name)
                continue
            results[name] = y[0] if isinstance(y, (tuple, list)) else y
        ref = results["aten"]
        bound = 1e-4 * float(ref.abs().max()) + 1e-5
        failed |= {name for name, y in results.items() if float((y - ref).abs().max()) > bound}
        times = interleaved({n: c for n, c in calls.items() if n not in failed}, repeat=ROUNDS, warmup=WARMUP - 1,
                            before=cold)
    return {name: times[name]["median_s"] if name not in failed else float("inf") for name in calls}


def choose(site: Site, args: list, backends: list[GemmBackend], cache: dict,
           concrete: Callable[[], list] | None = None) -> tuple[str, dict, str]:
    """(backend name, median times, reason) for one GEMM site and shape; measured once (on
    ``concrete()``, default ``args``), then kept in ``cache`` (keyed by CPU model, the
    kernel sources' hash, torch version, threads, op, argument shapes and dtypes — ``args``
    may be fake tensors)."""
    def sig(a):
        if isinstance(a, torch.Tensor):
            return "x".join(str(as_int(d)) for d in a.shape) + ":" + str(a.dtype).replace("torch.", "")
        return repr(a)
    rows = prod(as_int(d) for d in args[site.x].shape[:-1])
    from .timegate import kernels_version  # a cached timing is reused only by the code it timed
    key = (f"{cpu_model()} | kernels {kernels_version()} | torch {torch.__version__} | threads "
           f"{torch.get_num_threads()} | {site.kind}("
           + ", ".join(sig(a) for a in args) + ") | " + ",".join(be.name for be in backends)
           + (" | cold" if rows <= COLD_ROWS else ""))
    times = cache.get(key)
    if times is None:
        with TimingWindow() as window:
            times = measure(site, concrete() if concrete else args, backends)
        if window.busy() is None:  # timings of a machine shared with other work are used, never stored
            cache[key] = times
    base = times["aten"]
    best = min(times, key=times.__getitem__)
    if best != "aten" and times[best] <= base * (1 - MARGIN):
        return best, times, f"{best} {base / times[best]:.2f}x faster than aten (median of {ROUNDS})"
    return "aten", times, (f"aten kept: best alternative {best} within {MARGIN:.0%}" if best != "aten"
                           else "aten fastest")


def combine(measured: list[tuple[str, dict]]) -> tuple[str, dict, str]:
    """One backend for several sizes of a dynamic plan: ``measured`` = [(size label, median
    times per backend)], the first the decided-at size. Each backend's time relative to
    aten's is taken at every size; a backend more than :data:`SIZE_CAP` slower than aten at
    one size is out (a oneDNN prepacked weight 30% slower at one row), and of the rest the
    one with the lowest geometric mean of the ratios replaces aten when that mean is at
    least :data:`MARGIN` below 1 (every size counts alike: a plan serves the whole range,
    and MKL's GEMMs of 4–16 rows measured 1.5–1.75x slower than the prepacked weight here,
    where one row favoured eager's). Returns (backend, times with ``@label`` keys for the
    other sizes, reason)."""
    names = [n for n in measured[0][1] if all(n in t for _, t in measured)]
    ratios = {n: [t[n] / t["aten"] for _, t in measured] for n in names}
    mean = {n: math.exp(sum(math.log(r) for r in rs) / len(rs)) for n, rs in ratios.items()
            if max(rs) <= 1 + SIZE_CAP}
    best = min(mean, key=mean.__getitem__)
    times = dict(measured[0][1])
    for label, t in measured[1:]:
        times.update({f"{n}@{label}": v for n, v in t.items()})
    sizes = ", ".join(label for label, _ in measured)
    if best != "aten" and mean[best] <= 1 - MARGIN:
        return best, times, (f"{best} {1 / mean[best]:.2f}x faster than aten over {sizes} (geometric mean, "
                             f"at most {SIZE_CAP:.0%} slower at any; median of {ROUNDS})")
    return "aten", times, (f"aten kept: no backend {MARGIN:.0%} faster over {sizes} (geometric mean) "
                           f"without being {SIZE_CAP:.0%} slower at one")


#: Modes that measure: every backend, or (``"lean"``) those that keep no copy of the weight.
MEASURED_MODES = ("auto", "lean")


def check_mode(mode: str | None) -> None:
    """Raise ValueError unless ``mode`` is None, ``"auto"``, ``"lean"`` or a backend name."""
    if mode not in (None, *MEASURED_MODES, *(be.name for be in BACKENDS)):
        raise ValueError(f"opfuse: unknown gemm mode {mode!r}; expected auto, lean, "
                         + ", ".join(be.name for be in BACKENDS))


def _mode() -> str:
    return os.environ.get("OPFUSE_GEMM", "auto")


def _fold(gm: fx.GraphModule, node: fx.Node, w: fx.Node, kind: str, make: Callable[[], torch.Tensor],
          folded: dict, view=None, view_args: tuple = ()) -> tuple[fx.Node, int]:
    """The node reading weight ``w``'s folded copy ``opfuse_folded_<kind>_<w>`` (``make()``,
    registered and inserted before ``node`` the first time, read through ``view`` such as
    ``aten.t`` when given, called on the copy and ``view_args``), recorded as derived from
    ``w`` (never used stale); (that node, the bytes it added: 0 when another site made it
    already)."""
    ref = folded.get((kind, w.target))
    if ref is not None:
        return ref, 0
    buf = f"opfuse_folded_{kind}_{w.target.replace('.', '_')}"
    tensor = make()
    gm.register_buffer(buf, tensor)
    note_derived(gm, buf, [w.target])
    source = attrgetter(w.target)(gm)
    if isinstance(source, torch.Tensor) and source.layout == torch.strided:  # which tensor it copies, for
        # sharing the copy with other plans of the model (opfuse.api.share_folded_copies)
        gm.meta.setdefault("opfuse_folded_from", {})[buf] = (
            source.untyped_storage().data_ptr(), source.storage_offset(), tuple(source.shape), tuple(source.stride()),
            source.dtype)
    with gm.graph.inserting_before(node):
        ref = gm.graph.get_attr(buf)
        if view is not None:
            ref = gm.graph.call_function(view, (ref, *view_args))
    ref.meta["val"] = w.meta.get("val")
    folded[(kind, w.target)] = ref
    return ref, tensor.numel() * tensor.element_size()


def _transposed_source(gm: fx.GraphModule, w: fx.Node, wv: torch.Tensor) -> torch.Tensor | None:
    """The model's tensor whose transpose the weight ``w`` ([N, K]) is, when ``w`` is the
    folded copy ``opfuse_t_*`` that :func:`opfuse.graph.canonicalize.addmm_to_linear` made of
    a contiguous [K, N] weight and still holds exactly its values: the ``wt`` layout exists
    there already, so the backend reads that tensor (shared, detached) instead of copying it
    back (GPT-2's Conv1D weights: 381 MB of copies in a decode plan). None otherwise."""
    src = gm.meta.get("opfuse_transposed_of", {}).get(w.target)
    if not (isinstance(src, torch.Tensor) and src.layout == torch.strided and src.is_contiguous()
            and src.dtype == wv.dtype and src.device == wv.device and tuple(src.shape) == tuple(wv.shape[::-1])
            and torch.equal(src.t(), wv)):
        return None
    return src.detach()


def _replace_call(gm: fx.GraphModule, node: fx.Node, target, args: tuple) -> None:
    """Replace ``node`` by a call of ``target`` on ``args`` (same meta, same users)."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def is_wt_copy(node) -> bool:
    """``node`` reads a pre-transposed weight Wᵀ [K, N] that the ``wt`` backend folded."""
    return isinstance(node, fx.Node) and node.op == "get_attr" and str(node.target).startswith("opfuse_folded_wt_")


def direct_wt_matmuls(gm: fx.GraphModule) -> int:
    """``aten.linear(x, t(Wᵀ))`` without a bias on a pre-transposed weight (``wt`` backend)
    becomes ``aten.matmul(x, Wᵀ)``: what ``linear`` runs for a bias-less call
    (``at::matmul(input, weight.t())``, the same GEMM on the same operands, bit for bit),
    one Python dispatch instead of two (the ``t`` view and ``linear``) per GEMM and step; a
    Llama decode step has 33 of them. Runs after the precision pass (which reads the
    ``linear`` form). Returns the number of GEMMs rewritten."""
    done = 0
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is aten.linear.default and not node.kwargs
                and (len(node.args) == 2 or (len(node.args) == 3 and node.args[2] is None))):
            continue
        view = node.args[1]
        if not (isinstance(view, fx.Node) and view.op == "call_function" and view.target is aten.t.default
                and is_wt_copy(view.args[0])):
            continue
        _replace_call(gm, node, aten.matmul.default, (node.args[0], view.args[0]))
        if not view.users:
            gm.graph.erase_node(view)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def apply_gemm_choices(gm: fx.GraphModule, mode: str | None = None, also_at: list[dict] | None = None
                       ) -> list[GemmChoice]:
    """Pipeline pass: for every float32 CPU GEMM whose weight is a parameter (``aten.linear``
    and opfuse ops with a GEMM inside, :func:`sites`), choose a backend (:func:`choose`) and
    rewrite: ``wt`` folds a pre-transposed copy of the weight into the plan; ``onednn``
    replaces the node by ``mkldnn._linear_pointwise`` (with its GELU or add post-op);
    ``packed`` folds oneDNN's prepacked copy (one per weight) and runs every site on it.

    ``mode`` (default ``OPFUSE_GEMM`` or ``"auto"``): ``"auto"`` measures; ``"lean"``
    measures the backends that keep no copy of the weight (``aten``, ``onednn``, ``gemv``);
    ``"aten"`` keeps eager's GEMMs; a backend name forces it where usable. ``also_at``:
    other sizes of a dynamic plan ({symbol: size}, e.g. the range's minimum) at which a
    GEMM with symbolic rows is measured too; the backend must win at every size
    (:func:`combine`). Returns the choices (for the report).

    Raises:
        ValueError: unknown mode.
    """
    mode = mode or _mode()
    check_mode(mode)
    if mode == "aten":
        return []
    table = sites()
    cache = load_cache(CACHE)
    size_before = len(cache)
    choices: list[GemmChoice] = []
    folded: dict[tuple, fx.Node] = {}  # (kind, weight target) -> its folded copy, made once per weight
    for node in list(gm.graph.nodes):
        site = table.get(node.target) if node.op == "call_function" else None
        if site is None or node.kwargs:
            continue
        x, w = node.args[site.x], node.args[site.w]
        xv = getattr(x, "meta", {}).get("val")
        if not (isinstance(w, fx.Node) and foldable(gm, w) and isinstance(xv, torch.Tensor)):
            continue
        wv = attrgetter(w.target)(gm)
        if not (wv.dim() == 2 and wv.dtype == torch.float32 and xv.dtype == torch.float32
                and xv.device.type == "cpu" and wv.device.type == "cpu" and wv.is_contiguous()):
            continue
        n, k = wv.shape
        m = as_int(prod(xv.shape[:-1]))
        if m == 0:
            continue
        try:
            args = [_value(gm, a, concrete=False) for a in node.args]
        except ValueError:
            continue
        backends = [be for be in BACKENDS if be.available() and be.serves(site.kind) and be.usable(site.kind, args)
                    and not (mode == "lean" and be.copies)]
        if mode in MEASURED_MODES:
            name, times, reason = choose(site, args, backends, cache,
                                         concrete=lambda: [_value(gm, a, concrete=True) for a in node.args])
            symbolic = any(isinstance(d, torch.SymInt) for d in xv.shape[:-1])
            if symbolic and also_at:
                measured = [(f"M={m}", times)]
                for sizes in also_at:
                    with decided_at(sizes):
                        rows = as_int(prod(xv.shape[:-1]))
                        if rows == m or rows < 1 or f"M={rows}" in dict(measured):
                            continue
                        at = [_value(gm, a, concrete=True) for a in node.args]
                        other = choose(site, at, backends, cache)[1]
                    measured.append((f"M={rows}", other))
                if len(measured) > 1:
                    name, times, reason = combine(measured)
        elif any(be.name == mode for be in backends):
            name, times, reason = mode, {}, f"forced (gemm={mode})"
        else:
            continue
        extra = 0
        if name == "wt":
            source = _transposed_source(gm, w, wv)  # Wᵀ already a tensor of the model (GPT-2's Conv1D): no copy
            view, extra = _fold(gm, node, w, "wt", (lambda: source) if source is not None
                                else (lambda: wv.detach().t().contiguous()), folded, aten.t.default)
            extra = 0 if source is not None else extra
            node.replace_input_with(w, view)
        elif name == "packed":
            attr, extra = _fold(gm, node, w, "packed", lambda: pack(wv, m), folded)
            gm.meta.setdefault("opfuse_packed_rows", {}).setdefault(attr.target, m)  # opfuse.save packs it again
            if site.kind == "linear":
                b = node.args[site.b] if len(node.args) > site.b else None
                _replace_call(gm, node, _ONEDNN_OPS["linear"](), (x, attr, b, "none", [], ""))
            else:
                node.replace_input_with(w, attr)
        elif name == "gemv":
            b = node.args[site.b] if len(node.args) > site.b else None
            _replace_call(gm, node, torch.ops.opfuse.linear_gemv.default, (x, w, b))
        elif name == "blas":
            view, extra = _fold(gm, node, w, "blas", lambda: blas_layout(wv), folded, aten.as_strided.default,
                                ([n, k], [1, n + BLAS_PAD]))
            if site.kind == "linear":
                b = node.args[site.b] if len(node.args) > site.b else None
                _replace_call(gm, node, torch.ops.opfuse.linear_blas.default, (x, view, b))
            else:
                node.replace_input_with(w, view)
        elif name == "onednn":
            b = node.args[site.b] if site.b is not None and len(node.args) > site.b else None
            post = {"linear": ("none", [], ""), "linear_bias_gelu": ("gelu", [], "none")}
            if site.kind == "linear_residual":
                new_args = (x, node.args[3], w, b, "add")
            else:
                new_args = (x, w, b, *post[site.kind])
            _replace_call(gm, node, _ONEDNN_OPS[site.kind](), new_args)
        choices.append(GemmChoice(node.name, site.kind, m, k, n, name,
                                  {kk: round(v, 9) for kk, v in times.items()}, reason, extra,
                                  node.meta.get("opfuse_pattern", "")))
    if len(cache) != size_before:
        save_cache(CACHE, cache)
    if choices:
        drop_unused_parameters(gm)  # weights now read only through their transposed copy
        gm.graph.lint()
        gm.recompile()
    return choices
