"""Mixed precision by measurement: ``optimize(..., precision="bf16")`` runs a GEMM region
in bfloat16 only where its measured error on the example inputs stays within
``tolerance`` *and* it is measured faster than its float32 form; the whole model is then
checked against the float32 plan and regions are put back to float32 until it passes.

::

    float32 plan (GEMM backends chosen) ── record every value on the example inputs
      └─ regions, all decided on the float32 graph:
           a plain GEMM (aten.linear / oneDNN linear without post-op / Wᵀ matmul), with
             the aten.gelu that is its only user (erf or tanh) as oneDNN's GELU post-op;
             a float32 oneDNN linear with the GELU post-op (the GEMM backend's form of a
             fused bias+GELU) keeps that post-op;
           an opfuse op with GEMMs inside (FUSED_WEIGHTS): bias+GELU as the bf16 GEMM with
             the GELU post-op; FFN as two bf16 GEMMs (GELU post-op, bf16 hidden);
             linear+add+LayerNorm / linear+residual as the bf16 GEMM and their epilogue
             as plain ops (the SkipLayerNorm then becomes add_layernorm_bf16); the others
             (SwiGLU, GeGLU, linear+add+LayerNorm with its sum) on bf16 copies of their
             weights, their epilogue kernels unchanged (float32);
           at ≤ COLD_ROWS rows (a decode step) a plain GEMM and its bias as one
             opfuse.linear_bf16 GEMV on a dense bf16 weight (float32 x and sums: only W
             rounded), timed with the weight cold and the code warm (_measure)
           error  = max|y_bf16 − y_fp32| / max|y_fp32|   on the recorded inputs
           time   = bf16 vs the region's float32 form, interleaved medians (cached per shape)
           bf16 when error ≤ tolerance and time ≤ (1 − MARGIN) · float32 time
      └─ rewrite: x → bf16, oneDNN inner product on a prepacked bf16 copy of the weight
         (folded once; float32 accumulation, + float32 bias and the post-op on the
         accumulator, one rounding to bf16), result → float32
      └─ end to end vs the float32 plan: max|Δ| / max(1, max|ref|) ≤ E2E_FACTOR · tolerance
         and the cosine of every floating output ≥ COSINE_MIN; otherwise the regions with
         the largest errors go back to float32 (half of them per round) until it passes
      └─ attention_bf16_io + elide_casts: a bf16 result that only goes back to bf16 (GELU
         region → next GEMM, QKV GEMM → bf16 attention → output projection, through views
         and splits) skips its float32 round trip (exact: same bits)
      └─ fuse_add_layernorm_bf16: →float32(bf16 GEMM) + residual → layer_norm → bf16 becomes
         one opfuse.add_layernorm_bf16 (float32 out for the residual stream, bf16 out for
         the next GEMM); not exact, so the whole model is checked again (undone if over)

Attention (opfuse.attention, H = Hkv) is a region too: opfuse.attention_bf16 runs q·kᵀ and
P·v as oneDNN bf16 batched GEMMs, the raw scores rounded to bf16 where that is within budget
on the example inputs, else rounded once after the row max is subtracted (one GEMM more),
softmax in float32. When q, k and v come from GEMM sites that go bf16, they arrive rounded to
bf16 and the attention is judged by the error it adds to those rounded values (the rounding
is in the GEMMs' own errors); else by its whole error from float32 inputs. The end-to-end
check covers what the regions add up to (:mod:`opfuse.kernels.cpu.attention_bf16`; with
bf16 q, k, v 3.9 vs 5.2 ms at 8×12×128×32 and 7.0 vs 12.8 at 1×12×512×64 against ATen's
float32 SDPA, one thread, Zen 5, interleaved). ATen's SDPA nodes (a model run with
attn_implementation="sdpa") are attention sites too, read through their keyword arguments.
The attention's bf16 form is the fastest of opfuse's GEMM kernel, its per-head tiles kernel
(``tiles=True``: float32 scores in L1 between AVX512-BF16 register tiles, where the CPU has
avx512_bf16; Zen 4, 8×12×128×32 with caches evicted: 2.8 vs 3.1–3.8 ms) and ATen's SDPA on
bf16 q, k, v (``aten=True``), timed per shape and cached per CPU (:data:`ATTENTION_FORMS`): on Zen 5
ATen's bf16 SDPA was slower than its float32 (1.01 vs 0.84 ms at 1×12×128×64), on the Intel
Xeon with AMX tiles it is the faster form (all-MiniLM-L6-v2 8×128: 2.3 vs 3.3 ms opfuse's
kernel, 3.9 float32). A region measured slower in bf16 is measured twice (each form's
faster median kept), so one burst of steal on a shared VM does not keep it float32.
What stays float32: the residual stream, every normalisation's statistics (LayerNorm /
RMSNorm; after a bf16 GEMM the LayerNorm reads its bf16 result and writes float32 and bf16),
the softmax and the fused ops' epilogues. Measured on the 2-core AMD EPYC Zen 5 machines
(avx512_bf16, one thread): oneDNN's bf16 inner product on prepacked weights ran 340–390 GFLOP/s against
150–200 in float32 (oneDNN) and 70–85 (MKL), so every BERT / MiniLM GEMM region goes bf16;
at one row oneDNN's bf16 was slower than float32 and opfuse.linear_bf16's GEMV 2.4–3.4x
faster than MKL's float32 GEMV, so a Llama decode step runs every GEMM as a bf16 GEMV.
On a CPU without native bf16 (no ``avx512_bf16`` / ``amx_bf16``) oneDNN emulates bf16:
measured on the Intel Ice Lake machines (one thread) a 128×768×768 GEMM ran 4.6x *slower*
in bf16, a one-row GEMV over a 32000×512 LM head 1.5x faster (half the weight bytes), so
the time gate keeps float32 where emulation loses and the report says the CPU has no native
bf16. On an AVX2-only CPU (the Zen 2 machines) oneDNN has no bf16 inner product at all
(:func:`opfuse.kernels.cpu._gemm.onednn_bf16`): only the one-row GEMVs and attention are
candidates there. ``precision="fp16"`` has no CPU path: the report says so and the plan stays float32.
``precision="fp32"`` (the default) changes nothing.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass
from math import prod

import torch
from torch import fx

from .cost.device import TimingWindow, cpu_model, load_cache, save_cache
from .gemm import COLD_ROWS, is_wt_copy
from .kernels.cpu._gemm import onednn_bf16
from .graph.meta import concrete as as_int
from .graph.state import note_derived

aten = torch.ops.aten
PRECISIONS = ("fp32", "bf16", "fp16")
#: Per-GEMM budget: max|y_bf16 − y_fp32| / max|y_fp32| on the example inputs (bf16 keeps 8
#: significant bits: one rounding of x and W gives ~2⁻⁹ relative per product; sums of K
#: products with float32 accumulation measured 2–5e-3 on Transformer GEMMs).
DEFAULT_TOLERANCE = 1e-2
#: End-to-end budget as a multiple of ``tolerance`` (errors of successive layers add up).
E2E_FACTOR = 4.0
#: Smallest cosine between any floating output of the bf16 plan and the float32 plan.
COSINE_MIN = 0.9995
MARGIN = 0.03     # bf16 replaces float32 only when ≥ 3% faster (median vs median)
ROUNDS = 7
#: A region's timing is cached only when bf16 and float32 differ by at least this share: a
#: close call, on a noisy machine (±10–40% between runs on the shared Zen 5 VMs), would else
#: fix its decision for good (measured: bf16 attention kept off by one 5607 vs 5508 µs run).
CACHE_CLEAR = 0.10
CACHE = "gemm_cpu.json"


def check_precision(precision: str, tolerance: float | None) -> None:
    """Raise ValueError for an unknown ``precision`` or a ``tolerance`` that is not a
    positive finite number."""
    if precision not in PRECISIONS:
        raise ValueError(f"opfuse: precision must be one of {PRECISIONS}, got {precision!r}")
    if tolerance is not None and not (isinstance(tolerance, (int, float)) and 0 < tolerance < math.inf):
        raise ValueError(f"opfuse: tolerance must be a positive number (relative error), got {tolerance!r}")


def native_bf16() -> str | None:
    """The CPU flag giving native bf16 arithmetic (``amx_bf16``, ``avx512_bf16``), or None."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return None
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


@dataclass(frozen=True)
class PrecisionChoice:
    """One GEMM's precision decision; ``error``: max|y_bf16 − y_fp32| / max|y_fp32| on the
    example inputs; times in seconds (medians)."""

    node: str
    m: int
    k: int
    n: int
    precision: str
    error: float
    times_s: dict
    reason: str
    region: str = "gemm"  # "gemm" (+ "+bias" / "+gelu"), or the fused op's name


#: oneDNN eltwise post-ops a bf16 GEMM region absorbs: aten.gelu's ``approximate`` -> the
#: post-op's algorithm (:func:`epilogue_of`).
GELU_POST_OPS = {"none": "none", "tanh": "tanh"}


def bf16_linear(x: torch.Tensor, weight_bf16: torch.Tensor, bias: torch.Tensor | None,
                post: str = "none", algorithm: str = "") -> torch.Tensor:
    """x [..., K] float32 (or bfloat16) @ weight_bf16 [N, K]ᵀ in bfloat16 with float32
    accumulation (oneDNN's inner product; ``weight_bf16`` dense or prepacked by
    :func:`opfuse.gemm.pack`), + bias [N] in float32 and the ``post`` eltwise op ("gelu",
    ``algorithm`` "none" = erf or "tanh") applied to the float32 accumulator inside oneDNN,
    then rounded once to bfloat16; returned as float32 [..., N]."""
    xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    if bias is not None and bias.dim() != 1:  # oneDNN takes a [N] bias only: add it in float32
        return bf16_linear(xb, weight_bf16, None, post, algorithm) + bias if post == "none" else \
            torch.nn.functional.gelu(bf16_linear(xb, weight_bf16, None) + bias, approximate=algorithm)
    return torch.ops.mkldnn._linear_pointwise(xb, weight_bf16, bias, post, [], algorithm).float()


def _sole_user(node: fx.Node, target) -> fx.Node | None:
    users = list(node.users)
    u = users[0] if len(users) == 1 else None
    return u if u is not None and u.op == "call_function" and u.target is target and u.args[0] is node else None


def epilogue_of(node: fx.Node) -> fx.Node | None:
    """The ``aten.gelu`` (erf or tanh) that is the only user of ``node`` (the GEMM or its
    bias add; run as oneDNN's GELU post-op in the bf16 region), or None."""
    g = _sole_user(node, aten.gelu.default)
    return g if g is not None and _approximate(g) in GELU_POST_OPS else None


def _approximate(gelu: fx.Node) -> str:
    """An ``aten.gelu`` node's ``approximate`` ("none" = erf, or "tanh")."""
    return gelu.kwargs.get("approximate", gelu.args[1] if len(gelu.args) > 1 else "none")


def bias_add_of(node: fx.Node, env: dict) -> fx.Node | None:
    """The ``aten.add(node, bias)`` that is the only user of a GEMM without a bias argument
    (:func:`opfuse.gemm.direct_wt_matmuls`' form of a merged QKV), with ``bias`` a float32
    [N] tensor of the plan: added inside oneDNN in the bf16 region. None otherwise."""
    add = _sole_user(node, aten.add.Tensor)
    if add is None or len(add.args) != 2 or add.kwargs or not isinstance(add.args[1], fx.Node):
        return None
    bias, y = env.get(add.args[1]), env.get(node)
    ok = isinstance(bias, torch.Tensor) and isinstance(y, torch.Tensor) and bias.dim() == 1 \
        and bias.dtype == torch.float32 and bias.shape[0] == y.shape[-1] and add.args[1].op == "get_attr"
    return add if ok else None


def _tail(node: fx.Node, env: dict) -> list[fx.Node]:
    """The plain GEMM region's nodes: ``[node]``, + its bias add (when the GEMM has no bias
    argument), + its GELU."""
    nodes = [node]
    if node.target is aten.matmul.default:
        add = bias_add_of(node, env)
        if add is not None:
            nodes.append(add)
    gelu = epilogue_of(nodes[-1])
    return nodes + ([gelu] if gelu is not None else [])


def _dense_weight(gm: fx.GraphModule, w, transposed: bool = False) -> tuple[torch.Tensor, str] | None:
    """(float32 [N, K] weight, the attribute it is read from) of a GEMM's weight argument:
    a parameter, a prepacked oneDNN copy, the ``aten.t`` view of a pre-transposed copy or the
    ``as_strided`` view of a row-padded one, or
    (``transposed``: a ``matmul``'s [K, N] operand) the pre-transposed copy itself."""
    from operator import attrgetter
    if not isinstance(w, fx.Node):
        return None
    if transposed:
        t = attrgetter(w.target)(gm)
        return (t.detach().t(), w.target) if w.op == "get_attr" and t.layout == torch.strided else None
    if w.op == "call_function" and w.target is aten.t.default and isinstance(w.args[0], fx.Node) \
            and w.args[0].op == "get_attr":
        t = attrgetter(w.args[0].target)(gm)
        return (t.detach().t(), w.args[0].target) if t.layout == torch.strided else None
    if w.op == "call_function" and w.target is aten.as_strided.default and isinstance(w.args[0], fx.Node) \
            and w.args[0].op == "get_attr":  # the [N, K] view of a row-padded Wᵀ (the ``blas`` GEMM backend)
        t = attrgetter(w.args[0].target)(gm)
        return (t.detach().as_strided(*w.args[1:]), w.args[0].target) if t.layout == torch.strided else None
    if w.op == "get_attr":
        t = attrgetter(w.target)(gm).detach()
        return (t.to_dense() if t.is_mkldnn else t), w.target
    return None


def _outputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    from .graph.state import StateSnapshot, copy_inputs
    snap = StateSnapshot.take(gm)
    a, k = copy_inputs(args, kwargs)
    try:
        with torch.no_grad():
            return [t for t in tree_leaves(gm(*a, **k)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    finally:
        snap.restore()


def end_to_end(out: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """``{"max_error": max|Δ| / max(1, max|ref|), "min_cosine": ...}`` over the outputs
    (:func:`opfuse.verify.compare`'s scaling; cosine of each output flattened, in float64)."""
    from .verify import compare
    err = max((compare(o, r) for o, r in zip(out, ref)), default=0.0)
    cos = 1.0
    for o, r in zip(out, ref):
        a, b = o.detach().double().flatten(), r.detach().double().flatten()
        if a.numel() and torch.isfinite(a).all() and torch.isfinite(b).all():
            na, nb = a.norm(), b.norm()
            c = 1.0 if na == 0 and nb == 0 else float(a @ b / (na * nb)) if na * nb > 0 else 0.0
            cos = min(cos, c)
    return {"max_error": err, "min_cosine": cos}


def _measure(fp32: Callable, bf16: Callable, rows: int, warm: dict | None = None) -> dict:
    """Median seconds of each form; at ≤ :data:`opfuse.gemm.COLD_ROWS` rows (a weight
    stream, as in a decode step: there bf16's half-size weight is what can gain) with the
    weight cold and the code warm, as in a decode step: the caches evicted, then the same
    form run once on a copy of its weight (``warm[name]``, untimed), then the timed call.
    Evicting alone also evicted the op's code path: a Python-dispatched GEMV measured 430–
    500 µs cold against 44–65 µs hot and lost to MKL's 200–330, while in a real decode step
    it made the step 1.6x faster (Zen 5, Llama 8×512)."""
    from .bench.timing import evict_caches, interleaved
    before = None
    if rows <= COLD_ROWS:
        before = {name: (lambda w=(warm or {}).get(name): (evict_caches(), w and w())) for name in ("fp32", "bf16")}
    with torch.no_grad():
        times = interleaved({"fp32": fp32, "bf16": bf16}, repeat=ROUNDS, warmup=1, before=before)
    return {k: v["median_s"] for k, v in times.items()}


def apply_precision(gm: fx.GraphModule, args: tuple, kwargs: dict, precision: str = "fp32",
                    tolerance: float | None = None, errors: dict | None = None, timer: Callable | None = None,
                    also: list | tuple = ()) -> dict:
    """Pipeline pass (after the GEMM backends): lower GEMMs to ``precision`` where measured
    error and time allow (module docstring). ``errors`` / ``timer`` inject measurements
    (tests): ``errors[node name]`` replaces a measured error; ``timer(node, fp32, bf16)`` ->
    ``{"fp32": s, "bf16": s}`` replaces the clock. ``also``: more ``(args, kwargs)`` the
    end-to-end check covers (a dynamic plan's other verification sizes): the whole-model
    budget must hold on each. Returns the report's ``precision`` entry (plain data; ``{}``
    for ``"fp32"``).

    Raises:
        ValueError: unknown precision or bad tolerance."""
    check_precision(precision, tolerance)
    if precision == "fp32":
        return {}
    tol = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)
    info: dict = {"requested": precision, "tolerance": tol, "native": native_bf16(), "gemms": [],
                  "end_to_end": None, "reverted": 0}
    values = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    if precision == "fp16":
        info["note"] = "fp16: no CPU path (float16 GEMMs are a GPU feature here); the plan stays float32"
        return info
    if any(t.device.type != "cpu" for t in values) or not torch.backends.mkldnn.is_available():
        info["note"] = "bf16 is implemented for CPU GEMMs through oneDNN only; the plan stays float32"
        return info
    # (oneDNN first: a CPU flag without oneDNN's bf16 inner product still lowers no GEMM)
    info["note"] = ("native bf16 (" + info["native"] + ")" if info["native"] and onednn_bf16() else
                    "this CPU has no native bf16 (no avx512_bf16 / amx_bf16): oneDNN emulates it, so bf16 is kept "
                    "only where measured faster" if onednn_bf16() else
                    "this CPU has no bf16 GEMM in oneDNN (AVX2 only: no avx512_bf16 / amx_bf16 / AVX-512), so only "
                    f"the decode-size GEMVs (≤ {COLD_ROWS} rows: opfuse.linear_bf16's bf16 weight stream) and attention "
                    "are candidates, each kept only where measured faster")
    from .kernels.cpu.attention_bf16 import aten_form_keeps_nonfinite
    if not aten_form_keeps_nonfinite():
        info["note"] += ("; ATen's bf16 SDPA loses NaN/inf positions its float32 SDPA keeps on this CPU (probed), "
                         "so attention's bf16 form is opfuse's kernel only")
    from .verify import record_values
    env = record_values(gm, args, kwargs)
    inputs = [(args, kwargs)] + [tuple(x) for x in also]
    refs = [_outputs(gm, a, k) for a, k in inputs]

    def check_all() -> dict:  # the worst of every input set's end-to-end error
        checks = [end_to_end(_outputs(gm, a, k), r) for (a, k), r in zip(inputs, refs)]
        return {"max_error": max(c["max_error"] for c in checks), "min_cosine": min(c["min_cosine"] for c in checks),
                **({"inputs": len(checks)} if len(checks) > 1 else {})}
    chosen: list[tuple[Region, float]] = []
    converted: dict[str, list] = {}
    regions = [r for r in (_region(gm, node, env, converted, tol) for node in _sites(gm)) if r is not None]
    cache = load_cache(CACHE) if timer is None else {}  # read after the regions: the attention forms write it
    size = len(cache)
    decided: dict[str, str] = {}
    for region in regions:  # all decided on the float32 graph, before any is lowered (in graph order)
        node = region.node
        own = region.own_error is not None and all(decided.get(p.name) == "bf16" for p in region.fed_by)
        with torch.no_grad():
            err = region.own_error() if own else _relative_error(region.bf16(), region.out)
        if errors is not None and node.name in errors:
            err = errors[node.name]
        key = _timing_key(region.label) + (
            " | cold" if region.m <= COLD_ROWS else "")
        timed = region.bf16_timed or region.bf16
        times = timer(node, region.fp32, timed) if timer else cache.get(key)
        if times is None:
            with TimingWindow() as window:
                times = _measure(region.fp32, timed, region.m, region.warm)
                if times["bf16"] > times["fp32"] * (1 - MARGIN):  # a loss is measured twice: the faster of each
                    again = _measure(region.fp32, timed, region.m, region.warm)  # form's medians (a burst of
                    times = {kk: min(v, again[kk]) for kk, v in times.items()}  # steal on a shared VM hits one run)
            if window.busy() is None and abs(times["bf16"] / times["fp32"] - 1) >= CACHE_CLEAR:
                cache[key] = times  # a close call is measured again next time, not frozen
        faster = times["bf16"] <= times["fp32"] * (1 - MARGIN)
        if err > tol:
            why = f"float32: bf16 error {err:.1e} > tolerance {tol:.0e}"
        elif not faster:
            why = f"float32: bf16 not {MARGIN:.0%} faster ({times['bf16'] * 1e6:.0f} vs {times['fp32'] * 1e6:.0f} µs)"
        else:
            why = f"bf16{region.how}: error {err:.1e} ≤ {tol:.0e}, {times['fp32'] / times['bf16']:.2f}x faster"
        if own:
            why += " (error: what it adds to its inputs, rounded to bf16 by the GEMMs before it)"
        choice = PrecisionChoice(node.name, region.m, region.k, region.n, "bf16" if err <= tol and faster else "fp32",
                                 err, {kk: round(v, 9) for kk, v in times.items()}, why, region.kind)
        info["gemms"].append(asdict(choice))
        decided[node.name] = choice.precision
        if choice.precision == "bf16":
            chosen.append((region, err))
    if len(cache) != size:
        save_cache(CACHE, cache)
    for region, _ in chosen:
        region.lower()
    if chosen:
        from .rewrite import relax_views
        # opfuse.attention_bf16 returns contiguous [B, H, S, D] where ATen's CPU SDPA lays its
        # output out as [B, S, H, D]: a `view` after its `transpose(1, 2)` (GPT-2) needs reshape
        relax_views(gm, {r.node for r, _ in chosen if r.kind == "attention"})
        gm.recompile()
        try:
            check = check_all()
        except Exception as exc:  # noqa: BLE001  a lowered graph that does not run: the float32 plan
            for region, _ in chosen:
                region.restore()
            for g in info["gemms"]:
                if g["precision"] == "bf16":
                    g["precision"] = "fp32"
                    g["reason"] = f"float32: the bf16 plan raised {type(exc).__name__}: {str(exc)[:120]}"
            info["reverted"] += len(chosen)
            chosen = []
            gm.recompile()
            check = check_all()
        while chosen and not (check["max_error"] <= E2E_FACTOR * tol and check["min_cosine"] >= COSINE_MIN):
            chosen.sort(key=lambda c: -c[1])
            back, chosen = chosen[: max(1, len(chosen) // 2)], chosen[max(1, len(chosen) // 2):]
            for region, _ in back:
                region.restore()
                for g in info["gemms"]:
                    if g["node"] == region.node.name:
                        g["precision"] = "fp32"
                        g["reason"] = (f"float32: put back, the whole model was over budget (max error "
                                       f"{check['max_error']:.1e}, cosine {check['min_cosine']:.6f})")
            info["reverted"] += len(back)
            gm.recompile()
            check = check_all()
        info["end_to_end"] = check
    g = info["gemms"]  # the regions' own medians: what the plan's GEMM regions take, before -> after
    info["regions_time_s"] = {"fp32": sum(r["times_s"]["fp32"] for r in g),
                              "planned": sum(r["times_s"][r["precision"]] for r in g)}
    for region, _ in chosen:  # the float32 forms, kept unused while the budget was checked
        region.finish()
    info["attention_bf16_io"] = attention_bf16_io(gm) if chosen else 0
    info["casts_removed"] = elide_casts(gm) if chosen else 0
    info["direct_sdpa"] = direct_sdpa(gm) if chosen else 0
    info["add_layernorm_bf16"] = 0
    done = fuse_add_layernorm_bf16(gm) if chosen else []
    if done:  # not exact: the whole model is checked again, and the fusion undone if over budget
        gm.recompile()
        check = check_all()
        if check["max_error"] <= E2E_FACTOR * tol and check["min_cosine"] >= COSINE_MIN:
            info["add_layernorm_bf16"], info["end_to_end"] = len(done), check
        else:
            _unfuse_add_layernorm_bf16(gm, done)
            done = []
    from .rewrite import drop_unused_parameters, is_impure
    info["add_layernorm_bf16_inplace"] = 0
    if done:  # exact: checked bit for bit against the plan before, undone if any output differs
        gm.graph.eliminate_dead_code(is_impure_node=is_impure)  # the replaced nodes: not readers
        before = [o.clone() for o in _outputs(gm, args, kwargs)]
        inplace = inplace_add_layernorm_bf16(gm)
        gm.recompile()
        if all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(_outputs(gm, args, kwargs), before)):
            info["add_layernorm_bf16_inplace"] = len(inplace)
            for _, _, replaced in inplace:  # the functional op and its getitems (which DCE keeps)
                for n in replaced:
                    gm.graph.erase_node(n)
        else:
            _undo_inplace(gm, inplace)
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)  # keeps a dynamic plan's assertions
    drop_unused_parameters(gm)
    gm.graph.lint()
    gm.recompile()
    return info


def _relative_error(y, ref) -> float:
    """max|y − ref| / max|ref| over the floating tensors of ``y`` / ``ref`` (a tensor or a
    tuple of them, as a fused op returns), over their finite entries; ``inf`` where the
    NaN / ±inf positions differ (:func:`opfuse.verify.compare`'s rule; a NaN error would
    pass every ``err > tolerance`` test)."""
    from .verify import compare
    ys, rs = (y, ref) if isinstance(ref, (tuple, list)) else ((y,), (ref,))
    err = 0.0
    for a, r in zip(ys, rs):
        if isinstance(r, torch.Tensor) and r.is_floating_point() and r.numel():
            if compare(a, r) == math.inf:
                return math.inf
            fin = torch.isfinite(r)
            scale = float(r[fin].abs().max()) if fin.any() else 0.0
            err = max(err, float((a.float()[fin] - r[fin]).abs().max()) / scale if scale > 0 else 0.0)
    return err


@dataclass
class Region:
    """One bf16 candidate: a plain GEMM (with its GELU epilogue) or an opfuse op with GEMMs
    inside. ``fp32`` / ``bf16``: the region on the recorded values in each form (the
    clock's two sides); ``out``: the recorded float32 result; ``lower`` / ``restore``
    switch the graph to the bf16 form and back; ``finish`` drops the float32 form once the
    end-to-end check has passed; ``label``: the timing cache's key; ``how``: the report's
    words for the form."""

    node: fx.Node
    m: int
    k: int
    n: int
    fp32: Callable
    bf16: Callable
    out: object
    lower: Callable[[], None]
    restore: Callable[[], None]
    finish: Callable[[], None]
    label: str
    how: str = ""
    kind: str = "gemm"
    warm: dict | None = None  # "fp32" / "bf16" -> the form on a copy of its weight (:func:`_measure`)
    bf16_timed: Callable | None = None  # the bf16 form as the clock runs it, where that differs from ``bf16``
    own_error: Callable[[], float] | None = None  # the error the region adds to bf16 inputs from ``fed_by``
    fed_by: tuple = ()  # the GEMM sites whose results are its inputs (own_error applies when all go bf16)


#: opfuse ops with GEMMs inside -> the argument indices of their [N, K] weights; in bf16
#: these run on prepacked bf16 copies (:func:`opfuse.kernels.cpu._gemm.linear`) and keep
#: their float32 epilogue kernels.
FUSED_WEIGHTS = {"linear_bias_gelu": (1,), "linear_residual": (1,), "swiglu": (1,), "geglu": (1,),
                 "linear_add_layernorm": (1,), "linear_add_layernorm_sum": (1,), "ffn": (1, 3)}


def _fused_op(node: fx.Node) -> str | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
            target.namespace != "opfuse":
        return None
    name = target._schema.name.split("::")[-1]
    return name if name in FUSED_WEIGHTS else None


def _onednn_post(node: fx.Node) -> tuple[str, str] | None:
    """A float32 plan's ``mkldnn._linear_pointwise(x, W, b, attr, scalars, algorithm)``
    node's (post-op, algorithm) where its bf16 region can take it over: ("none", "") or
    ("gelu", erf "none" / "tanh"); None for any other post-op."""
    if len(node.args) < 4 or node.args[3] not in ("none", "gelu"):
        return None
    if node.args[3] == "none":
        return "none", ""
    algorithm = node.args[5] if len(node.args) > 5 else ""
    return ("gelu", algorithm) if algorithm in GELU_POST_OPS else None


def _sites(gm: fx.GraphModule) -> list[fx.Node]:
    """The GEMM nodes ``precision`` decides on: plain GEMMs (``aten.linear``, oneDNN linear
    without post-op or with the GELU one (:func:`_onednn_post`), :func:`opfuse.gemm.direct_wt_matmuls`' ``matmul``, ``opfuse.linear_gemv``,
    ``opfuse.linear_blas``)
    and the opfuse ops of :data:`FUSED_WEIGHTS`."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is _SDPA and _attention_site(n):
            out.append(n)
            continue
        if n.op != "call_function" or n.kwargs:
            continue
        if n.target in (aten.linear.default, torch.ops.opfuse.linear_gemv.default,
                        torch.ops.opfuse.linear_blas.default) or (
                n.target is torch.ops.mkldnn._linear_pointwise.default and _onednn_post(n) is not None):
            out.append(n)
        elif n.target is aten.matmul.default and is_wt_copy(n.args[1]):
            out.append(n)
        elif _fused_op(n) is not None or _attention_site(n):
            out.append(n)
    return out


_SDPA = aten.scaled_dot_product_attention.default
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention_call(n: fx.Node) -> tuple | None:
    """``(q, k, v, mask, scale, is_causal)`` of an opfuse.attention node, or of an ATen SDPA
    node (a model run with attn_implementation="sdpa": its keyword arguments read, the
    default scale 1/√D filled in; ``enable_gqa`` read from the shapes) without dropout; None
    otherwise."""
    if n.op != "call_function":
        return None
    if n.target is torch.ops.opfuse.attention.default:
        return tuple(n.args[:6])
    if n.target is not _SDPA:
        return None
    call = dict(zip(_SDPA_PARAMS, n.args)) | dict(n.kwargs)
    if set(call) - set(_SDPA_PARAMS) or call.get("dropout_p", 0.0) != 0.0:
        return None
    scale = call.get("scale")
    if scale is None:
        q = call["query"].meta.get("val") if isinstance(call["query"], fx.Node) else None
        if not isinstance(q, torch.Tensor) or not isinstance(q.shape[-1], int):
            return None
        scale = 1.0 / math.sqrt(q.shape[-1])
    return (call["query"], call["key"], call["value"], call.get("attn_mask"), float(scale),
            bool(call.get("is_causal", False)))


def _attention_site(n: fx.Node) -> bool:
    """An attention (opfuse.attention or ATen SDPA, :func:`_attention_call`) that
    opfuse.attention_bf16 computes (grouped-query heads in its ATen form only; causal only
    with Sq = Sk), by the nodes'
    recorded shapes."""
    call = _attention_call(n)
    if call is None:
        return False
    q, k = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in call[:2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() != 4:
        return False
    try:  # grouped-query heads only in the ATen form (ATTENTION_FORMS), which maps them by index
        heads = bool(q.shape[1] == k.shape[1]) or ("aten" in ATTENTION_FORMS and bool(q.shape[1] % k.shape[1] == 0))
        return heads and not (call[5] and bool(q.shape[-2] != k.shape[-2]))
    except Exception:  # a symbolic shape the comparison cannot decide: not a site
        return False


def _bf16_weight(gm: fx.GraphModule, converted: dict, w_arg, rows: int, transposed: bool = False,
                 packed: bool = True):
    """(bf16 copy of a GEMM's weight argument — oneDNN-prepacked, or with ``packed=False``
    dense [N, K] for :func:`opfuse.kernels.cpu.linear_bf16`'s GEMV —, a function giving its
    ``get_attr`` node, made once per source and shared) or None when the argument is not a
    parameter / folded copy (:func:`_dense_weight`)."""
    from .gemm import pack
    dense = _dense_weight(gm, w_arg, transposed=transposed)
    if dense is None:
        return None
    w32, source = dense
    made = converted.get((source, packed))
    if made is None:
        wb = w32.to(torch.bfloat16).contiguous()
        made = converted[(source, packed)] = [pack(wb, rows) if packed else wb, None]

    def attr() -> fx.Node:
        if made[1] is None:
            buf = f"opfuse_folded_bf16{'' if packed else 'v'}_{source.replace('.', '_')}"
            gm.register_buffer(buf, made[0])
            note_derived(gm, buf, [source])
            if packed:
                gm.meta.setdefault("opfuse_packed_rows", {})[buf] = rows  # opfuse.save packs it again
            with gm.graph.inserting_before(next(n for n in gm.graph.nodes if n.op != "placeholder")):
                made[1] = gm.graph.get_attr(buf)
        return made[1]
    return made[0], attr


def _region(gm: fx.GraphModule, node: fx.Node, env: dict, converted: dict,
            tol: float = DEFAULT_TOLERANCE) -> Region | None:
    """The bf16 candidate of the site ``node`` on the recorded values ``env``, or None where
    it does not apply (a weight not a parameter / folded copy, an input not float32, no
    recorded value). ``tol``: the error budget, for a region with cheaper and dearer bf16
    forms (attention: unshifted scores where they are accurate enough)."""
    x = env.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() < 2:
        return None
    m = as_int(prod(x.shape[:-1]))
    if _attention_site(node):
        call = _attention_call(node)
        return _attention_region(node, env, call, [env.get(a, a) if isinstance(a, fx.Node) else a for a in call], m, tol)
    values = [env.get(a, a) if isinstance(a, fx.Node) else a for a in node.args]
    fused = _fused_op(node)
    if not onednn_bf16() and (fused is not None or m > COLD_ROWS):
        return None  # its bf16 form is oneDNN's bf16 inner product, which this CPU lacks
    if fused == "linear_bias_gelu" and m > COLD_ROWS and node.args[3] in GELU_POST_OPS:
        # its bf16 form is oneDNN's GEMM with the GELU post-op (as the unfused GEMM + GELU
        # region): the bf16 result then feeds the next GEMM without a float32 round trip
        return _gemm_region(gm, node, env, converted, x, m, [node], node.args[2], "gelu",
                            GELU_POST_OPS[node.args[3]], "linear_bias_gelu as gemm+gelu")
    if fused == "ffn" and m > COLD_ROWS and node.args[5] in GELU_POST_OPS:
        region = _ffn_region(gm, node, env, converted, x, m, values)
        if region is not None:
            return region
    if fused in ("linear_add_layernorm", "linear_residual") and m > COLD_ROWS:
        region = _skip_layernorm_region(gm, node, env, converted, x, m, values)
        if region is not None:
            return region
    if fused is not None:
        if any(isinstance(a, fx.Node) and not isinstance(v, torch.Tensor) for a, v in zip(node.args, values)) \
                or not isinstance(env.get(node), (torch.Tensor, tuple, list)):
            return None
        made = {i: _bf16_weight(gm, converted, node.args[i], m) for i in FUSED_WEIGHTS[fused]}
        if any(v is None for v in made.values()):
            return None
        low = [made[i][0] if i in made else v for i, v in enumerate(values)]
        n_out, k = made[FUSED_WEIGHTS[fused][0]][0].shape
        weights = {i: node.args[i] for i in made}

        def lower():  # the other arguments may have been rerouted by the regions lowered before
            node.args = tuple(made[i][1]() if i in made else a for i, a in enumerate(node.args))
            node.meta["opfuse_precision"] = "bf16"

        def restore():
            node.args = tuple(weights.get(i, a) for i, a in enumerate(node.args))
            node.meta.pop("opfuse_precision", None)
        return Region(node, m, k, n_out, lambda: node.target(*values), lambda: node.target(*low), env[node],
                      lower, restore, lambda: None,
                      f"bf16 packed weights vs {node.target}({m}x{k}, " + ", ".join(
                          f"{made[i][0].shape[0]}x{made[i][0].shape[1]}" for i in made) + ")",
                      " GEMMs, float32 epilogue", fused)
    if m <= COLD_ROWS:
        return _gemv_region(gm, node, env, converted, x, m)
    if node.target is torch.ops.mkldnn._linear_pointwise.default and _onednn_post(node)[0] == "gelu":
        # the float32 plan's oneDNN GEMM with its GELU post-op (the GEMM backend chose oneDNN
        # for a linear_bias_gelu): the same post-op on the bf16 inner product
        return _gemm_region(gm, node, env, converted, x, m, [node], node.args[2], *_onednn_post(node),
                            "gemm+bias+gelu" if node.args[2] is not None else "gemm+gelu")
    nodes = _tail(node, env)
    b_arg = node.args[2] if len(node.args) > 2 and node.target is not aten.matmul.default else None
    if len(nodes) > 1 and nodes[1].target is aten.add.Tensor:
        b_arg = nodes[1].args[1]
    post, algorithm = "none", ""
    if nodes[-1].target is aten.gelu.default:
        post, algorithm = "gelu", GELU_POST_OPS[_approximate(nodes[-1])]
    kind = "gemm" + ("+bias" if len(nodes) > 1 and nodes[1].target is aten.add.Tensor else "") + \
        ("+gelu" if post != "none" else "")
    return _gemm_region(gm, node, env, converted, x, m, nodes, b_arg, post, algorithm, kind)


#: The unshifted bf16 attention is chosen only with its error within this share of the budget.
UNSHIFTED_SHARE = 0.5


#: The bf16 attention forms the precision pass chooses from, by measured time (the order
#: breaks ties): "opfuse" = opfuse.attention_bf16's own kernel (shifted or unshifted scores,
#: by error), "tiles" = its one-kernel-per-head form (``tiles=True``: float32 scores in L1,
#: AVX512-BF16 tiles; where :func:`~opfuse.kernels.cpu.attention_bf16.tiles_supported`),
#: "aten" = ATen's SDPA on bf16 q, k, v (``aten=True``; AMX tiles where the CPU has them).
#: Tests pin one by setting this to a single form.
ATTENTION_FORMS = ("opfuse", "tiles", "aten")


def _timing_key(label: str) -> str:
    """The timing cache's key of a measurement ``label`` on this CPU, torch and thread count."""
    return f"{cpu_model()} | torch {torch.__version__} | threads {torch.get_num_threads()} | {label}"


def _attention_form(label: str, forms: dict[str, Callable]) -> tuple[str, dict]:
    """(the fastest of ``forms`` — name -> the bf16 attention as the plan would run it —,
    their median seconds), measured interleaved (:data:`ROUNDS`) and cached per CPU, torch
    version and thread count under ``label`` unless the two are within :data:`CACHE_CLEAR`."""
    if len(forms) == 1:
        return next(iter(forms)), {}
    from .bench.timing import interleaved
    key = _timing_key(label)
    cache = load_cache(CACHE)
    times = cache.get(key)
    if not isinstance(times, dict) or set(times) != set(forms):
        with torch.no_grad(), TimingWindow() as window:
            times = {k: v["median_s"] for k, v in interleaved(forms, repeat=ROUNDS, warmup=1).items()}
        if window.busy() is None and max(times.values()) / min(times.values()) - 1 >= CACHE_CLEAR:
            cache[key] = times
            save_cache(CACHE, cache)
    return min(forms, key=lambda f: times[f]), times


def _attention_region(node: fx.Node, env: dict, call: tuple, values: list, m: int,
                      tol: float = DEFAULT_TOLERANCE) -> Region | None:
    """An attention (``call`` = (q, k, v, mask, scale, is_causal) nodes / constants,
    ``values`` theirs recorded: :func:`_attention_call`) as opfuse.attention_bf16 (bf16 GEMMs,
    float32 softmax: :mod:`opfuse.kernels.cpu.attention_bf16`) in the faster of its forms
    (:data:`ATTENTION_FORMS`, :func:`_attention_form`) whose error is within budget: opfuse's
    kernel with the raw scores rounded (``shift=False``: one GEMM and one pass fewer) where
    that form's error on the recorded values is within :data:`UNSHIFTED_SHARE` of ``tol`` (its
    worst case grows with the scores' size, so it keeps a margin for inputs other than the
    examples), else with the scores rounded after the row max is taken off; or ATen's SDPA
    on bf16 q, k, v (float32 scores) where its error is within ``tol`` (the precision pass then
    compares the chosen one's error with ``tol``). ``m`` = B·H·Sq rows, reported as m × k (D)
    × n (Sk)."""
    from .kernels.cpu.attention_bf16 import VERSION as attention_bf16_version
    from .kernels.cpu.attention_bf16 import aten_form_keeps_nonfinite, tiles_supported
    q, k = values[0], values[1]
    if not isinstance(env.get(node), torch.Tensor) or not isinstance(k, torch.Tensor) or \
            (isinstance(call[3], fx.Node) and not isinstance(values[3], torch.Tensor)):
        return None  # (causal Sq ≠ Sk was left out by _attention_site)
    gqa = bool(q.shape[1] != k.shape[1])  # grouped-query heads: the ATen form only (_attention_site)
    low = torch.ops.opfuse.attention_bf16.default
    # q, k, v from GEMM sites: once those run in bf16 they arrive rounded to bf16, and what
    # this region adds is its error on those rounded values (measured on MiniLM: the shifted
    # form's error from float32 inputs, 1.3e-2 in layer 0, is the float32 kernel's own on
    # bf16-rounded q, k, v, 1.4e-2; the rounding is the GEMMs' and is in their error)
    producers = tuple(_producer(a) for a in call[:3])
    sites = _gemm_producers(node)
    fed = all(p in sites for p in producers)
    rounded = [t.to(torch.bfloat16).to(t.dtype) if fed and i < 3 else t for i, t in enumerate(values)]
    # timed as the plan would run it: q, k, v in bf16 where each is a view of a GEMM site's
    # result (then attention_bf16_io feeds the kernel bf16 and takes its bf16 output)
    timed_values = [t.to(torch.bfloat16) if fed and i < 3 else t for i, t in enumerate(values)]
    with torch.no_grad():
        ref_r = torch.ops.opfuse.attention.default(*rounded) if fed else env[node]
        tiles = tiles_supported(as_int(q.shape[-1]), as_int(values[2].shape[-1]))
        names = tuple(f for f in (("aten",) if gqa else ATTENTION_FORMS)
                      if (f != "aten" or aten_form_keeps_nonfinite()) and (f != "tiles" or tiles))
        if not names:
            return None  # grouped-query heads, and ATen's bf16 SDPA loses non-finite values here
        shift = "opfuse" in names and not _relative_error(low(*rounded, False), ref_r) <= UNSHIFTED_SHARE * tol
        # the row shift from landmark keys (one small GEMM instead of S₁ and its row max), held
        # to the same margin as the raw scores: its error, too, depends on the inputs
        sample = shift and _relative_error(low(*rounded, True, False, True), ref_r) <= UNSHIFTED_SHARE * tol
        forms = {"opfuse": (shift, False, sample), "aten": (True, True, False), "tiles": (True, False, False, True)}
        forms = {f: forms[f] for f in names
                 if f == "opfuse" or len(names) == 1 or _relative_error(low(*rounded, *forms[f]), ref_r) <= tol}
    shape = f"{'x'.join(str(as_int(s)) for s in q.shape)}, Sk={as_int(k.shape[-2])}, mask={values[3] is not None}, " \
            f"causal={values[5]}" + (f", Hkv={as_int(k.shape[1])}" if gqa else "")
    form, _ = _attention_form(f"bf16 attention v{attention_bf16_version} forms {'/'.join(forms)} ({shape}"
                              f"{', sampled shift' if sample else ', shifted' if shift else ''}{', bf16 q/k/v' if fed else ''})",
                              {f: (lambda a=a: low(*timed_values, *a)) for f, a in forms.items()})
    flags = forms[form]
    target, args, kwargs = node.target, node.args, node.kwargs

    def lower():
        node.target = low
        node.args = tuple(call) + ((True, True) if form == "aten" else (True, False, False, True) if form == "tiles"
                                   else (True, False, True) if sample else () if shift else (False,))
        node.kwargs = {}
        node.meta["opfuse_precision"] = "bf16"
        node.meta["opfuse_gqa"] = gqa

    def restore():
        node.target, node.args, node.kwargs = target, args, kwargs
        node.meta.pop("opfuse_precision", None)
        node.meta.pop("opfuse_gqa", None)

    def fp32():  # the node as the float32 plan runs it
        return target(*[env.get(a, a) if isinstance(a, fx.Node) else a for a in args],
                      **{kk: env.get(a, a) if isinstance(a, fx.Node) else a for kk, a in kwargs.items()})
    d, sk = q.shape[-1], k.shape[-2]
    name = "ATen SDPA" if form == "aten" else "tiles" if form == "tiles" else \
        "sampled shift" if sample else "shifted" if shift else "unshifted"
    how = " (ATen's SDPA on bf16 q/k/v: float32 scores" if form == "aten" else \
        " tiles (one kernel per head: float32 scores kept in L1" if form == "tiles" else \
        " GEMMs (scores rounded after the landmark keys' max is taken off" if sample else \
        f" GEMMs ({'scores rounded after the row max is taken off' if shift else 'raw scores rounded'}"
    return Region(node, m, as_int(d), as_int(sk), fp32,
                  lambda: low(*values, *flags), env[node], lower, restore, lambda: None,
                  f"bf16 attention v{attention_bf16_version} {name}{', bf16 q/k/v' if fed else ''} vs "
                  f"{_op_name(target)}({shape})",
                  how + "), float32 softmax", "attention", bf16_timed=lambda: low(*timed_values, *flags),
                  own_error=(lambda: _relative_error(low(*rounded, *flags), ref_r)) if fed else None,
                  fed_by=producers if fed else ())


def _op_name(target) -> str:
    return "opfuse.attention" if target is torch.ops.opfuse.attention.default else "aten SDPA"


def _producer(a):
    """The node whose value ``a`` re-indexes (through views and split pieces)."""
    return _walk_views(a)[1]


def _walk_views(a) -> tuple[list, object]:
    """(the views from ``a`` up, innermost last; the value they re-index): :func:`_is_view`."""
    views = []
    while _is_view(a):
        views.append(a)
        a = a.args[0]
    return views, a


def _gemm_producers(node: fx.Node) -> set:
    """The GEMM sites among the graph's nodes (the precision pass may run them in bf16)."""
    return {n for n in _sites(node.graph.owning_module) if _attention_call(n) is None}


def _gemm_region(gm: fx.GraphModule, node: fx.Node, env: dict, converted: dict, x: torch.Tensor, m: int,
                 nodes: list[fx.Node], b_arg, post: str, algorithm: str, kind: str) -> Region | None:
    """The GEMM region ``nodes`` (its first node's x and weight; bias ``b_arg``; ``post``
    GELU or "none") as one oneDNN bf16 inner product on a prepacked bf16 weight."""
    b = env.get(b_arg) if isinstance(b_arg, fx.Node) else None
    out = env.get(nodes[-1])
    made = _bf16_weight(gm, converted, node.args[1], m, transposed=node.target is aten.matmul.default)
    if made is None or not isinstance(out, torch.Tensor) or (b_arg is not None and not isinstance(b, torch.Tensor)):
        return None
    wb, attr = made
    n_out, k = wb.shape
    chain: list[fx.Node] = []

    def lower():
        chain[:] = _lower(gm, nodes, attr(), b_arg, post, algorithm)

    def finish():
        for n in reversed(nodes):
            gm.graph.erase_node(n)
    return Region(node, m, k, n_out, _float32_form(nodes, env), lambda: bf16_linear(x, wb, b, post, algorithm), out,
                  lower, lambda: _restore(gm, nodes, chain), finish,
                  f"bf16 packed {'+' + post + '(' + algorithm + ') ' if post != 'none' else ''}vs {node.target}("
                  f"{m}x{k}, {n_out}x{k}, bias={b is not None})",
                  (" + bias" if "+bias" in kind else "") + (" + GELU post-op" if post != "none" else ""), kind)


def _replaced_node_hooks(gm: fx.GraphModule, node: fx.Node, chain: list[fx.Node]) -> tuple[Callable, Callable]:
    """(restore, finish) of a region whose ``lower`` routes ``node``'s users to ``chain[-1]``
    (the inserted bf16 nodes ``chain``): restore routes them back to ``node`` and erases the
    chain; finish erases ``node`` once nothing reads it."""
    def restore():
        chain[-1].replace_all_uses_with(node)
        for c in reversed(chain):
            gm.graph.erase_node(c)
        chain.clear()

    def finish():
        if not node.users:
            gm.graph.erase_node(node)
    return restore, finish


def _skip_layernorm_region(gm: fx.GraphModule, node: fx.Node, env: dict, converted: dict, x: torch.Tensor,
                           m: int, values: list) -> Region | None:
    """A float32 plan's ``opfuse.linear_add_layernorm(x, W, b, r, w, β, eps)`` or
    ``opfuse.linear_residual(x, W, b, r)`` (x [..., K], W [N, K], b [N] or None, r [..., N]
    float32) as the bf16 GEMM it holds and its epilogue as plain ops:
    ``x → bf16 → _linear_pointwise(prepacked bf16 W, b)`` (bf16 [..., N]) ``→ float32 →``
    ``opfuse.add_layernorm(·, r, w, β, eps)`` / ``+ r``. :func:`fuse_add_layernorm_bf16` then
    turns that SkipLayerNorm (for linear_residual: the ``layer_norm`` after its add, where
    there is one) into ``opfuse.add_layernorm_bf16`` on the GEMM's bf16 result: no float32
    copy of the GEMM's output, and its bf16 output feeds the next GEMM. The fused op on a bf16
    weight instead casts x, and its result, per call (BERT-base 1×128 on the AMX Xeon: 946 µs
    a call, 24 a forward). The measured and checked bf16 form is the one the plan runs (with
    add_layernorm_bf16 for linear_add_layernorm). None where an argument is not a recorded
    float32 tensor of those shapes (the generic fused-op region then applies)."""
    norm = len(node.args) == 7  # linear_add_layernorm; else linear_residual (4 arguments)
    w_arg = node.args[1]
    b, r = values[2], values[3]
    lw, lb, eps = values[4:7] if norm else (None, None, None)
    out = env.get(node)
    if not (isinstance(r, torch.Tensor) and isinstance(out, torch.Tensor) and r.dtype == torch.float32
            and tuple(r.shape) == tuple(out.shape)
            and (b is None or (isinstance(b, torch.Tensor) and b.dim() == 1 and b.dtype == torch.float32))
            and (not norm or (isinstance(lw, torch.Tensor) and (lb is None or isinstance(lb, torch.Tensor))))):
        return None
    made = _bf16_weight(gm, converted, w_arg, m)
    if made is None:
        return None
    wb, attr = made
    n_out, k = wb.shape
    chain: list[fx.Node] = []

    def bf16():
        yb = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), wb, b, "none", [], "")
        return torch.ops.opfuse.add_layernorm_bf16(yb, r, lw, lb, eps)[0] if norm else yb.float() + r

    def lower():  # the arguments as they are now: regions lowered before may have rerouted them
        chain[:] = _lower(gm, [node], attr(), node.args[2])  # x → bf16 → GEMM → float32 = y, node's users on y
        y, g = chain[-1], gm.graph
        with g.inserting_after(y):
            last = g.call_function(torch.ops.opfuse.add_layernorm.default, (y, node.args[3], *node.args[4:7])) \
                if norm else g.call_function(aten.add.Tensor, (y, node.args[3]))
        last.meta["val"] = node.meta.get("val")
        y.replace_all_uses_with(last, delete_user_cb=lambda u: u is not last)
        chain.append(last)

    restore, finish = _replaced_node_hooks(gm, node, chain)
    what = "add_layernorm_bf16" if norm else "residual add"
    return Region(node, m, k, n_out, lambda: node.target(*values), bf16, out, lower, restore, finish,
                  f"bf16 packed GEMM + {what} vs {node.target}({m}x{k}, {n_out}x{k}, bias={b is not None})",
                  ", SkipLayerNorm on its bf16 result" if norm else ", float32 residual add",
                  "linear_add_layernorm as gemm+add_layernorm" if norm else "linear_residual as gemm+add")


def _ffn_region(gm: fx.GraphModule, node: fx.Node, env: dict, converted: dict, x: torch.Tensor,
                m: int, values: list) -> Region | None:
    """A float32 plan's ``opfuse.ffn(x, W1, b1, W2, b2, approximate, block_rows)`` (x [..., K],
    W1 [H, K], b1 [H], W2 [N, H], b2 [N]) as two oneDNN bf16 GEMMs on prepacked bf16 weights:
    ``x → bf16 → _linear_pointwise(W1, b1, GELU post-op) → _linear_pointwise(W2, b2) →
    float32``; the hidden [M, H] activation stays bf16 between them (rounded once, after
    the GELU on the float32 accumulator). The fused op on bf16 weights instead casts x, each
    block's hidden rows and its result per call. None where a bias is not a float32 [H] / [N]
    tensor (the generic fused-op region then applies)."""
    b1, b2, approximate = values[2], values[4], values[5]
    out = env.get(node)
    if not (isinstance(out, torch.Tensor) and all(
            v is None or (isinstance(v, torch.Tensor) and v.dim() == 1 and v.dtype == torch.float32) for v in (b1, b2))):
        return None
    made1, made2 = _bf16_weight(gm, converted, node.args[1], m), _bf16_weight(gm, converted, node.args[3], m)
    if made1 is None or made2 is None:
        return None
    (w1b, attr1), (w2b, attr2) = made1, made2
    algorithm = GELU_POST_OPS[approximate]
    chain: list[fx.Node] = []

    def bf16():
        hb = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), w1b, b1, "gelu", [], algorithm)
        return torch.ops.mkldnn._linear_pointwise(hb, w2b, b2, "none", [], "").float()

    def lower():  # the arguments as they are now: regions lowered before may have rerouted them
        g = gm.graph
        with g.inserting_after(node):
            xb = g.call_function(aten._to_copy.default, (node.args[0],), {"dtype": torch.bfloat16})
        with g.inserting_after(xb):
            hb = g.call_function(torch.ops.mkldnn._linear_pointwise.default,
                                 (xb, attr1(), node.args[2], "gelu", [], algorithm))
        with g.inserting_after(hb):
            yb = g.call_function(torch.ops.mkldnn._linear_pointwise.default, (hb, attr2(), node.args[4], "none", [], ""))
        with g.inserting_after(yb):
            y = g.call_function(aten._to_copy.default, (yb,), {"dtype": torch.float32})
        chain[:] = [xb, hb, yb, y]
        for c in chain:
            c.meta["opfuse_precision"] = "bf16"
        y.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(y, delete_user_cb=lambda u: u not in chain)

    restore, finish = _replaced_node_hooks(gm, node, chain)
    hidden, k = w1b.shape
    return Region(node, m, k, hidden, lambda: node.target(*values), bf16, out, lower, restore, finish,
                  f"bf16 packed GEMM+GELU({algorithm}) + GEMM vs {node.target}({m}x{k}, {hidden}x{k}, "
                  f"{w2b.shape[0]}x{hidden})", ", two GEMMs, GELU post-op, bf16 hidden", "ffn as gemm+gelu, gemm")


def _gemv_region(gm: fx.GraphModule, node: fx.Node, env: dict, converted: dict, x: torch.Tensor,
                 m: int) -> Region | None:
    """A decode-size plain GEMM (m ≤ :data:`opfuse.gemm.COLD_ROWS` rows: a weight stream)
    and its bias add as one ``opfuse.linear_bf16`` call on a dense bf16 copy of the weight
    (float32 x and sums, the weight's bytes halved); a GELU after it stays float32."""
    nodes = [n for n in _tail(node, env) if n.target is not aten.gelu.default]
    b_arg = node.args[2] if len(node.args) > 2 and node.target is not aten.matmul.default else None
    if len(nodes) > 1:
        b_arg = nodes[1].args[1]
    b = env.get(b_arg) if isinstance(b_arg, fx.Node) else None
    out = env.get(nodes[-1])
    made = _bf16_weight(gm, converted, node.args[1], m, transposed=node.target is aten.matmul.default, packed=False)
    if made is None or not isinstance(out, torch.Tensor) or (b_arg is not None and not isinstance(b, torch.Tensor)):
        return None
    wd, attr = made
    n_out, k = wd.shape
    vector_bias = b is not None and b.dim() == 1 and b.dtype == torch.float32
    gemv = torch.ops.opfuse.linear_bf16
    chain: list[fx.Node] = []

    def lower():
        last = nodes[-1]
        with gm.graph.inserting_after(last):
            y = gm.graph.call_function(gemv.default, (node.args[0], attr(), b_arg if vector_bias else None))
        chain[:] = [y]
        if b_arg is not None and not vector_bias:
            with gm.graph.inserting_after(y):
                chain.append(gm.graph.call_function(aten.add.Tensor, (y, b_arg)))
        for c in chain:
            c.meta["opfuse_precision"] = "bf16"
        chain[-1].meta["val"] = last.meta.get("val")
        last.replace_all_uses_with(chain[-1], delete_user_cb=lambda u: u not in chain)

    def finish():
        for n in reversed(nodes):
            gm.graph.erase_node(n)

    def bf16(w=wd):
        y = gemv(x, w, b if vector_bias else None)
        return y if b is None or vector_bias else y + b
    w_node = node.args[1]
    warm = {"fp32": _float32_form(nodes, {**env, w_node: _copy(env.get(w_node))}), "bf16": lambda: bf16(wd.clone())}
    return Region(node, m, k, n_out, _float32_form(nodes, env), bf16, out, lower,
                  lambda: _restore(gm, nodes, chain), finish,
                  f"bf16 GEMV vs {node.target}({m}x{k}, {n_out}x{k}, bias={b is not None}) | code warm",
                  " GEMV (weight stream in bf16, float32 sums)", "gemv", warm)


def _copy(t):
    """A copy of a recorded weight value (same strides; oneDNN prepacked ones too), for
    :func:`_measure`'s warm-up call; non-tensors as they are."""
    return t.clone() if isinstance(t, torch.Tensor) else t


def _float32_form(nodes: list[fx.Node], env: dict) -> Callable[[], torch.Tensor]:
    """The float32 region as the plan runs it (the GEMM node, then its bias add and GELU),
    on the recorded values: the clock's baseline."""
    def run():
        y = None
        for i, n in enumerate(nodes):
            args = [y if (i and a is nodes[i - 1]) else env.get(a, a) if isinstance(a, fx.Node) else a
                    for a in n.args]
            y = n.target(*args, **n.kwargs)
        return y
    return run


def _lower(gm: fx.GraphModule, nodes: list[fx.Node], attr: fx.Node, b, post: str = "none",
           algorithm: str = "") -> list[fx.Node]:
    """Insert the bf16 form of the GEMM region ``nodes`` (:func:`_tail`: the GEMM, its bias
    add, its GELU as oneDNN's post-op when ``post`` is "gelu") after it and route the
    region's users there: ``x → bf16 → _linear_pointwise(prepacked bf16 W = attr, float32
    bias b, post-op) → float32``. The float32 nodes stay (unused) until the end-to-end check.
    Returns the inserted nodes."""
    node, last = nodes[0], nodes[-1]
    x = node.args[0]
    vb = b.meta.get("val") if isinstance(b, fx.Node) else None
    if vb is None and isinstance(b, fx.Node) and b.op == "get_attr":  # a folded bias (QKV merge's cat) has no meta
        vb = operator.attrgetter(b.target)(gm)
    split_bias = b is not None and not (isinstance(vb, torch.Tensor) and vb.dim() == 1)
    with gm.graph.inserting_after(last):
        xb = gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    with gm.graph.inserting_after(xb):
        yb = gm.graph.call_function(torch.ops.mkldnn._linear_pointwise.default,
                                    (xb, attr, None if split_bias else b, "none" if split_bias else post, [],
                                     "" if split_bias else algorithm))
    with gm.graph.inserting_after(yb):
        y = gm.graph.call_function(aten._to_copy.default, (yb,), {"dtype": torch.float32})
    chain = [xb, yb, y]
    if split_bias:  # a broadcast bias: added in float32 (then the GELU), as bf16_linear does
        with gm.graph.inserting_after(chain[-1]):
            chain.append(gm.graph.call_function(aten.add.Tensor, (chain[-1], b)))
        if post != "none":
            with gm.graph.inserting_after(chain[-1]):
                chain.append(gm.graph.call_function(aten.gelu.default, (chain[-1],), {"approximate": algorithm}))
    for c in chain:
        c.meta["opfuse_precision"] = "bf16"
    chain[-1].meta["val"] = last.meta.get("val")
    last.replace_all_uses_with(chain[-1], delete_user_cb=lambda u: u not in chain)
    return chain


def _restore(gm: fx.GraphModule, nodes: list[fx.Node], chain: list[fx.Node]) -> None:
    """Undo :func:`_lower`: the region's users read the float32 nodes again."""
    chain[-1].replace_all_uses_with(nodes[-1])
    for c in reversed(chain):
        gm.graph.erase_node(c)


#: Ops that only re-index their first argument (values and dtype unchanged): a cast
#: commutes with them.
VIEW_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
                      aten.alias.default, aten.unsqueeze.default, aten.squeeze.dim, aten.transpose.int,
                      aten.permute.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
                      aten.clone.default, aten.contiguous.default})


_SPLITS = frozenset({aten.split_with_sizes.default, aten.split.Tensor})


def _is_view(node) -> bool:
    """``node`` only re-indexes its first argument: a :data:`VIEW_OPS` op, a split, or one
    piece of a split (QKV merge's q, k, v)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and node.args[0].target in _SPLITS
    return node.target in VIEW_OPS or node.target in _SPLITS


def _is_cast(node, dtype: torch.dtype) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten._to_copy.default
            and len(node.args) == 1 and node.kwargs == {"dtype": dtype})


def elide_casts(gm: fx.GraphModule) -> int:
    """Remove the round trips of the bf16 regions: ``→bf16( views( →float32(t) ) )`` with
    ``t`` bfloat16 becomes ``views(t)`` (bfloat16 → float32 is exact and back again gives
    the same bits; the views only re-index). So the GELU region's bf16 output feeds the next
    GEMM directly and the float32 copy between them is never made. A cast whose result an
    op of the graph writes in place is left alone. Returns the number of casts removed."""
    removed = 0
    for node in list(gm.graph.nodes):
        if not _is_cast(node, torch.bfloat16) or any(
                u.op == "call_function" and isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable
                for u in node.users):
            continue
        views, src = _walk_views(node.args[0])
        if not _bf16_result(src):
            continue
        node.replace_all_uses_with(_views_of(gm, node, src.args[0], views))
        gm.graph.erase_node(node)
        removed += 1
    return removed  # the float32 casts left without users go with apply_precision's dead-code pass


def _bf16_result(cast) -> bool:
    """``cast`` is ``→float32(t)`` with ``t`` a bf16 region's bfloat16 result."""
    if not _is_cast(cast, torch.float32):
        return False
    t = cast.args[0]
    return isinstance(t, fx.Node) and t.meta.get("opfuse_precision") == "bf16" and t.target in (
        torch.ops.mkldnn._linear_pointwise.default, torch.ops.opfuse.attention_bf16.default)


def _views_of(gm: fx.GraphModule, before: fx.Node, value: fx.Node, views: list[fx.Node]) -> fx.Node:
    """``views`` (innermost last, as walked up from a use) replayed on ``value``, before ``before``."""
    with gm.graph.inserting_before(before):
        for v in reversed(views):
            value = gm.graph.call_function(v.target, (value, *v.args[1:]), dict(v.kwargs))
            value.meta["opfuse_precision"] = "bf16"
    return value


def attention_bf16_io(gm: fx.GraphModule) -> int:
    """Let opfuse.attention_bf16 read and write bfloat16: where q, k and v are each
    ``views(→float32(t))`` of a bf16 GEMM's result ``t``, the kernel reads ``views(t)``
    (it rounds q, k, v to bf16 first, and those casts are exact on bf16-valued tensors, so
    the result is bit for bit the same) and its bf16 output is cast to float32 once after
    it, for :func:`elide_casts` to remove where that only goes back to bf16 (the output
    projection's input). Saves, per layer, three float32 copies of q, k, v and one of the
    attention output. Returns the number of attention nodes changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.opfuse.attention_bf16.default:
            continue
        walks = [_walk_views(a) for a in node.args[:3]]
        if not all(_bf16_result(src) for _, src in walks):
            continue
        node.args = tuple(_views_of(gm, node, src.args[0], views) for views, src in walks) + tuple(node.args[3:])
        with gm.graph.inserting_after(node):
            y = gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float32})
        node.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)
        val = node.meta.get("val")
        y.meta["val"] = val
        if isinstance(val, torch.Tensor):
            node.meta["val"] = val.to(torch.bfloat16)
        node.meta["opfuse_precision"] = "bf16"
        changed += 1
    return changed


def direct_sdpa(gm: fx.GraphModule) -> int:
    """Call ATen's SDPA directly where opfuse.attention_bf16 runs its ATen form on bf16 q, k
    and v (after :func:`attention_bf16_io`): ``attention_bf16(q, k, v, mask, scale, causal,
    shift, aten=True)`` computes ``scaled_dot_product_attention(q, k, v, attn_mask=mask,
    scale=scale, is_causal=causal, enable_gqa=Hkv < H)`` on those same tensors (its casts are
    no-ops on bf16, a bool or float32 mask is passed as it is), so the result is bit for bit
    the same and the custom op's dispatch, Python launcher and argument checks (the plan's
    shapes and dtypes, fixed when it was made) are skipped: ~30 µs a call measured at
    1×12×128×64 on the Intel Xeon with AMX (236 vs 205 µs), per layer of the plan. A mask of
    another dtype, or an unknown one, keeps the op. Returns the number of nodes changed."""
    changed = 0
    for node in gm.graph.nodes:
        if not (node.op == "call_function" and node.target is torch.ops.opfuse.attention_bf16.default
                and len(node.args) == 8 and node.args[7] is True and not node.kwargs and "opfuse_gqa" in node.meta):
            continue
        srcs = [_producer(a) for a in node.args[:3]]  # views of bf16 GEMM results (attention_bf16_io)
        if not all(isinstance(p, fx.Node) and p.target is torch.ops.mkldnn._linear_pointwise.default
                   and p.meta.get("opfuse_precision") == "bf16" for p in srcs):
            continue
        mask = node.args[3]
        mv = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if mask is not None and not (isinstance(mv, torch.Tensor) and mv.dtype in (torch.bool, torch.float32)):
            continue
        q, k, v, _, scale, causal = node.args[:6]
        node.target = _SDPA
        node.args = (q, k, v)
        node.kwargs = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": bool(causal), "scale": float(scale),
                       "enable_gqa": bool(node.meta["opfuse_gqa"])}
        changed += 1
    return changed


def _skip_layernorm(ln: fx.Node) -> tuple | None:
    """``(c, r, w, b, eps)`` of a SkipLayerNorm over a bf16 GEMM's float32 copy ``c``:
    ``layer_norm(c + r)`` (ATen) or ``opfuse.add_layernorm(c, r, ...)`` (either operand
    order), with ``c`` only used there and ``r`` float32 of the sum's shape; None otherwise."""
    if ln.op != "call_function" or ln.kwargs:
        return None
    norm_shape = None
    if ln.target is aten.layer_norm.default:
        a = ln.args[0]
        if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.add.Tensor
                and len(a.args) == 2 and not a.kwargs and len(a.users) == 1) or len(ln.args) < 3:
            return None
        pair, norm_shape, w = a.args, ln.args[1], ln.args[2]
        b = ln.args[3] if len(ln.args) > 3 else None
        eps = ln.args[4] if len(ln.args) > 4 else 1e-5
    elif ln.target is torch.ops.opfuse.add_layernorm.default:
        a, pair, (w, b, eps) = ln, ln.args[:2], ln.args[2:5]
    else:
        return None
    pick = [(c, r) for c, r in ((pair[0], pair[1]), (pair[1], pair[0]))
            if _bf16_result(c) and len(c.users) == 1 and isinstance(r, fx.Node)]
    if not pick or w is None:
        return None
    c, r = pick[0]
    va, vr = a.meta.get("val"), r.meta.get("val")
    try:
        same = (isinstance(va, torch.Tensor) and isinstance(vr, torch.Tensor) and vr.dtype == torch.float32
                and va.dtype == torch.float32 and bool(tuple(va.shape) == tuple(vr.shape))
                and (norm_shape is None or list(norm_shape) == [va.shape[-1]]))
    except Exception:  # a symbolic shape the comparison cannot decide
        same = False
    return (c, r, w, b, eps) if same else None


def fuse_add_layernorm_bf16(gm: fx.GraphModule) -> list[tuple]:
    """The bf16 plan's SkipLayerNorm: ``layer_norm(→float32(t) + r)`` or
    ``opfuse.add_layernorm(→float32(t), r, ...)`` with ``t`` a bf16 GEMM's result and ``r``
    float32 of the same shape (:func:`_skip_layernorm`) becomes
    opfuse.add_layernorm_bf16(t, r, ...): its float32 output replaces the LayerNorm's, its
    bf16 output the ``→bf16`` casts of it (the next GEMM's input). Not exact (its own float32
    statistics: ~1e-7 from ATen's), so the caller checks the whole model again and
    :func:`_unfuse_add_layernorm_bf16` undoes it. The replaced nodes stay until then.
    Returns the undo records."""
    done = []
    for ln in list(gm.graph.nodes):
        found = _skip_layernorm(ln)
        if found is None:
            continue
        c, r, w, b, eps = found
        with gm.graph.inserting_before(ln):
            fused = gm.graph.call_function(torch.ops.opfuse.add_layernorm_bf16.default, (c.args[0], r, w, b, eps))
            y = gm.graph.call_function(operator.getitem, (fused, 0))
            yb = gm.graph.call_function(operator.getitem, (fused, 1))
        for n in (fused, y, yb):
            n.meta["opfuse_precision"] = "bf16"
        y.meta["val"] = ln.meta.get("val")
        ln.replace_all_uses_with(y)
        casts = [u for u in list(y.users) if _is_cast(u, torch.bfloat16)]
        for u in casts:
            u.replace_all_uses_with(yb)
        done.append((ln, fused, y, yb, casts))
    return done


#: Ops whose result is a fresh tensor of their own (never an input's storage): a residual
#: produced by one may be overwritten by :func:`inplace_add_layernorm_bf16` once nothing
#: reads it again; ``_FRESH_FIRST``: the same for the first result of a two-output op.
_FRESH = frozenset({aten.layer_norm.default, aten.add.Tensor, torch.ops.opfuse.add_layernorm.default})
_FRESH_FIRST = frozenset({torch.ops.opfuse.add_layernorm_bf16.default, torch.ops.opfuse.add_layernorm_sum.default})


def _fresh(node) -> bool:
    """``node``'s value is a tensor that the graph allocated for it alone (:data:`_FRESH`),
    not an input, a parameter or a view."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and node.args[1] == 0 and src.target in _FRESH_FIRST
    return node.target in _FRESH


def _may_alias(node: fx.Node) -> bool:
    """``node``'s result may share storage with an input: a view (an ATen schema whose return
    carries an alias annotation, a piece of a split) or any op this cannot tell."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        src = node.args[0]
        return not (isinstance(src, fx.Node) and src.op == "call_function" and not _may_alias(src))
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    return any(r.alias_info is not None for r in schema.returns)


def _read_after(value: fx.Node, at: fx.Node, order: dict) -> bool:
    """Something other than ``at`` reads ``value`` (or a view of it) at or after ``at`` in
    program order, or returns it."""
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        for u in v.users:
            if u is at or u in seen:
                continue
            seen.add(u)
            if u.op == "output" or order[u] > order[at]:
                return True
            if _may_alias(u):
                todo.append(u)
    return False


def inplace_add_layernorm_bf16(gm: fx.GraphModule) -> list[tuple]:
    """Run a bf16 plan's SkipLayerNorm in place where neither input is read again:
    ``y, yb = opfuse.add_layernorm_bf16(x, r, ...)`` becomes ``opfuse.add_layernorm_bf16_(x,
    r, ...)`` with ``y``'s readers reading ``r`` and ``yb``'s reading ``x``, when ``x`` is a
    bf16 GEMM's result read only there and ``r`` a tensor the graph allocated for itself
    (:func:`_fresh`: the previous SkipLayerNorm's float32 output, so the residual stream
    becomes one buffer) that nothing reads (directly or through a view) after the
    SkipLayerNorm, nor returns. Exact (the same kernel writes the same bits;
    :mod:`opfuse.kernels.cpu.add_layernorm_bf16`), and no op reads across the write. The
    replaced nodes stay (unused) for :func:`_undo_inplace`; returns its records."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = []
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is torch.ops.opfuse.add_layernorm_bf16.default):
            continue
        x, r = node.args[0], node.args[1]
        outs = list(node.users)
        if not (isinstance(x, fx.Node) and x.target is torch.ops.mkldnn._linear_pointwise.default
                and list(x.users) == [node] and _fresh(r) and not _read_after(r, node, order)
                and all(u.target is operator.getitem and u.args[1] in (0, 1) for u in outs)):
            continue
        with gm.graph.inserting_before(node):
            inplace = gm.graph.call_function(torch.ops.opfuse.add_layernorm_bf16_.default, node.args)
        inplace.meta["opfuse_precision"] = "bf16"
        order[inplace] = order[node]
        moves = []
        for u in outs:
            new = r if u.args[1] == 0 else x
            for reader in list(u.users):
                reader.replace_input_with(u, new)
                moves.append((reader, u, new))
        done.append((inplace, moves, [*outs, node]))
    return done


def _undo_inplace(gm: fx.GraphModule, done: list[tuple]) -> None:
    """Undo :func:`inplace_add_layernorm_bf16`: the readers read the functional op's results again."""
    for inplace, moves, _ in reversed(done):
        for reader, old, new in reversed(moves):
            reader.replace_input_with(new, old)
        gm.graph.erase_node(inplace)


def _unfuse_add_layernorm_bf16(gm: fx.GraphModule, done: list[tuple]) -> None:
    """Undo :func:`fuse_add_layernorm_bf16`: the LayerNorms and casts it replaced are used again."""
    for ln, fused, y, yb, casts in reversed(done):
        if casts:  # the casts compute the same value: their former users all read the first
            yb.replace_all_uses_with(casts[0])
        y.replace_all_uses_with(ln)
        for n in (yb, y, fused):
            gm.graph.erase_node(n)
