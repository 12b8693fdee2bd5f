"""The fusion report as plain data (JSON-serialisable through :meth:`FusionReport.to_dict`)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class RegionRecord:
    """One candidate region. Bytes in bytes, FLOPs in floating-point operations,
    intensity in FLOPs/byte (fused traffic), times in seconds (roofline prediction)."""

    pattern: str
    variant: str
    decision: str                 # "fused" | "rejected" | "reverted"
    reason: str
    nodes: list[str]
    anchor: str
    rho: float
    bytes_unfused: int
    bytes_fused: int
    flops: int
    intensity: float
    intensity_unfused: float
    time_unfused_s: float
    time_fused_s: float
    verify_error: float | None = None
    block: str = ""
    gate: str = ""                # what decided: legality | rho | roofline | overlap | time | verification
    measured_fused_s: float | None = None     # opfuse.timegate, on the example inputs
    measured_unfused_s: float | None = None


@dataclass
class FusionReport:
    """What opfuse matched, decided and verified for one model and input signature.

    ``totals`` are for the whole graph: ``bytes_unfused`` is the traffic of every ATen
    op run as its own kernel, ``bytes_fused`` the same after the fused regions' savings.
    """

    model: str
    inputs: list[str]
    dtype: str
    device: str
    theta: float
    regions: list[RegionRecord] = field(default_factory=list)
    near_misses: list[dict] = field(default_factory=list)
    graph_bytes: int = 0
    graph_flops: int = 0
    verified: bool = True
    max_error: float | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    ops_before: list[str] = field(default_factory=list)
    ops_after: list[str] = field(default_factory=list)
    version: str = ""
    respelled: dict[str, int] = field(default_factory=dict)  # hand-written spellings -> ATen op
    block_graph: dict = field(default_factory=dict)   # report.graph.graph_summary of one block
    gemm: list[dict] = field(default_factory=list)    # opfuse.gemm.GemmChoice per GEMM node (asdict)
    # how the model was captured: {"mode": "whole"}, or (opfuse.partial) {"mode": "pieces",
    # "reason": why torch.export refused the whole model, "pieces": n, "unfused": [why per piece]}
    capture: dict = field(default_factory=lambda: {"mode": "whole"})
    # a dynamic plan (opfuse.graph.dynamic): {"dims": ["arg0 dim 1: s1 in [1, 512]", ...],
    # "decided_at": {symbol: size}, "verified_at": [{symbol: size}, ...]}; empty when static
    dynamic: dict = field(default_factory=dict)
    inplace_writes: int = 0   # functionalised cache writes put back in place (rewrite.inplace_cache_writes)
    rope_cache_writes: int = 0  # RoPE + KV-cache writes fused into opfuse.rope_qk_cache (rewrite.rope_cache_writes)
    shared_masks: int = 0     # boolean attention masks made additive once for all layers (rewrite.shared_bool_masks)
    deduped_ops: int = 0      # repeated pure op calls merged after the rewrite (rewrite.dedupe_pure_ops)
    precision: dict = field(default_factory=dict)  # opfuse.precision.apply_precision (empty: float32 plan)

    @property
    def fused(self) -> list[RegionRecord]:
        return [r for r in self.regions if r.decision == "fused"]

    def counts(self) -> dict[str, int]:
        """Fused regions per pattern, e.g. ``{"attention": 6, "add_layernorm": 12}``."""
        return dict(Counter(r.pattern for r in self.fused))

    @property
    def totals(self) -> dict:
        saved = sum(r.bytes_unfused - r.bytes_fused for r in self.fused)
        return {
            "bytes_unfused": self.graph_bytes,
            "bytes_fused": self.graph_bytes - saved,
            "fused_regions": len(self.fused),
            "reduction": saved / self.graph_bytes if self.graph_bytes else 0.0,
            "flops": self.graph_flops,
            "per_pattern": self.counts(),
            "max_error": self.max_error,
        }

    def to_dict(self) -> dict:
        """JSON-serialisable dict with keys ``regions``, ``near_misses``, ``totals``, the
        header fields (model, inputs, dtype, device, theta, verified, timings_s), the GEMM
        backends, the capture, ``precision`` (:mod:`opfuse.precision`), ``shared_masks`` and ``deduped_ops``."""
        return {
            "model": self.model, "inputs": self.inputs, "dtype": self.dtype, "device": self.device,
            "theta": self.theta, "version": self.version, "verified": self.verified,
            "regions": [asdict(r) for r in self.regions],
            "near_misses": list(self.near_misses),
            "totals": self.totals,
            "timings_s": dict(self.timings_s),
            "ops_before": list(self.ops_before), "ops_after": list(self.ops_after),
            "respelled": dict(self.respelled),
            "gemm": list(self.gemm),
            "capture": dict(self.capture),
            "precision": dict(self.precision),
            "shared_masks": self.shared_masks,
            "deduped_ops": self.deduped_ops,
        }

    def to_json(self, path=None) -> str:
        text = json.dumps(self.to_dict(), indent=2, default=str)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text)
        return text

    def to_html(self, path, device=None) -> str:
        """Write a self-contained HTML page (block graph, region table, plots) to ``path``;
        ``device`` is the DeviceProfile of the roofline (default: the report's device)."""
        from .html import write_html
        return write_html(self, path, device=device)

    def __str__(self) -> str:
        from .text import render_text
        return render_text(self)
