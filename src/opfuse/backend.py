"""``torch.compile(model, backend="opfuse")``: the pipeline on the graphs dynamo hands over.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so the
string ``"opfuse"`` works once the package is installed; :func:`opfuse_backend` can also
be passed directly (``torch.compile(model, backend=opfuse_backend)``).

::

    dynamo ── FX graph (torch level) + example inputs ──► opfuse_backend(gm, example_inputs)
                                                              │ returns a CompiledGraph (callable)
    first call with a new signature ─► bind parameters/buffers as attributes (so the QKV
        merge can pre-concatenate them) ─► opfuse.optimize (torch.export → ... → verify)
    any failure ─► gm.forward, with the reason recorded in ``CompiledGraph.fallbacks``

Each graph piece (one per graph break) is optimized on its own. Plans are cached per input
signature (shapes, dtypes, devices, contiguity) and per identity of every parameter/buffer
input (another module instance running the same graph gets its own plan); inside, the
:class:`~opfuse.FusedModule` guards versions (and fingerprints of inference-mode weights),
so a weight updated in place is re-planned rather than run on stale folded copies, while
a buffer the graph itself writes (a KV cache, a step counter) is not a reason to re-plan. Calls that need
autograd (grad mode on and an input that requires grad) and graphs traced in training
mode (dropout active) run ``gm.forward`` unchanged: opfuse's kernels are inference-only.
The backend never raises because of opfuse; it falls back and says why.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import fx

log = logging.getLogger(__name__)

#: The optimize options a dynamo graph's plan takes from the backend's options (and
#: ``fused.generate``'s prefill / decode plans from ``opfuse.optimize``'s).
PLAN_OPTIONS = ("theta", "device", "verify", "gemm", "decide", "precision", "tolerance")

#: Every graph compiled by the backend since the last :func:`reset` (for inspection and tests).
COMPILED: list["CompiledGraph"] = []


@dataclass
class Fallback:
    """One call signature that runs ``gm.forward`` unchanged, and why."""

    signature: str
    reason: str


class _Bound(torch.nn.Module):
    """Dynamo's graph with its parameter/buffer inputs bound as attributes, so that
    ``torch.export`` sees them as ``get_attr`` (constants of the graph) and only the user
    inputs stay placeholders."""

    def __init__(self, gm: fx.GraphModule, static: dict[int, torch.Tensor], n_inputs: int):
        super().__init__()
        self.gm = gm
        self._positions = sorted(static)
        self._n = n_inputs
        for i, t in static.items():
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(f"in{i}", t)
            else:
                self.register_buffer(f"in{i}", t)

    def forward(self, *user):
        full, it = [], iter(user)
        for i in range(self._n):
            full.append(getattr(self, f"in{i}") if i in self._positions else next(it))
        return self.gm(*full)


def _is_static(t) -> bool:
    return isinstance(t, torch.nn.Parameter) or (isinstance(t, torch.Tensor)
                                                 and hasattr(t, "_dynamo_static_input_type"))


def _training_dropout(gm: fx.GraphModule) -> str | None:
    """The first dropout node traced with ``training=True`` (model in training mode)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and "dropout" in getattr(n.target, "__name__", str(n.target)):
            flags = list(n.args[2:3]) + [v for k, v in n.kwargs.items() if k in ("training", "train")]
            if any(f is True for f in flags):
                return n.name
    return None


def _writes_in_place(gm: fx.GraphModule) -> bool:
    """Whether any FX node of ``gm`` may write in place: a trailing-underscore method or
    function (``add_``, ``index_copy_``), ``operator.setitem``, an ``out=`` argument or a
    mutable ATen schema."""
    import operator
    for n in gm.graph.nodes:
        if n.op not in ("call_method", "call_function"):
            continue
        if "out" in n.kwargs or n.target is operator.setitem:
            return True
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if isinstance(name, str) and name.endswith("_") and not name.endswith("__"):
            return True
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    return False


def _versions(args) -> tuple | None:
    """The version counter of every tensor argument (``None`` when one has none: an
    inference tensor). A rerun after a failed fused call is safe only when no counter moved:
    an in-place write (a KV cache's ``index_copy_``) applied twice is a wrong result."""
    try:
        return tuple(a._version for a in args if isinstance(a, torch.Tensor))
    except RuntimeError:  # inference tensors track no version
        return None


class CompiledGraph:
    """The callable the backend returns for one dynamo graph.

    Attributes:
        gm: dynamo's graph module (the fallback).
        plans: input key -> :class:`opfuse.FusedModule` (or ``None`` for a fallback key).
        fallbacks: every key that fell back, with the reason.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs, options: dict, max_plans: int = 8):
        self.gm = gm
        self.options = dict(options)
        self.static = [i for i, t in enumerate(example_inputs) if _is_static(t)]
        static = frozenset(self.static)  # a decode step: ~100 weights, 3 user inputs
        self._user = [i for i in range(len(example_inputs)) if i not in static]
        self.plans: OrderedDict = OrderedDict()
        self.fallbacks: list[Fallback] = []
        self.max_plans = max_plans
        self.calls = {"fused": 0, "fallback": 0}
        self.refusal = None
        self.mutates = _writes_in_place(gm)
        where = _training_dropout(gm)
        if where is not None:
            self.refusal = (f"graph traced in training mode (dropout {where} active); "
                            f"opfuse fuses inference graphs only")

    # -- what the user sees -----------------------------------------------------------
    @property
    def reports(self) -> list:
        return [r for fused in self.plans.values() if fused is not None for r in fused.reports]

    def __call__(self, *args):
        reason = self.refusal or self._needs_autograd(args)
        if reason is None:
            key = self._key(args)
            if key not in self.plans:
                self.plans[key] = self._optimize(key, args)
                if len(self.plans) > self.max_plans:
                    self.plans.popitem(last=False)
            fused = self.plans[key]
            if fused is not None:
                before = _versions(args) if self.mutates else ()
                try:
                    out = fused(*self._user_args(args))
                    self.calls["fused"] += 1
                    return out
                except Exception as exc:  # a kernel that fails at run time: never lose the call
                    self.plans[key] = None
                    self._record(key, f"fused graph raised {type(exc).__name__}: {exc}")
                    if self.mutates and (before is None or _versions(args) != before):
                        raise RuntimeError(
                            "opfuse backend: the fused graph raised after it may have written in "
                            f"place to its inputs ({type(exc).__name__}: {exc}); running the graph "
                            "unfused now would apply those writes twice. The plan is dropped: the "
                            "next call runs unfused") from exc
        elif not any(f.reason == reason for f in self.fallbacks):
            self._record(None, reason)
        self.calls["fallback"] += 1
        return self.gm(*args)

    # -- internals --------------------------------------------------------------------
    @staticmethod
    def _needs_autograd(args) -> str | None:
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return "grad mode is on and an input requires grad: opfuse kernels have no backward"
        return None

    def _key(self, args) -> tuple:
        from .graph.meta import input_signature
        static = tuple(id(args[i]) for i in self.static)  # versions: guarded by the FusedModule
        return input_signature(self._user_args(args), {}), static

    def _user_args(self, args) -> tuple:
        """The arguments that are not weights, by index (a membership test of every index in
        the static list cost ~110 µs a decode step of 103 arguments)."""
        return tuple(args[i] for i in self._user)

    def _optimize(self, key, args):
        from .api import optimize
        static = {i: args[i] for i in self.static}
        user = self._user_args(args)
        try:
            bound = _Bound(self.gm, static, len(args)).eval()
            return optimize(bound, user, name=self.options.get("name", "dynamo graph"), capture="whole",
                            **{k: v for k, v in self.options.items() if k in PLAN_OPTIONS})
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            self._record(key, f"opfuse.optimize failed: {type(exc).__name__}: {first}")
            return None

    def _record(self, key, reason: str) -> None:
        log.warning("opfuse backend: running the graph unfused: %s", reason)
        self.fallbacks.append(Fallback(str(key[0]) if key else "*", reason))


def opfuse_backend(gm: fx.GraphModule, example_inputs, **options) -> CompiledGraph:
    """torch.compile backend: returns a callable that optimizes ``gm`` on its first real
    call per input signature and falls back to ``gm.forward`` on any failure.

    Options (``torch.compile(..., options={...})`` where supported, or
    ``functools.partial(opfuse_backend, theta=...)``): ``theta``, ``device``, ``verify``, ``name``.
    """
    compiled = CompiledGraph(gm, example_inputs, options)
    COMPILED.append(compiled)
    return compiled


def reset() -> None:
    """Forget every compiled graph here and in dynamo (``torch._dynamo.reset()``)."""
    COMPILED.clear()
    torch._dynamo.reset()
