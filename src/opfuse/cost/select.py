"""Decide which candidate regions to fuse.

Rule: fuse when ρ ≥ θ AND the roofline predicts a time saving (the seed's criterion plus
the roofline check); regions whose source is already one kernel (``retarget`` rows, ATen
SDPA) are routed to opfuse's kernel without claiming a saving. Overlapping candidates
are resolved by total bytes saved (then ρ), not leftmost-first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .device import DeviceProfile
from .model import Cost, rho

MB = 1e6


@dataclass
class Candidate:
    """One matched region with its costs and decision.

    ``decision`` ∈ {"fused", "rejected", "reverted"}; ``reason`` says why in words.
    Times are roofline predictions in seconds.
    """

    match: object                 # patterns.engine.Match
    unfused: Cost = Cost()
    fused: Cost = Cost()
    time_unfused: float = 0.0
    time_fused: float = 0.0
    decision: str = "rejected"
    reason: str = ""
    verify_error: float | None = None
    legal: bool = True
    extra: dict = field(default_factory=dict)
    shared_bytes: int = 0         # bytes read identically fused and unfused (a GEMM's x and W), not in ρ

    @property
    def rho(self) -> float:
        return rho(self.unfused, self.fused, self.shared_bytes)

    @property
    def saved_bytes(self) -> int:
        return self.unfused.bytes - self.fused.bytes

    @property
    def nodes(self) -> set:
        return set(self.match.nodes.values())


def estimate(cand: Candidate, device: DeviceProfile, per_kernel: list[Cost]) -> None:
    """Fill the roofline times (s) of ``cand`` on ``device``: unfused, each kernel of
    ``per_kernel`` is bound by its own roofline; fused, one kernel. When the profile models
    cache bandwidth, the unfused kernels' reads and writes of region-internal intermediates
    that fit in cache (``device.cache_bytes``) are charged at cache bandwidth."""
    cached = _cached_intermediate_bytes(cand, device, len(per_kernel))
    cand.time_unfused = sum(device.time(c.flops, c.bytes, 1, cached_bytes=b) for c, b in zip(per_kernel, cached))
    cand.time_fused = device.time(cand.fused.flops, cand.fused.bytes, 1)


def _cached_intermediate_bytes(cand: Candidate, device: DeviceProfile, count: int) -> list[int]:
    """Per unfused (non-view) kernel of ``cand``: bytes of intermediates (produced and
    consumed inside the region, each ≤ ``device.cache_bytes``) it reads or writes; all
    zeros when the profile has no cache bandwidth or the kernels cannot be lined up."""
    region = getattr(cand.match, "region", None)
    if device.cache_bandwidth <= 0 or not region:
        return [0] * count
    from ..graph.meta import nbytes
    from .model import is_view
    nodes = [n for n in region if not is_view(n)]
    if len(nodes) != count:
        return [0] * count
    inside = set(region)
    outputs = set(cand.match.outputs) | set(getattr(cand.match, "emitted", ()))
    fits = lambda n: 0 < nbytes(n.meta.get("val")) <= device.cache_bytes  # noqa: E731
    out = []
    for n in nodes:
        read = sum(nbytes(i.meta.get("val")) for i in n.all_input_nodes if i in inside and fits(i))
        written = nbytes(n.meta.get("val")) if n not in outputs and fits(n) else 0
        out.append(read + written)
    return out


def select(cands: list[Candidate], theta: float) -> None:
    """Set ``decision``/``reason`` of every legal candidate in place."""
    passing = []
    for c in cands:
        if not c.legal:
            continue
        gain = c.time_unfused - c.time_fused
        if c.match.pattern.retarget:
            c.reason = "source already runs this as one ATen kernel: routed to opfuse's kernel (ρ=0, no saving claimed)"
            passing.append(c)
        elif c.match.pattern.decide_by == "time" and gain > 0:
            c.reason = (f"horizontal merge decided by time: {gain * 1e6:.1f} µs predicted "
                        f"(ρ={c.rho:.2f}, at most 1/3 for a shared-input merge)")
            passing.append(c)
        elif c.rho < theta:
            c.reason = (f"ρ={c.rho:.2f} < θ={theta:.2f}: saves {c.saved_bytes / MB:.2f} MB of "
                        f"{(c.unfused.bytes - c.shared_bytes) / MB:.2f} MB")
            if c.shared_bytes:
                c.reason += f" (epilogue traffic; GEMM operands {c.shared_bytes / MB:.2f} MB excluded)"
            if c.match.params.get("cost_note"):
                c.reason += f" ({c.match.params['cost_note']})"
        elif gain <= 0:
            c.reason = f"ρ={c.rho:.2f} ≥ θ but roofline predicts no gain ({gain * 1e6:+.1f} µs)"
        else:
            c.reason = f"ρ={c.rho:.2f} ≥ θ={theta:.2f}; saves {c.saved_bytes / MB:.2f} MB, {gain * 1e6:.1f} µs predicted"
            if c.shared_bytes:
                c.reason += f" (ρ over the epilogue's traffic; GEMM operands {c.shared_bytes / MB:.2f} MB excluded)"
            passing.append(c)
    passing.sort(key=lambda c: (-c.saved_bytes, -c.rho, c.match.anchor.name))
    taken: dict = {}
    for c in passing:
        clash = next((taken[n] for n in c.nodes if n in taken), None)
        if clash is None:
            c.decision = "fused"
            for n in c.nodes:
                taken[n] = c
        else:
            c.decision = "rejected"
            how = ("saves more" if clash.saved_bytes > c.saved_bytes else "saves as much with a higher ρ"
                   if clash.rho > c.rho else "saves as much and comes first")
            c.reason = (f"overlaps {clash.match.pattern.name} at {clash.match.anchor.name}, which {how} "
                        f"({clash.saved_bytes / MB:.2f} MB, ρ={clash.rho:.2f} vs {c.saved_bytes / MB:.2f} MB, "
                        f"ρ={c.rho:.2f})")
