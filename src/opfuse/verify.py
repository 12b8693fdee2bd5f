"""Verification: every fused region is run on the example inputs and compared with the
values its unfused subgraph produced; a region outside the dtype-aware tolerance is
reverted (left unfused) and the report says so with the error.

Tolerance (one place, per dtype): error = max|Δ| / max(1, max|ref|) (a relative error
for large values, absolute below 1); NaN/Inf must appear at the same positions.
"""

from __future__ import annotations

import torch
from torch import fx

from .kernels import ops as _ops  # noqa: F401

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float64: 1e-8}


class VerificationError(RuntimeError):
    """Raised under ``strict=True`` when a fused region fails verification."""


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, 1e-4)


def compare(out, ref) -> float:
    """Scaled max error between two tensors (see module docstring); ``inf`` when the
    NaN/Inf pattern differs or the shapes differ."""
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor) or out.shape != ref.shape:
        return float("inf")
    o, r = out.detach(), ref.detach()
    if o.numel() == 0:  # empty in, empty out: nothing to differ (shapes already equal)
        return 0.0
    if o.is_complex() or r.is_complex() or not (o.is_floating_point() and r.is_floating_point()):
        return 0.0 if torch.equal(o, r) else float("inf")
    ro, rr = torch.isfinite(o), torch.isfinite(r)
    if not (bool(ro.all()) and bool(rr.all())):  # rare path: compare the NaN/Inf pattern exactly
        if not torch.equal(torch.isnan(o), torch.isnan(r)) or not torch.equal(torch.isinf(o), torch.isinf(r)):
            return float("inf")
        inf = torch.isinf(r)
        if inf.any() and not torch.equal(o[inf], r[inf]):
            return float("inf")
        if not rr.any():
            return 0.0
        o, r = o[rr], r[rr]
    diff = (o.double() - r.double()).abs().max().item()
    return diff / max(1.0, r.abs().max().item())


def record_values(gm: fx.GraphModule, args: tuple, kwargs: dict) -> dict[fx.Node, object]:
    """Run ``gm`` once, keeping every node's value in program order (for per-region
    checks), on copies of the inputs; buffers are restored afterwards. Inputs and
    buffers that the program writes at its end (``copy_``
    destinations, see :func:`opfuse.graph.state.mutated_targets`) are recorded as copies
    taken before the write, so a region is checked against the values it reads."""
    env: dict[fx.Node, object] = {}
    from .graph.state import StateSnapshot, copy_inputs, write_backs
    written = set(write_backs(gm.graph))

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            env[n] = out.clone() if n in written and isinstance(out, torch.Tensor) else out
            return out

    snap = StateSnapshot.take(gm)  # the program may write buffers it shares with the model
    flat = gm.graph._codegen.process_inputs(*copy_inputs(args, kwargs))
    try:
        with torch.no_grad():
            _Recorder(gm).run(*flat)
    finally:
        snap.restore()
    return env


def fused_region_module(match, env: dict, fold: bool = False) -> tuple[fx.GraphModule, list]:
    """(module, feeds): ``match``'s fused replacement (its row's ``build``) as a standalone
    module, with the recorded values of its inputs. With ``fold``, inputs that are the
    model's parameters or buffers become constants of the module and constant expressions
    of them (the QKV weight concat) are folded once, as the rewrite folds them in the plan
    (what the time gate must measure: the plan runs no concat per call)."""
    graph = fx.Graph()
    inputs = {}
    feeds = []
    root = torch.nn.Module()
    for name, node in match.inputs.items():
        if isinstance(node, fx.Node) and fold and node.op == "get_attr":
            root.register_buffer(f"const_{name}", env[node])
            inputs[name] = graph.get_attr(f"const_{name}")
        elif isinstance(node, fx.Node):
            inputs[name] = graph.placeholder(name)
            feeds.append(env[node])
        else:
            inputs[name] = node
    from .patterns.common import vector_inputs
    inputs = vector_inputs(graph, inputs, match.params)
    outs = match.pattern.build(graph, inputs, match.literals, dict(match.params, emit=bool(match.emitted)))
    graph.output(tuple(outs))
    module = fx.GraphModule(root, graph)
    if fold:
        from .rewrite import fold_parameter_concats
        fold_parameter_concats(module)
        module.recompile()
    return module, feeds


def unfused_region_module(match, env: dict, fold: bool = False) -> tuple[fx.GraphModule, list]:
    """(module, feeds): ``match``'s original region nodes copied into a standalone module
    (external inputs become placeholders), with the recorded values of those inputs. With
    ``fold``, inputs that are the model's parameters or buffers become constants of the
    module (as :func:`fused_region_module` folds them), so a GEMM backend pass can treat
    its weights as the plan's."""
    graph = fx.Graph()
    root = torch.nn.Module()
    mapping: dict = {}
    inside = set(match.region)
    feeds = []
    for node in match.region:
        for inp in node.all_input_nodes:
            if inp not in inside and inp not in mapping:
                if fold and inp.op == "get_attr":
                    name = f"const_{len(root._buffers)}"
                    root.register_buffer(name, env[inp])
                    mapping[inp] = graph.get_attr(name)
                else:
                    mapping[inp] = graph.placeholder(f"in_{len(feeds)}")
                    feeds.append(env[inp])
    for node in match.region:
        mapping[node] = graph.node_copy(node, lambda n: mapping[n])
    graph.output(tuple(mapping[o] for o in list(match.outputs) + list(match.emitted)))
    return fx.GraphModule(root, graph), feeds


def run_region(cand, env: dict) -> list:
    """Evaluate ``cand``'s fused replacement on the recorded values of its inputs."""
    module, feeds = fused_region_module(cand.match, env)
    with torch.no_grad():
        return list(module(*feeds))


def run_region_float64(cand, env: dict) -> list:
    """Run ``cand``'s original (unfused) nodes with floating inputs upcast to float64: the
    independent reference when eager float32 itself is inaccurate (e.g. LayerNorm of rows
    with mean 1e3 and spread 1e-3)."""
    module, feeds = unfused_region_module(cand.match, env)
    feeds = [v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in feeds]
    with torch.no_grad():
        return list(module(*feeds))


def verify_regions(gm: fx.GraphModule, cands: list, args: tuple, kwargs: dict, strict: bool = False,
                   env: dict | None = None) -> None:
    """Check each candidate marked ``fused``; failing ones become ``reverted`` (or raise
    :class:`VerificationError` when ``strict``).

    A region passes when its fused result is within :func:`tolerance` of the unfused
    result, or — when they disagree — when the fused result is at least as close to a
    float64 run of the unfused subgraph as the unfused float32 result is (the fused kernel
    is then the more accurate one; ``verify_error`` records its float64 error). ``env``:
    values already recorded by :func:`record_values` (recorded here when None)."""
    chosen = [c for c in cands if c.decision == "fused"]
    if not chosen:
        return
    env = env if env is not None else record_values(gm, args, kwargs)
    for cand in chosen:
        refs = [env[n] for n in list(cand.match.outputs) + list(cand.match.emitted)]
        try:
            outs = run_region(cand, env)
            err = max(compare(o, r) for o, r in zip(outs, refs))
            tol = tolerance(refs[0].dtype)
            problem = None if err <= tol else f"max error {err:.3g} > tolerance {tol:g} for {refs[0].dtype}"
            if problem:
                exact = run_region_float64(cand, env)
                err_fused = max(compare(o, r) for o, r in zip(outs, exact))
                err_unfused = max(compare(o, r) for o, r in zip(refs, exact))
                if err_fused <= max(tol, err_unfused):
                    err, problem = err_fused, None
                else:
                    problem += (f" (vs float64: fused {err_fused:.3g}, unfused {err_unfused:.3g})")
        except Exception as exc:  # a kernel that raises on real inputs is a failed check
            err, problem = float("inf"), f"kernel raised {type(exc).__name__}: {exc}"
        cand.verify_error = err
        if problem:
            message = f"{cand.match.pattern.name} at {cand.match.anchor.name}: verification failed: {problem}"
            if strict:
                raise VerificationError(message)
            cand.decision, cand.reason = "reverted", message


def _run_on_copies(fn, model: torch.nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors of ``fn(*args, **kwargs)`` run on copies of the inputs, followed by those
    input copies and the model's buffers as the call left them (writes are results too);
    the model's buffers are then restored."""
    from torch.utils._pytree import tree_leaves

    from .graph.state import StateSnapshot, copy_inputs
    snap = StateSnapshot.take(model)
    a, k = copy_inputs(args, kwargs)
    try:
        with torch.no_grad():
            out = tree_leaves(fn(*a, **k))
        leaves = out + tree_leaves((a, k)) + list(model.buffers())
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves]
    finally:
        snap.restore()


def model_error(model: torch.nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict) -> float:
    """Max :func:`compare` error over every tensor output of the rewritten ``gm`` vs the
    eager ``model`` on the example inputs, including what each call writes into its inputs
    and buffers (both run on copies; the model's state is restored after each)."""
    ref = _run_on_copies(model, model, args, kwargs)
    out = _run_on_copies(gm, model, args, kwargs)
    if len(out) != len(ref):
        return float("inf")
    pairs = [(o, r) for o, r in zip(out, ref) if isinstance(r, torch.Tensor) and r.is_floating_point()]
    return max((compare(o, r) for o, r in pairs), default=0.0)
