"""Cost as an immutable value that adds (cf. tinygrad's ``Estimates``).

Traffic model (the seed's): unfused, every op reads its inputs and writes its outputs;
fused, the region's external inputs are read once and its external outputs written once.
Saving ratio ρ = (M_orig − M_fused) / M_orig; arithmetic intensity I = FLOPs / bytes
(Williams, Waterman, Patterson, "Roofline", CACM 2009).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..graph.meta import VIEW_OPS, nbytes, node_bytes, node_flops, reshape_copies


def tensor_bytes(t) -> int:
    """Bytes of a tensor (numel × element size); 0 for None."""
    return 0 if t is None else nbytes(t)


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes moved (read, written) by some work. Adds with ``+``."""

    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes_read + other.bytes_read,
                    self.bytes_written + other.bytes_written)

    @property
    def bytes(self) -> int:
        """Total memory traffic (bytes)."""
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """Arithmetic intensity I = FLOPs / byte (0 when no bytes move)."""
        return self.flops / self.bytes if self.bytes else 0.0


def node_cost(node: fx.Node) -> Cost:
    """Cost of ``node`` executed as its own kernel (views are free)."""
    read, written = node_bytes(node)
    return Cost(node_flops(node), read, written)


def graph_cost(graph: fx.Graph) -> Cost:
    """Unfused cost of every node of ``graph``."""
    return sum((node_cost(n) for n in graph.nodes), Cost())


def is_view(node: fx.Node) -> bool:
    """A view (no kernel, no traffic); a reshape that must copy is a kernel."""
    return node.op == "call_function" and (str(node.target) == "<built-in function getitem>"
                                           or node.target in VIEW_OPS and not reshape_copies(node))


def unfused_cost(region: list[fx.Node]) -> Cost:
    """Σ node costs over the region's nodes."""
    return sum((node_cost(n) for n in region), Cost())


def fused_cost(region: list[fx.Node], outputs: list[fx.Node]) -> Cost:
    """External tensor inputs read once, outputs written once, same FLOPs."""
    inside = set(region)
    external: dict[fx.Node, None] = {}
    for n in region:
        for i in n.all_input_nodes:
            if i not in inside:
                external[i] = None
    read = sum(nbytes(i.meta.get("val")) for i in external)
    written = sum(nbytes(o.meta.get("val")) for o in dict.fromkeys(outputs))
    return Cost(unfused_cost(region).flops, read, written)


def rho(unfused: Cost, fused: Cost, shared_bytes: int = 0) -> float:
    """ρ = (M_orig − M_fused) / M_orig (0 when nothing moves); ``shared_bytes`` (bytes moved
    identically fused or not, e.g. a GEMM's x and W under an epilogue) are left out of M."""
    base = unfused.bytes - shared_bytes
    return (unfused.bytes - fused.bytes) / base if base > 0 else 0.0
