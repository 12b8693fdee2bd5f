"""The matching engine: pattern functions traced like the model, matched on the ATen
FX DAG by subgraph isomorphism, with a per-literal policy, commutative operands,
multi-root patterns and near-miss reasons.

A :class:`Pattern` row names a plain torch function; :func:`pattern_graph` exports it
with ``torch.export`` (exactly how models are captured) and canonicalises it. Literals
in the traced pattern (scale, eps, dims, view sizes, the GELU form) are compared by
their ATen schema argument name through the row's literal policy:

  REQUIRE  the model's literal must equal the pattern's (GELU ``approximate``, softmax ``dim``)
  IGNORE   any value (view ``size``: export bakes the example's sizes)
  "name"   bind: the model's value is captured under that name and handed to the kernel
           (``scale``, ``eps``) — never defaulted.

References: PyTorch Inductor ``pattern_matcher.py`` (traced patterns + extra checks),
TVM relax DPL (multi-root patterns); see ../shared/design/STYLE.md.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import fx

from ..graph.args import schema_args
from ..graph.canonicalize import canonicalize
from ..graph.capture import trace_function

aten = torch.ops.aten

REQUIRE = "require"
IGNORE = "ignore"

# Default literal policy by ATen schema argument name; a row's ``literals`` overrides it.
DEFAULT_LITERALS: Mapping[str, str] = {
    "size": IGNORE, "shape": IGNORE, "normalized_shape": IGNORE, "sym_size": IGNORE,
    "eps": "eps", "cudnn_enable": IGNORE, "memory_format": IGNORE,
}

COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}

# Targets that compute the same thing for matching purposes.
_EQUIVALENT = {
    aten.reshape.default: aten.view.default,
    aten._unsafe_view.default: aten.view.default,
    aten._softmax.default: aten.softmax.int,
}


def op_class(target):
    return _EQUIVALENT.get(target, target)


@dataclass(frozen=True, eq=False)
class Pattern:
    """One row of the pattern library.

    name:      pattern family reported to users (``attention``, ``add_layernorm``...)
    variant:   the spelling this row covers (``eager_mask``, ``sdpa``, ``erf``...)
    fn:        plain torch function; its arguments are the region's external inputs
    example:   zero-argument callable giving example tensors for tracing ``fn``
    build:     ``build(graph, inputs: dict[str, Node], literals: dict, params: dict) ->
               list[Node]`` emitting the fused replacement, one node per output (then
               one per emitted intermediate named in ``params["emit"]``)
    check:     legality on real shapes/values: ``check(match) -> str | None`` (reason)
    literals:  per-literal policy overrides, schema argument name -> REQUIRE/IGNORE/name
    emits:     pattern node names whose values the kernel can also write when they have
               consumers outside the region (e.g. the residual sum of add+LayerNorm)
    retarget:  the source already runs this region as one kernel (ATen SDPA): it is
               routed to opfuse's kernel for the backend, with no traffic saving claimed
    fused_cost: optional ``fused_cost(match, device) -> Cost`` when the fused kernel moves
               more than "external inputs once, outputs once" (FFN weight re-reads)
    decide_by: "rho" (the seed's rule ρ ≥ θ); "epilogue" for a GEMM with its epilogue
               (bias+GELU, +residual, +residual+LayerNorm): ρ ≥ θ with M counting the
               epilogue's traffic — the GEMM's x and W reads are the same fused or not and
               would make ρ depend on the weight size, not on the fusion (at batch 1 the
               weights are ~90% of the bytes); or "time" for horizontal merges whose ρ is
               bounded by construction (QKV merge: ρ ≤ 1/3 since only the shared input's
               re-reads are saved) and whose gain is launches and GEMM shape: fused when
               the roofline predicts a saving
    """

    name: str
    variant: str
    fn: Callable
    example: Callable[[], tuple]
    build: Callable
    check: Callable | None = None
    literals: Mapping[str, str] = field(default_factory=dict)
    emits: tuple[str, ...] = ()
    retarget: bool = False
    fused_cost: Callable | None = None
    decide_by: str = "rho"

    @property
    def key(self) -> str:
        return f"{self.name}/{self.variant}"

    def policy(self, argname: str, target=None) -> str:
        """Policy for literal ``argname`` of op ``target``: a row key ``"<op>.<arg>"``
        (e.g. ``"where.other"``) wins over a plain ``"<arg>"`` key, then the defaults."""
        op = getattr(target, "_opname", None)
        if op is not None and f"{op}.{argname}" in self.literals:
            return self.literals[f"{op}.{argname}"]
        return self.literals.get(argname, DEFAULT_LITERALS.get(argname, REQUIRE))


@dataclass
class Match:
    """A structural match of one pattern row in the model graph."""

    pattern: Pattern
    nodes: dict[fx.Node, fx.Node]          # pattern node -> graph node (compute nodes)
    inputs: dict[str, object]              # placeholder name -> graph node (or literal)
    literals: dict[str, object]            # bound literal name -> value
    outputs: list[fx.Node]                 # graph nodes producing the pattern outputs
    emitted: list[fx.Node] = field(default_factory=list)  # intermediates also written
    params: dict[str, object] = field(default_factory=dict)
    region: list[fx.Node] = field(default_factory=list)  # graph nodes in graph order

    @property
    def anchor(self) -> fx.Node:
        return self.outputs[0]


@dataclass(frozen=True)
class NearMiss:
    """A candidate that came close: which pattern, at which node, which check failed."""

    pattern: str
    variant: str
    node: str
    reason: str


@functools.lru_cache(maxsize=None)
def pattern_graph(pattern: Pattern) -> fx.Graph:
    """Trace and canonicalise ``pattern.fn`` (cached per row)."""
    graph = trace_function(pattern.fn, pattern.example())
    canonicalize(graph)
    return graph


class _Fail(Exception):
    def __init__(self, depth: int, node, reason: str):
        super().__init__(reason)
        self.depth, self.node, self.reason = depth, node, reason


class _State:
    __slots__ = ("nodes", "used", "inputs", "literals")

    def __init__(self):
        self.nodes: dict[fx.Node, fx.Node] = {}
        self.used: dict[fx.Node, fx.Node] = {}
        self.inputs: dict[str, object] = {}
        self.literals: dict[str, object] = {}

    def copy(self) -> "_State":
        s = _State()
        s.nodes, s.used = dict(self.nodes), dict(self.used)
        s.inputs, s.literals = dict(self.inputs), dict(self.literals)
        return s

    def restore(self, other: "_State") -> None:
        self.nodes, self.used, self.inputs, self.literals = other.nodes, other.used, other.inputs, other.literals


def _literal_equal(a, b) -> bool:
    """Equality of literals; floats agree to 1e-12 relative (``1/sqrt(2)`` spelled as
    ``x / math.sqrt(2)`` becomes ``x * 0.7071...`` after canonicalisation)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        try:
            fa, fb = float(a), float(b)
        except (TypeError, ValueError):
            return False
        return fa == fb or abs(fa - fb) <= 1e-12 * max(abs(fa), abs(fb))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_literal_equal(x, y) for x, y in zip(a, b))
    return a == b


class _Matcher:
    def __init__(self, pattern: Pattern):
        self.pattern = pattern

    def match_value(self, pv, gv, argname: str, state: _State, depth: int, at) -> None:
        if isinstance(pv, fx.Node):
            self.match_node(pv, gv, state, depth)
            return
        if isinstance(pv, (list, tuple)) and any(isinstance(x, fx.Node) for x in pv):
            if not isinstance(gv, (list, tuple)) or len(gv) != len(pv):
                raise _Fail(depth, at, f"argument '{argname}' has {gv!r}, pattern expects a list of {len(pv)}")
            for x, y in zip(pv, gv):
                self.match_value(x, y, argname, state, depth, at)
            return
        if isinstance(gv, fx.Node):
            raise _Fail(depth, at, f"argument '{argname}' is a computed tensor ({gv.name}), "
                                   f"pattern expects the constant {pv!r}")
        policy = self.pattern.policy(argname, getattr(at, "target", None))
        if policy == IGNORE:
            return
        if policy == REQUIRE:
            if not _literal_equal(pv, gv):
                raise _Fail(depth, at, f"argument '{argname}' is {gv!r}, this variant requires {pv!r}")
            return
        if policy in state.literals and not _literal_equal(state.literals[policy], gv):
            raise _Fail(depth, at, f"'{policy}' bound twice with different values "
                                   f"({state.literals[policy]!r} vs {gv!r})")
        state.literals[policy] = gv

    def match_node(self, pn: fx.Node, gn, state: _State, depth: int) -> None:
        if pn.op == "placeholder":
            if pn.name in state.inputs:
                if state.inputs[pn.name] is not gn:
                    raise _Fail(depth, gn, f"input '{pn.name}' must be the same tensor in both places "
                                           f"({state.inputs[pn.name]} vs {gn})")
                return
            if gn is not None and not isinstance(gn, fx.Node):
                raise _Fail(depth, None, f"input '{pn.name}' is the constant {gn!r}, pattern expects a tensor")
            state.inputs[pn.name] = gn
            return
        if not isinstance(gn, fx.Node):
            raise _Fail(depth, None, f"expected {pn.target} but found the constant {gn!r}")
        if pn in state.nodes:
            if state.nodes[pn] is not gn:
                raise _Fail(depth, gn, "shared sub-expression differs")
            return
        if gn.op != "call_function" or op_class(gn.target) != op_class(pn.target):
            got = gn.target if gn.op == "call_function" else gn.op
            raise _Fail(depth, gn, f"expected {_short(pn.target)} but found {_short(got)} at {gn.name}")
        if gn in state.used:
            raise _Fail(depth, gn, f"{gn.name} already used by another part of the pattern")
        state.nodes[pn] = gn
        state.used[gn] = pn
        pargs, gargs = schema_args(pn), schema_args(gn)
        orders = [gargs]
        if pn.target in COMMUTATIVE and len(gargs) >= 2:
            swapped = [(gargs[0][0], gargs[1][1]), (gargs[1][0], gargs[0][1])] + gargs[2:]
            orders.append(swapped)
        last: _Fail | None = None
        for order in orders:
            snapshot = state.copy()
            try:
                for (name, pv), (_, gv) in zip(pargs, order):
                    self.match_value(pv, gv, name, state, depth + 1, gn)
                return
            except _Fail as fail:
                state.restore(snapshot)
                if last is None or fail.depth > last.depth:
                    last = fail
        raise last  # type: ignore[misc]


def _short(target) -> str:
    s = str(target)
    return s.replace("aten.", "").replace(".default", "").replace(".Tensor", "").replace(".int", "")


def _outputs(graph: fx.Graph) -> list[fx.Node]:
    out = next(n for n in graph.nodes if n.op == "output")
    vals = out.args[0]
    return list(vals) if isinstance(vals, (list, tuple)) else [vals]


def _external_users(match_nodes: set[fx.Node], node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u not in match_nodes]


def find_matches(graph: fx.Graph, patterns: list[Pattern], min_depth: int = 3
                 ) -> tuple[list[Match], list[NearMiss]]:
    """All structural matches of ``patterns`` in ``graph`` and the near misses.

    A near miss is an anchor where at least ``min_depth`` pattern ops matched before a
    check failed, and no other variant of the same pattern matched there.
    """
    by_target: dict = defaultdict(list)
    order = {}
    for i, n in enumerate(graph.nodes):
        order[n] = i
        if n.op == "call_function":
            by_target[op_class(n.target)].append(n)
    matches: list[Match] = []
    misses: dict[tuple[str, fx.Node], tuple[int, NearMiss]] = {}
    matched_anchors: set[tuple[str, fx.Node]] = set()
    for pattern in patterns:
        pgraph = pattern_graph(pattern)
        roots = _outputs(pgraph)
        matcher = _Matcher(pattern)
        later_roots: set[fx.Node] = set()  # non-first roots of this row's matches: not anchors again
        for anchor in by_target.get(op_class(roots[0].target), []):
            if anchor in later_roots:
                continue
            state = _State()
            try:
                matcher.match_node(roots[0], anchor, state, 0)
                outs = [anchor] + _match_more_roots(matcher, roots[1:], state, order, anchor)
            except _Fail as fail:
                if fail.depth >= min_depth:
                    key = (pattern.name, anchor)
                    where = fail.node.name if isinstance(fail.node, fx.Node) else anchor.name
                    nm = NearMiss(pattern.name, pattern.variant, where,
                                  f"{pattern.name} ({pattern.variant}) anchored at {anchor.name}: {fail.reason}")
                    if key not in misses or misses[key][0] < fail.depth:
                        misses[key] = (fail.depth, nm)
                continue
            match = Match(pattern, dict(state.nodes), dict(state.inputs), dict(state.literals), outs,
                          region=sorted(set(state.nodes.values()), key=order.__getitem__))
            problem = _check_internal_users(match, pgraph)
            if problem is not None:
                key = (pattern.name, anchor)
                misses[key] = (10**6, NearMiss(pattern.name, pattern.variant, problem[0], problem[1]))
                continue
            matched_anchors.add((pattern.name, anchor))
            later_roots.update(outs[1:])
            matches.append(match)
    near = [nm for key, (_, nm) in misses.items() if key not in matched_anchors]
    return matches, near


def _distances_to(root: fx.Node) -> dict[str, int]:
    """Placeholder name -> fewest edges from that placeholder down to ``root`` in the
    pattern graph (placeholders that do not reach ``root`` are absent)."""
    dist: dict[fx.Node, int] = {root: 0}
    frontier = [root]
    while frontier:
        nxt = []
        for n in frontier:
            for i in n.all_input_nodes:
                if i not in dist:
                    dist[i] = dist[n] + 1
                    nxt.append(i)
        frontier = nxt
    return {n.name: d for n, d in dist.items() if n.op == "placeholder"}


def _downstream(start: fx.Node, depth: int) -> set[fx.Node]:
    """Graph nodes reachable from ``start`` through at most ``depth`` user edges."""
    seen: set[fx.Node] = set()
    frontier = {start}
    for _ in range(depth):
        frontier = {u for n in frontier for u in n.users} - seen
        seen |= frontier
    return seen


def _match_more_roots(matcher: _Matcher, roots: list[fx.Node], state: _State,
                      order: dict, first: fx.Node) -> list[fx.Node]:
    """Match the remaining roots of a multi-root pattern (Q, K and V projections sharing
    one input; q and k rotated with the same cos / sin). Candidates are the graph nodes
    that the inputs already bound reach in as many steps as the pattern takes from those
    inputs to the root (direct users for QKV; cos -> mul -> add for RoPE), in graph order
    after the previous root (so symmetric roots are found once, not per permutation)."""
    outs: list[fx.Node] = []
    prev = first
    for root in roots:
        dist = _distances_to(root)
        near = set()
        for name, node in state.inputs.items():
            if isinstance(node, fx.Node) and name in dist:
                near |= _downstream(node, dist[name])
        cands = sorted({u for u in near if u.op == "call_function" and op_class(u.target) == op_class(root.target)
                        and order[u] > order[prev] and u not in state.used}, key=order.__getitem__)
        found = None
        last: _Fail | None = None
        for cand in cands:
            snapshot = state.copy()
            try:
                matcher.match_node(root, cand, state, 1)
                found = cand
                break
            except _Fail as fail:
                state.restore(snapshot)
                last = fail if last is None or fail.depth > last.depth else last
        if found is None:
            raise last or _Fail(1, first, f"no second {_short(root.target)} sharing the same input")
        outs.append(found)
        prev = found
    return outs


def _check_internal_users(match: Match, pgraph: fx.Graph) -> tuple[str, str] | None:
    """Intermediates consumed outside the region must be emitted by the kernel (when
    the row allows it) or block the fusion."""
    region = set(match.nodes.values())
    outs = set(match.outputs)
    for pn, gn in match.nodes.items():
        if gn in outs:
            continue
        ext = _external_users(region, gn)
        if not ext:
            continue
        if pn.name in match.pattern.emits:
            match.emitted.append(gn)
            continue
        return gn.name, (f"{match.pattern.name} ({match.pattern.variant}) at {gn.name}: intermediate "
                         f"{_short(gn.target)} has {len(ext)} consumer(s) outside the pattern "
                         f"({', '.join(u.name for u in ext[:3])}); fusing would lose it")
    return None


def getitem(graph: fx.Graph, node: fx.Node, i: int) -> fx.Node:
    return graph.call_function(operator.getitem, (node, i))
