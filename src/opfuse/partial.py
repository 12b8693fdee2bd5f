"""Partial capture: a model that ``torch.export`` cannot capture as a whole
(data-dependent control flow, a custom op without a fake implementation, ...) is captured
in pieces by dynamo, each piece fused by opfuse, the rest run eagerly.

::

    optimize ── capture (whole model) ── CaptureError ──► plan_in_pieces
                                                            │ torch.compile(model, backend=collect)
                                                            │ dynamo breaks the graph where it must
                                                            ▼
        piece 1 (FX graph) ─► CompiledGraph ─► opfuse.optimize (capture="whole") ─► fused
        eager code between pieces (the `if`, the op export cannot trace)  ─► runs as Python
        piece 2 ...       ─► CompiledGraph ─► a piece export also refuses ─► runs unfused

The plan's report merges the pieces' reports (regions named ``piece<i>:<anchor>``) and
says in ``report.capture`` why the whole model was not captured, how many pieces there
are, and which ran unfused and why. Dynamo guards the pieces (shapes, module identity,
Python values); each piece's FusedModule guards its weights.
"""

from __future__ import annotations

import torch

from .backend import CompiledGraph
from .graph.state import StateSnapshot, copy_inputs
from .report.data import FusionReport, RegionRecord


def plan_in_pieces(model: torch.nn.Module, args: tuple, kwargs: dict, reason: str, options: dict):
    """A :class:`opfuse.pipeline.Plan` whose callable is dynamo's compiled ``model`` with
    every piece optimized by opfuse; compiled (and each piece planned) now, on copies of
    the inputs, the model's state restored afterwards.

    Args:
        reason: why the whole-model capture failed (the CaptureError message).
        options: ``optimize``'s options (theta, device, verify, gemm, name).
    """
    from .pipeline import Plan
    from .verify import model_error
    pieces: list[CompiledGraph] = []
    piece_options = {k: v for k, v in options.items() if k in ("theta", "device", "verify", "gemm", "decide")}

    def collect(gm, example_inputs):
        compiled = CompiledGraph(gm, example_inputs, piece_options)
        pieces.append(compiled)
        return compiled

    compiled = torch.compile(model, backend=collect, dynamic=False)
    snapshot = StateSnapshot.take(model)
    try:
        a, k = copy_inputs(args, kwargs)
        with torch.no_grad():
            compiled(*a, **k)  # dynamo traces; each piece is planned on its first call
        snapshot.restore()
        error = model_error(model, compiled, args, kwargs) if options.get("verify", True) else None
    finally:
        snapshot.restore()
    report = merged_report(model, args, kwargs, pieces, reason, options)
    report.max_error = error
    return Plan(compiled, report, [], writes=frozenset(n for n, _ in model.named_buffers()))


def merged_report(model, args, kwargs, pieces: list[CompiledGraph], reason: str, options: dict) -> FusionReport:
    """One report for the pieces: their regions (anchors prefixed ``piece<i>:``), near
    misses, traffic, GEMM choices, and ``capture`` = {mode, reason, pieces, unfused}."""
    from .pipeline import report_header
    report = report_header(model, args, kwargs, options.get("theta", 0.3), options.get("name"))
    report.verified = bool(options.get("verify", True))
    unfused = []
    for i, piece in enumerate(pieces, 1):
        unfused += [f"piece {i}: {f.reason}" for f in piece.fallbacks]
        for sub in piece.reports:
            report.regions += [RegionRecord(**{**r.__dict__, "anchor": f"piece{i}:{r.anchor}",
                                               "nodes": [f"piece{i}:{n}" for n in r.nodes]}) for r in sub.regions]
            report.near_misses += [{**nm, "node": f"piece{i}:{nm['node']}"} for nm in sub.near_misses]
            report.graph_bytes += sub.graph_bytes
            report.graph_flops += sub.graph_flops
            report.gemm += sub.gemm
            report.inplace_writes += sub.inplace_writes
            report.rope_cache_writes += sub.rope_cache_writes
            for stage, seconds in sub.timings_s.items():
                report.timings_s[stage] = report.timings_s.get(stage, 0.0) + seconds
    report.capture = {"mode": "pieces", "reason": reason, "pieces": len(pieces), "unfused": unfused}
    return report
