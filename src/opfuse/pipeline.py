"""The opfuse pipeline: one short function of named passes, in processing order
(see ../shared/design/ARCHITECTURE.md)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import fx

from . import __version__
from .cost.device import DeviceProfile, profile_for
from .cost.model import fused_cost, graph_cost, is_view, node_cost, unfused_cost
from .cost.select import Candidate, estimate, select
from .graph.blocks import first_block, op_sequence
from .graph.canonicalize import canonicalize
from .graph.capture import CaptureError, capture, check_python_state
from .graph.dynamic import (DynamicSpec, auto_shapes, bucket_of, export_shapes, sample_inputs, shape_env_of,
                            size_assumptions, spec_of, widen)
from .graph.state import StateSnapshot, check_functional, copy_inputs, mutated_targets
from .gemm import apply_gemm_choices, direct_wt_matmuls
from .graph.meta import decided_at, nbytes, tensor_values
from .patterns import LIBRARY, SPELLINGS, Pattern, find_matches
from .report.data import FusionReport, RegionRecord
from .report.graph import graph_summary
from .precision import apply_precision
from .rewrite import (bind_op_builtins, dedupe_pure_ops, inplace_cache_writes, respell, rewrite, rope_cache_writes,
                      shared_bool_masks)
from .timegate import check_mode as check_decide
from .timegate import decide_by_time
from .verify import model_error, record_values, verify_regions


class DynamicCaptureError(CaptureError):
    """The dynamic capture does not equal the eager model over its range (see
    :func:`check_capture_at`); ``optimize(dynamic=True)`` then plans statically."""


@dataclass
class Plan:
    """The captured module (rewritten; for ``explain`` canonicalised but not rewritten),
    its report and the candidates, with what the runtime guards need: ``writes``, the
    buffers the program itself writes (never a reason to re-plan), and ``derived``, the
    model tensors a folded copy was made from (guarded by version or fingerprint)."""

    gm: fx.GraphModule
    report: FusionReport
    candidates: list[Candidate]
    writes: frozenset = frozenset()
    derived: frozenset = frozenset()
    dynamic: DynamicSpec | None = None
    dynamic_key: tuple | None = None  # the input signature with the dynamic dims left out


def legality(matches, graph: fx.Graph | None = None) -> list[Candidate]:
    """Run each row's extra check on real shapes/values, then the kernel's own argument
    check on the region's fake inputs (:func:`kernel_refusal`: dtypes of every operand,
    shapes, devices); illegal ones keep their reason. A ``graph`` that writes a tensor in
    place anywhere but in its trailing write-backs (capture functionalises, so this is a
    safety net) makes every candidate illegal: a fused op could read across the write.
    On a dynamic capture, a check that had to assume a size
    (:func:`opfuse.graph.dynamic.size_assumptions`) makes its candidate illegal: legality
    must hold over the whole range."""
    unsafe = check_functional(graph) if graph is not None else None
    env = shape_env_of(graph) if graph is not None else None
    cands = []
    for m in matches:
        problem = f"the graph is not functional: {unsafe}" if unsafe else None
        with size_assumptions(env) as assumed:
            problem = problem or (m.pattern.check(m) if m.pattern.check else None)
            problem = problem or kernel_refusal(m)
        if assumed and not problem:  # the check held at the example size only
            problem = ("legal at the example size only: the check assumed "
                       f"{'; '.join(assumed[:3])} of a dynamic dim (not true over the whole range)")
        cand = Candidate(m)
        if problem:
            cand.legal, cand.reason = False, f"illegal ({m.pattern.name} anchored at {m.anchor.name}): {problem}"
        cands.append(cand)
    return cands


def kernel_refusal(match) -> str | None:
    """The ``ValueError`` the fused replacement's kernels raise on this region's inputs, or
    None: the replacement runs once on the inputs' FakeTensors (``node.meta["val"]``), where
    each opfuse op's fake runs the launchers' argument check
    (:data:`opfuse.kernels.checks.OP_CHECKS`) — e.g. a bfloat16 branch added to a float32
    residual before a LayerNorm."""
    from torch._guards import detect_fake_mode

    from .verify import fused_region_module
    env = {n: n.meta.get("val") for n in match.inputs.values() if isinstance(n, fx.Node)}
    fake_mode = detect_fake_mode([v for v in env.values() if isinstance(v, torch.Tensor)])
    if fake_mode is None or any(v is None for v in env.values()):
        return None
    module, feeds = fused_region_module(match, env)
    try:
        with fake_mode, torch.no_grad():
            module(*feeds)
    except ValueError as exc:
        return f"the {match.pattern.name} kernel refuses these operands: {exc}"
    except Exception:  # anything else is not a refusal by argument check; verification runs it
        return None
    return None


def cost(cands: list[Candidate], device: DeviceProfile) -> None:
    """Unfused and fused Cost, ρ and roofline times of every candidate."""
    for c in cands:
        region = c.match.region
        c.unfused = unfused_cost(region)
        outs = list(c.match.outputs) + list(c.match.emitted)
        c.fused = c.match.pattern.fused_cost(c.match, device) if c.match.pattern.fused_cost \
            else fused_cost(region, outs)
        if c.match.pattern.retarget:
            c.fused = c.unfused
        if c.match.pattern.decide_by == "epilogue":  # the GEMM's x and W: read once, fused or not
            c.shared_bytes = sum(nbytes(n.args[i].meta.get("val")) for n in region
                                 if n.target is torch.ops.aten.linear.default for i in (0, 1))
        estimate(c, device, [node_cost(n) for n in region if not is_view(n)])


def run(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, theta: float = 0.3,
        device: DeviceProfile | None = None, verify: bool = True, strict: bool = False,
        rewrite_graph: bool = True, patterns: list[Pattern] | None = None, name: str | None = None,
        gemm: str | None = None, decide: str | None = None, dynamic=None, precision: str = "fp32",
        tolerance: float | None = None, buckets: tuple | None = None) -> Plan:
    """capture → canonicalize → match → legality → cost → select → time → verify → rewrite
    → GEMM backends → report (→ whole-model check when ``verify``).

    ``gemm``: GEMM backend mode of :func:`opfuse.gemm.apply_gemm_choices` (default
    ``OPFUSE_GEMM`` or ``"auto"``: measured per shape and cached). ``decide``: ``"time"``
    (default, or ``OPFUSE_DECIDE``) also requires each selected CPU region to be measured
    faster than its unfused ops (:mod:`opfuse.timegate`); ``"rho"``: the traffic gate alone.
    ``dynamic``: None (a static plan for the example shapes), True (batch and sequence dims
    symbolic, :func:`opfuse.graph.dynamic.auto_shapes`) or torch.export's own
    ``dynamic_shapes``; a dynamic plan is decided at the example size and verified there and
    at the range's other sizes (:func:`opfuse.graph.dynamic.sample_inputs`). ``buckets``
    (edges, :data:`opfuse.graph.dynamic.TOKEN_BUCKETS`): a dynamic plan is for the token
    bucket holding the example (``DynamicSpec.tokens``, the report's ``dynamic["tokens"]``)
    and its GEMM backends must win at the bucket's ends instead of the range's minimum;
    None: no bucket. ``precision``
    / ``tolerance``: GEMMs lowered to bf16 where measured error and time allow
    (:func:`opfuse.precision.apply_precision`, after the GEMM backends; ``"fp32"``: none).

    Raises:
        ValueError: unknown ``decide`` mode or ``precision``, bad ``tolerance``."""
    kwargs = dict(kwargs or {})
    snapshot = StateSnapshot.take(model)  # planning runs the forward: the model's state must not move
    args, kwargs = copy_inputs(args, kwargs)  # ... nor the caller's inputs
    try:
        check_python_state(model, args, kwargs)  # Python attributes written in forward: refused
        snapshot.restore()
        return _passes(model, args, kwargs, theta=theta, device=device, verify=verify, strict=strict,
                       rewrite_graph=rewrite_graph, patterns=patterns, name=name, gemm=gemm,
                       decide=check_decide(decide), dynamic=dynamic, precision=precision, tolerance=tolerance,
                       buckets=buckets)
    finally:
        snapshot.restore()


def _capture(model, args, kwargs, dynamic):
    """(gm, DynamicSpec or None): the static capture, or the dynamic one (examples widened
    so no dynamic dim is fixed at 1, :func:`opfuse.graph.dynamic.widen`)."""
    if dynamic is None or dynamic is False:
        return capture(model, args, kwargs), None
    if dynamic is True:
        shapes = auto_shapes(model, args, kwargs)
        gm = capture(model, *widen(args, kwargs, shapes), dynamic_shapes=export_shapes(model, shapes))
    else:
        gm = capture(model, args, kwargs, dynamic_shapes=dynamic)
    return gm, spec_of(gm, args, kwargs, auto=dynamic is True)


def _passes(model, args, kwargs, *, theta, device, verify, strict, rewrite_graph, patterns, name, gemm,
            decide, dynamic=None, precision="fp32", tolerance=None, buckets=None) -> Plan:
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal t0
        now = time.perf_counter()
        timings[stage] = now - t0
        t0 = now

    gm, spec = _capture(model, args, kwargs, dynamic);             lap("capture")
    bucket = bucket_of(spec, spec.tokens_of(args, kwargs), buckets) if spec is not None and buckets is not None \
        else None
    if bucket is not None:
        spec = replace(spec, tokens=bucket)
    with decided_at(spec.sizes(args, kwargs) if spec is not None else {}):  # a dynamic plan: decided at the example's sizes
        return _plan_captured(gm, spec, model, args, kwargs, lap, timings, theta=theta, device=device, verify=verify,
                              strict=strict, rewrite_graph=rewrite_graph, patterns=patterns, name=name, gemm=gemm,
                              decide=decide, precision=precision, tolerance=tolerance)


#: Tokens of the short call at which a dynamic plan's GEMM backends are timed too (besides
#: the example and the range's minimum): MKL's GEMMs of 4–16 rows measured 1.5–1.75x slower
#: than oneDNN's prepacked weight here (BERT-base), a size neither end shows.
SHORT_TOKENS = 16


def gemm_sizes(spec: DynamicSpec | None, args: tuple, kwargs: dict) -> list[dict] | None:
    """The other sizes ({symbol: size}) at which a dynamic plan's GEMM backends are timed
    too (:func:`opfuse.gemm.combine`): a bucket plan's bucket ends (``spec.tokens``; the
    upper end only when within 4x of the decided size: the last bucket runs to the range's
    end), else the range's minimum and, where the sequence is dynamic, a call of
    :data:`SHORT_TOKENS` tokens at the example's batch; None for a static plan."""
    if spec is None:
        return None
    example = spec.sizes(args, kwargs)
    if spec.tokens is None:
        out = [{sym: lo for sym, lo, _ in spec.ranges}]
        if any(d == 1 for _, d, _ in spec.dims):
            out.append(spec.sizes_for_tokens(example, SHORT_TOKENS))
        return out
    lo, hi = spec.tokens
    ends = [lo] + ([hi] if hi <= 4 * max(lo, spec.tokens_of(args, kwargs)) else [])
    return [spec.sizes_for_tokens(example, t) for t in ends]


def _plan_captured(gm, spec, model, args, kwargs, lap, timings, *, theta, device, verify, strict, rewrite_graph,
                   patterns, name, gemm, decide, precision="fp32", tolerance=None) -> Plan:
    """The passes after capture (see :func:`run`)."""
    canonicalize(gm);                                               lap("canonicalize")
    respelled = respell(gm, find_matches(gm.graph, SPELLINGS)[0]);  lap("respell")
    block = first_block(gm.graph)
    before = op_sequence(gm.graph, block)
    summary = graph_summary(gm.graph, block)                        # for the HTML report (plain data)
    whole = graph_cost(gm.graph)
    matches, near = find_matches(gm.graph, patterns or LIBRARY);   lap("match")
    cands = legality(matches, gm.graph)
    cost(cands, device or profile_for(_device_of(args, kwargs)));   lap("cost")
    select(cands, theta);                                           lap("select")
    env = record_values(gm, args, kwargs) if rewrite_graph and (verify or decide == "time") else None
    if rewrite_graph and decide == "time":
        decide_by_time(cands, env, theta, gemm=gemm);               lap("time")
    samples = sample_inputs(spec, args, kwargs) if spec is not None else []
    samples, guarded = check_capture_at(model, gm, samples)
    if verify and rewrite_graph:
        verify_regions(gm, cands, args, kwargs, strict=strict, env=env)
        for _sizes, a, k in samples:  # a dynamic plan: the range's other sizes too
            verify_regions(gm, cands, a, k, strict=strict)
        lap("verify")
    if rewrite_graph:
        rewrite(gm, cands);                                         lap("rewrite")
        masks = shared_bool_masks(gm);                              lap("masks")
        gemms = apply_gemm_choices(gm, gemm, also_at=gemm_sizes(spec, args, kwargs)); lap("gemm")
        lowp = apply_precision(gm, args, kwargs, precision, tolerance,
                               also=[(a, k) for _s, a, k in samples]); lap("precision")
        direct_wt_matmuls(gm);                                      lap("wt matmuls")
        in_place = inplace_cache_writes(gm);                        lap("in place")
        rope_writes = rope_cache_writes(gm);                        lap("rope+cache")
        deduped = dedupe_pure_ops(gm);                              lap("dedupe")
        bind_op_builtins(gm);                                       lap("bind ops")
    report = make_report(model, args, kwargs, theta, cands, near, whole, timings, name)
    report.verified = bool(verify)
    if not report.regions and not report.near_misses:  # say why nothing fused, not just "none"
        ops = sorted({str(n.target).replace("aten.", "").split(".")[0] for n in gm.graph.nodes if n.op == "call_function"})
        report.near_misses.append({"pattern": "*", "variant": "", "node": "", "reason": "no pattern of the library "
                                   f"matches any op sequence of this graph (ops: {', '.join(ops) or 'none'})"})
    report.respelled = respelled
    if rewrite_graph:
        report.gemm = [asdict(g) for g in gemms]
        report.inplace_writes = in_place
        report.rope_cache_writes = rope_writes
        report.deduped_ops = deduped
        report.shared_masks = masks
        report.precision = lowp
    if spec is not None:
        decided = spec.sizes(args, kwargs)
        report.dynamic = {"dims": spec.describe(), "decided_at": decided,
                          **({"tokens": list(spec.tokens)} if spec.tokens is not None else {}),
                          "verified_at": ([decided] + [s for s, _, _ in samples])
                          if verify and rewrite_graph else []}
        if guarded:
            report.dynamic["guarded"] = guarded
    if verify and rewrite_graph:
        report.max_error = max([model_error(model, gm, args, kwargs)]
                               + [model_error(model, gm, a, k) for _s, a, k in samples]); lap("check model")
    report.ops_before = before
    report.block_graph = summary
    if rewrite_graph:
        report.ops_after = op_sequence(gm.graph, block)
    else:  # explain: the planned sequence
        planned = {}
        for c in cands:
            if c.decision == "fused":
                tag = (c.match.pattern.name,)
                planned.update({n: tag for n in c.match.region})
        report.ops_after = op_sequence(gm.graph, block, planned)
    derived = frozenset(src for srcs in gm.meta.get("opfuse_derived", {}).values() for src in srcs)
    return Plan(gm, report, cands, writes=frozenset(mutated_targets(gm.graph)["buffers"]), derived=derived,
                dynamic=spec)


def check_capture_at(model, gm: fx.GraphModule, samples: list) -> tuple[list, list[str]]:
    """A dynamic capture (before any rewrite) must equal the eager model at the range's
    other sizes: torch.export traces at one size, and a program it specialised there (a
    branch on a size, a broadcast it took for a batch) is wrong elsewhere — then no dynamic
    plan. Bound: 10x the dtype tolerance of :func:`opfuse.verify.compare`'s scaled error. A
    size the capture's own input guards exclude ("Guard failed", e.g. Mistral's sequence
    length next to its sliding window) is dropped from the samples: calls there re-plan
    statically (:meth:`opfuse.FusedModule.forward`).

    Returns:
        (the samples the capture runs at, the guard messages of those it excludes).
    Raises:
        DynamicCaptureError: naming the size and the error (the caller plans statically)."""
    from .verify import tolerance
    kept, guarded = [], []
    for sizes, a, k in samples:
        try:
            err = model_error(model, gm, a, k)
        except AssertionError as exc:
            if not str(exc).startswith("Guard failed"):
                raise DynamicCaptureError(f"opfuse: the dynamic capture fails at sizes {sizes}: {exc}") from exc
            guarded.append(f"{sizes}: {exc}")
            continue
        except Exception as exc:  # the captured program does not run at this size
            raise DynamicCaptureError(f"opfuse: the dynamic capture fails at sizes {sizes}: "
                                      f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        bound = 10 * tolerance(torch.float32)
        if not err <= bound:
            raise DynamicCaptureError(f"opfuse: the dynamic capture differs from the eager model at sizes {sizes} "
                                      f"(error {err:.3g} > {bound:g}): torch.export specialised it at the example size")
        kept.append((sizes, a, k))
    return kept, guarded



def _device_of(args, kwargs) -> torch.device:
    for t in tensor_values(list(args) + list(kwargs.values())):
        return t.device
    return torch.device("cpu")


def _dtype_of(model: torch.nn.Module) -> str:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).replace("torch.", "")
    return "float32"


def _gate(c: Candidate) -> str:
    """Which gate decided ``c``: legality, rho (ρ < θ, or passed with no timing),
    roofline, overlap, time (measured), verification."""
    if c.decision == "reverted":
        return "verification"
    if c.reason.startswith("illegal"):
        return "legality"
    if c.reason.startswith("decided by time") or "measured" in c.extra and c.decision == "fused":
        return "time"
    if c.reason.startswith("overlaps"):
        return "overlap"
    if "roofline predicts no gain" in c.reason:
        return "roofline"
    return "rho"


def report_header(model, args, kwargs, theta, name) -> FusionReport:
    """An empty :class:`FusionReport` naming the model, its inputs (name:shape:dtype), dtype,
    device, θ and the opfuse version."""
    shapes = [f"{k}:{list(t.shape)}:{str(t.dtype).replace('torch.', '')}"
              for k, v in [*((f"arg{i}", a) for i, a in enumerate(args)), *kwargs.items()]
              for t in tensor_values(v)]
    return FusionReport(model=name or type(model).__name__, inputs=shapes, dtype=_dtype_of(model),
                        device=str(_device_of(args, kwargs)), theta=theta, version=__version__)


def make_report(model, args, kwargs, theta, cands, near, whole, timings, name) -> FusionReport:
    """Collect the pipeline's data into a :class:`FusionReport`."""
    from .graph.blocks import block_of
    report = report_header(model, args, kwargs, theta, name)
    report.graph_bytes, report.graph_flops, report.timings_s = whole.bytes, whole.flops, timings
    for c in cands:
        m = c.match
        report.regions.append(RegionRecord(
            pattern=m.pattern.name, variant=m.pattern.variant, decision=c.decision, reason=c.reason,
            nodes=[n.name for n in m.region], anchor=m.anchor.name, rho=round(c.rho, 6),
            bytes_unfused=c.unfused.bytes, bytes_fused=c.fused.bytes, flops=c.unfused.flops,
            intensity=round(c.fused.intensity, 4), intensity_unfused=round(c.unfused.intensity, 4),
            time_unfused_s=c.time_unfused, time_fused_s=c.time_fused, verify_error=c.verify_error,
            block=block_of(m.anchor) or "", gate=_gate(c),
            measured_fused_s=c.extra.get("measured", {}).get("fused_s"),
            measured_unfused_s=c.extra.get("measured", {}).get("unfused_s")))
    report.near_misses = [{"pattern": nm.pattern, "variant": nm.variant, "node": nm.node, "reason": nm.reason}
                          for nm in near]
    return report
