"""Dynamic shapes: one captured plan for every batch size and sequence length in a range.

The capture runs ``torch.export`` with :class:`torch.export.Dim` hints, so view sizes and
scales are symbolic (SymInt) in the graph and every fused op is shape-generic; the
pattern library matches the symbolic graph as it matches a static one (the ops are the
same). What depends on a size is decided at the example size (cost, measured times, GEMM
backend; :func:`opfuse.graph.meta.concrete`), and what must hold over the whole range is
checked over it: a legality check that had to assume a size (a symbolic size turned into
a Python bool or int that the range does not decide) is refused (:func:`size_assumptions`),
and verification runs at several sizes of the range (:func:`sample_inputs`).

Which dims are dynamic (``dynamic=True``, :func:`auto_shapes`): of every tensor input with
two or more dims, dim 0 is the batch; dim 1 is the sequence for integer or bool inputs
(token ids, attention masks, token types, positions) and for 3-D floating inputs
(``inputs_embeds``). The sequence range ends at the model's position limit
(``config.max_position_embeddings`` / ``n_positions``) where it has one. ``torch.export``
may narrow a range or keep a dim static (the model fixes it); :class:`DynamicSpec` is what
the capture actually made dynamic, read back from the graph's placeholders.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import fx

#: Largest batch of an automatic dynamic range (export needs no bound; the report shows one).
MAX_BATCH = 1024
#: Edges of a dynamic plan's token buckets (``optimize(dynamic=True, buckets=True)``;
#: tokens = batch × sequence of a call): a plan per bucket [1, 16], [17, 128], [129, ...],
#: each decided and GEMM-timed inside its own bucket (:func:`token_buckets`), kept where
#: measured faster. Why buckets: static BERT-base plans made at 16 and 384 tokens chose other
#: regions (QKV merge; linear+add+LayerNorm) and GEMM backends than the plan made at 128.
TOKEN_BUCKETS = (16, 128)


class DynamicShapeError(ValueError):
    """A call's shape is outside the dynamic plan's range (raised under ``strict``), or a
    ``dynamic_shapes`` argument torch.export cannot use; the message names the input and dim."""


def position_limit(config) -> int | None:
    """The longest sequence of a model ``config`` (``max_position_embeddings``,
    ``n_positions`` or ``max_seq_len``), or None."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _auto_dims(t: torch.Tensor) -> dict[int, str]:
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return {}
    dims = {0: "batch"}
    if not t.is_floating_point() or t.dim() == 3:
        dims[1] = "seq"
    return dims


def auto_shapes(model: torch.nn.Module, args: tuple, kwargs: dict):
    """``dynamic_shapes`` for ``torch.export.export`` by the module docstring's rule:
    ``Dim.AUTO`` with the batch in [1, MAX_BATCH] and the sequence in [1, position limit]
    (export infers which dims are equal and narrows or fixes what the model constrains).

    Returns:
        a tuple (one entry per positional argument) and a dict (per keyword argument) of
        ``{dim: Dim.AUTO(min, max)}`` or None, in torch.export's form."""
    from torch.export import Dim
    limit = position_limit(getattr(model, "config", None)) or 1 << 20
    bounds = {"batch": (1, MAX_BATCH), "seq": (1, limit)}

    def one(v):
        return {d: Dim.AUTO(min=bounds[k][0], max=bounds[k][1]) for d, k in _auto_dims(v).items()} or None
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def export_shapes(model: torch.nn.Module, shapes):
    """:func:`auto_shapes`' (positional tuple, keyword dict) as the dict by forward
    parameter name that ``torch.export.export`` takes; any other form (the user's own
    ``dynamic_shapes=``) unchanged."""
    if not (isinstance(shapes, tuple) and len(shapes) == 2 and isinstance(shapes[1], dict)):
        return shapes
    pos, kw = shapes
    sig = inspect.signature(model.forward)
    bound = sig.bind(*pos, **kw).arguments  # keyword extras land under the forward's **kwargs name
    varkw = {p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD}
    varpos = {p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_POSITIONAL}
    return {name: (dict(v) if name in varkw else list(v) if name in varpos else v) for name, v in bound.items()}


def widen(args: tuple, kwargs: dict, shapes) -> tuple[tuple, dict]:
    """The example inputs tiled so every dynamic dim is at least 2 (torch.export fixes a
    dim whose example size is 0 or 1: it cannot tell a broadcast from a batch of one).
    ``shapes``: :func:`auto_shapes`' (tuple, dict) form."""
    pos, kw = shapes

    def one(v, spec):
        if not spec or not isinstance(v, torch.Tensor):
            return v
        return resize(v, {d: max(2, v.shape[d]) for d in spec})
    return tuple(one(a, s) for a, s in zip(args, pos)), {k: one(v, kw.get(k)) for k, v in kwargs.items()}


def resize(t: torch.Tensor, sizes: dict[int, int]) -> torch.Tensor:
    """``t`` tiled (``repeat``) and cropped along ``sizes``' dims: real values of the example
    (token ids of the vocabulary, a mask's padding structure) at another size."""
    for d, n in sizes.items():
        if t.shape[d] == 0:
            raise DynamicShapeError(f"opfuse: cannot resize an empty dim {d} of a {list(t.shape)} input")
        reps = [1] * t.dim()
        reps[d] = -(-n // t.shape[d])
        t = t.repeat(reps).narrow(d, 0, n)
    return t.contiguous()


def _input(i, args: tuple, kwargs: dict):
    """Input ``i``: a positional index or a keyword name."""
    return args[i] if isinstance(i, int) else kwargs[i]


def _where(i) -> str:
    return f"arg{i}" if isinstance(i, int) else i


@dataclass(frozen=True)
class DynamicSpec:
    """The dims a capture made dynamic: ``dims`` ((input, dim, symbol), ...) with input a
    positional index (int) or a keyword name (str); ``ranges`` symbol -> (min, max)."""

    dims: tuple
    ranges: tuple  # ((symbol, lo, hi), ...)
    #: The tokens (:meth:`tokens_of`) of the calls this plan is meant for, (lo, hi) inclusive
    #: (one bucket of :func:`token_buckets`); None: every call of the ranges. Other calls
    #: inside the ranges still run correctly on it (a plan is verified over its ranges).
    tokens: tuple | None = None

    @property
    def wildcards(self) -> frozenset:
        return frozenset((i, d) for i, d, _ in self.dims)

    def range_of(self, symbol: str) -> tuple[int, int]:
        return next((lo, hi) for s, lo, hi in self.ranges if s == symbol)

    def describe(self) -> list[str]:
        """One line per dynamic dim: ``arg0 dim 1: s1 in [1, 512]``."""
        return [f"{_where(i)} dim {d}: {s} in [{self.range_of(s)[0]}, {self.range_of(s)[1]}]"
                for i, d, s in self.dims]

    def sizes(self, args: tuple, kwargs: dict) -> dict[str, int]:
        """{symbol: size} of the dynamic dims in these inputs (a symbol's first dim)."""
        out: dict[str, int] = {}
        for i, d, s in self.dims:
            out.setdefault(s, _input(i, args, kwargs).shape[d])
        return out

    def _positions(self) -> dict[str, int]:
        position: dict[str, int] = {}
        for _i, d, s in self.dims:
            position.setdefault(s, d)
        return position

    def tokens_of(self, args: tuple, kwargs: dict) -> int:
        """Tokens of a call: its batch (dim 0) times its sequence (dim 1) over the dynamic
        dims, the largest size where several symbols share a dim (ids and mask) — the rows
        of the model's GEMMs for a [batch, sequence] input; the batch alone where only
        dim 0 is dynamic (images)."""
        position, sizes = self._positions(), self.sizes(args, kwargs)
        per_dim: dict[int, int] = {}
        for s, n in sizes.items():
            if position[s] <= 1:
                per_dim[position[s]] = max(per_dim.get(position[s], 1), n)
        return math.prod(per_dim.values())

    def token_range(self) -> tuple[int, int]:
        """(fewest, most) tokens a call inside the ranges can have."""
        position, lo, hi = self._positions(), {}, {}
        for s, a, b in self.ranges:
            d = position.get(s)
            if d is not None and d <= 1:
                lo[d], hi[d] = max(lo.get(d, 1), a), min(hi.get(d, b), b)
        return (math.prod(lo.values()), math.prod(hi.values()))

    def sizes_for_tokens(self, example: dict[str, int], tokens: int) -> dict[str, int]:
        """``example`` ({symbol: size}) with the sequence symbols (dim 1; the batch, dim 0,
        when no sequence dim is dynamic) set so a call has about ``tokens`` tokens, within
        the ranges; the batch stays the example's."""
        position = self._positions()
        seq = [s for s in example if position[s] == 1] or [s for s in example if position[s] == 0]
        fixed = 1
        if any(position[s] == 1 for s in example):
            fixed = max([example[s] for s in example if position[s] == 0] or [1])
        want = max(1, -(-tokens // fixed))
        out = dict(example)
        for s in seq:
            lo, hi = self.range_of(s)
            out[s] = max(lo, min(hi, want))
        return out

    def resized(self, args: tuple, kwargs: dict, sizes: dict[str, int]) -> tuple[tuple, dict]:
        """The inputs with every dynamic dim at ``sizes`` ({symbol: size}; :func:`resize`)."""
        a, k = list(args), dict(kwargs)
        for i, d, s in self.dims:
            if isinstance(i, int):
                a[i] = resize(a[i], {d: sizes[s]})
            else:
                k[i] = resize(k[i], {d: sizes[s]})
        return tuple(a), k

    def out_of_range(self, args: tuple, kwargs: dict) -> str | None:
        """Why a call's sizes are outside the ranges, or differ between dims of one symbol
        (the sequence of ``input_ids`` and ``attention_mask``); None when inside."""
        seen: dict[str, tuple] = {}
        for i, d, s in self.dims:
            lo, hi = self.range_of(s)
            n = _input(i, args, kwargs).shape[d]
            where = _where(i)
            if s in seen and seen[s][0] != n:
                return (f"{where} dim {d} is {n} but {seen[s][1]} is {seen[s][0]}: the plan has one size {s} "
                        "for both")
            seen.setdefault(s, (n, f"{where} dim {d}"))
            if not lo <= n <= hi:
                return f"{where} dim {d} is {n}, outside the dynamic range [{lo}, {hi}] of {s}"
        return None


def spec_of(gm: fx.GraphModule, args: tuple, kwargs: dict, auto: bool = True) -> DynamicSpec | None:
    """Read back which input dims the capture made symbolic (placeholders in input order:
    the flattened positional then keyword inputs, as ``ep.module()`` takes them) and their
    value ranges; None when every dim stayed static. ``auto`` (:func:`auto_shapes`' ranges,
    which start at 1): a range export reports from 2 (its floor for a traced size) starts
    at 1, which :func:`sample_inputs` verifies; the user's own ranges are kept as export
    reports them."""
    from torch.utils._pytree import tree_flatten
    names = [*range(len(args)), *kwargs]
    flat = [*args, *kwargs.values()]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    leaves = []
    for name, value in zip(names, flat):
        sub, _ = tree_flatten(value)
        leaves += [(name, v) for v in sub]
    dims, ranges = [], {}
    for (name, value), node in zip(leaves, placeholders):
        fake = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(fake, torch.Tensor):
            continue
        for d, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt) and not isinstance(size.node.maybe_as_int(), int):
                expr = size.node.expr
                env = size.node.shape_env
                vr = env.var_to_range.get(expr)
                if vr is None:  # an expression of symbols: its bound from the shape env
                    vr = env.bound_sympy(expr)
                lo, hi = int(vr.lower), vr.upper
                lo = 1 if auto and lo == 2 else lo
                hi = int(hi) if hi.is_finite else MAX_BATCH * 1024
                dims.append((name, d, str(expr)))
                ranges[str(expr)] = (lo, hi)
    if not dims:
        return None
    return DynamicSpec(tuple(dims), tuple((s, lo, hi) for s, (lo, hi) in ranges.items()))


def sample_inputs(spec: DynamicSpec, args: tuple, kwargs: dict) -> list[tuple[dict, tuple, dict]]:
    """Inputs at other sizes of the range for verification, each ({symbol: size}, args,
    kwargs): every dynamic dim at its minimum (a batch of one, a one-token sequence; the
    largest minimum of the symbols at that dim position, so an ids/mask pair stays equal), and
    an odd size between (example + 13, capped at the maximum: not a power of two, not the
    example's block multiple; the batch, dim 0, one more than the example's). Sizes equal to
    the example's are skipped."""
    example, position = spec.sizes(args, kwargs), {}
    for _i, d, s in spec.dims:
        position.setdefault(s, d)
    # Symbols at the same dim position (the batch of ids and of the mask; their sequence
    # lengths) move together: export may keep them apart yet guard them equal at run time.
    lo = {d: max(spec.range_of(s)[0] for s in position if position[s] == d) for d in set(position.values())}
    hi = {d: min(spec.range_of(s)[1] for s in position if position[s] == d) for d in set(position.values())}
    choices = [{s: lo[position[s]] for s in example},
               {s: max(lo[position[s]], min(hi[position[s]], n + (1 if position[s] == 0 else 13)))
                for s, n in example.items()}]
    out = []
    for sizes in choices:
        if sizes == example or any(k == sizes for k, _, _ in out):
            continue
        a, k = spec.resized(args, kwargs, sizes)
        out.append((sizes, a, k))
    return out


def token_buckets(spec: DynamicSpec, edges: tuple = TOKEN_BUCKETS) -> list[tuple[int, int, int]]:
    """The token buckets of ``spec``'s range: (lo, hi, typical) for each bucket cut by
    ``edges`` (bucket *i* ends at ``edges[i]``) that overlaps :meth:`DynamicSpec.token_range`,
    clipped to it. ``typical``: where a plan for the bucket is decided when the example
    is not in it — the geometric mean of lo and hi, the last bucket at 3x its lo (its hi
    is the range's end, a size no request may have)."""
    first, last = spec.token_range()
    out, lo = [], 1
    for hi in [*sorted(e for e in edges if e >= 1), None]:
        a, b = max(lo, first), last if hi is None else min(hi, last)
        if a <= b:
            typical = min(b, 3 * a) if hi is None else round((a * b) ** 0.5)
            out.append((a, b, max(a, typical)))
        if hi is not None:
            lo = hi + 1
    return out


def bucket_of(spec: DynamicSpec, tokens: int, edges: tuple = TOKEN_BUCKETS) -> tuple[int, int] | None:
    """(lo, hi) of the bucket of :func:`token_buckets` holding ``tokens`` (None: outside)."""
    return next(((a, b) for a, b, _ in token_buckets(spec, edges) if a <= tokens <= b), None)


def shape_env_of(graph: fx.Graph):
    """The ShapeEnv of a dynamic capture's graph (None for a static one)."""
    for n in graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            for size in v.shape:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


@contextmanager
def size_assumptions(env):
    """Collect the size assumptions code makes inside the block: every symbolic size of
    ``env`` that is turned into a Python bool or int (``if x.shape[1] > 64``, ``int(n)``)
    whose value is not known for the whole range (``statically_known_true`` of it or its
    negation: the ranges and the capture's own guards). Guards are suppressed meanwhile, so
    one check's assumption is not taken as a fact by the next. Yields the list of the
    assumed expressions (empty for a static graph, ``env`` None)."""
    found: list[str] = []
    if env is None:
        yield found
        return
    from torch.fx.experimental.sym_node import SymNode
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    real = SymNode.evaluate

    def evaluate(self, *args, **kwargs):
        if self.shape_env is env and self.expr.free_symbols:
            known = self.is_bool() and (statically_known_true(torch.SymBool(self))
                                        or statically_known_true(torch.sym_not(torch.SymBool(self))))
            if not known:
                found.append(str(self.expr))
        return real(self, *args, **kwargs)
    SymNode.evaluate = evaluate
    try:
        with env.suppress_guards():
            yield found
    finally:
        SymNode.evaluate = real
