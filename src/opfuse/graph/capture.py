"""Capture a PyTorch model as an ATen FX graph with FakeTensor metadata.

Uses ``torch.export.export(..., strict=False)`` (the training-IR ATen graph:
``aten.linear``, ``aten.layer_norm``, ``aten.scaled_dot_product_attention`` are
not yet decomposed, see ../shared/design/MATCHING.md). Every tensor node carries
``node.meta["val"]``: a FakeTensor with shape, dtype and stride.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from .state import changed_python_state, copy_inputs, is_mutating, python_state


class CaptureError(RuntimeError):
    """Raised when torch.export cannot capture the model; the message names the cause."""


class PythonStateError(CaptureError):
    """The forward changes a plain Python attribute: no captured graph (whole or in dynamo's
    pieces, which would recompile for every new value) replays that; raised, never fused."""


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
            dynamic_shapes=None) -> fx.GraphModule:
    """Export ``model(*args, **kwargs)`` to an ATen ``fx.GraphModule``.

    Args:
        model: an ``nn.Module`` in eval mode (training mode is refused by the caller).
        args, kwargs: example inputs; their shapes are baked into the graph (export
            specialises view sizes), so other shapes need another capture — unless
        dynamic_shapes: torch.export's ``dynamic_shapes`` (:mod:`opfuse.graph.dynamic`):
            those dims become symbolic (SymInt) and the graph serves their whole range.
    Returns:
        ``ep.module()``: parameters and buffers are ``get_attr`` nodes (the model's own
        tensors, shared), the only placeholders are the user inputs. A forward that
        writes buffers or inputs in place is functionalised
        (``ep.run_decompositions({})``: every op keeps its ATen form, each write becomes
        a value plus one ``aten.copy_`` into the buffer or input at the end of the
        graph), so no fused op can read across a write, and the writes happen exactly
        once per call.
    Raises:
        CaptureError: when ``torch.export`` fails (unsupported Python control flow,
            data-dependent shapes...), with export's message.
    """
    register_cache_pytrees(model)
    try:
        ep = torch.export.export(model, tuple(args), dict(kwargs or {}), strict=False,
                                 dynamic_shapes=dynamic_shapes)
    except Exception as exc:  # export raises many types; name the stage and the cause
        raise CaptureError(f"opfuse: torch.export could not capture {type(model).__name__}: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    if any(is_mutating(n) for n in ep.graph.nodes):
        ep = ep.run_decompositions({})
    return ep.module()


def register_cache_pytrees(model: torch.nn.Module) -> bool:
    """Register Hugging Face's KV-cache classes (``DynamicCache``, ``StaticCache``...) as
    pytree nodes, as ``transformers``' own exporter does
    (``transformers.exporters.exporter_dynamo.register_cache_pytrees_for_model``), so
    ``torch.export`` captures a decoder with its default ``use_cache=True`` whole: the
    returned cache becomes its tensors and is rebuilt as the same class on the way out.
    Idempotent; False (nothing registered: such models are captured in dynamo's pieces)
    with a ``transformers`` that has no such helper or for a model that is not from it."""
    if not type(model).__module__.startswith("transformers."):
        return False
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:
        return False
    register_cache_pytrees_for_model(model)
    return True


def trace_function(fn: Any, example_args: tuple) -> fx.Graph:
    """Trace a plain torch function to the same ATen IR as :func:`capture` and return its
    graph; placeholders keep the function's argument names.

    Uses ``make_fx(pre_dispatch=True)`` on fake tensors — the tracer that non-strict
    ``torch.export`` runs underneath — which gives the same ops as ``torch.export`` minus
    its metadata assertions (dropped by canonicalisation anyway) at about half the cost.
    """
    import inspect

    from torch.fx.experimental.proxy_tensor import make_fx
    names = list(inspect.signature(fn).parameters)
    graph = make_fx(fn, pre_dispatch=True, tracing_mode="fake")(*example_args).graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        node.name = name
        node.target = name
    return graph


def check_python_state(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Run ``model`` once eagerly (on copies of the inputs; the caller restores buffers)
    and refuse it when its forward changes a plain Python attribute (``self.calls += 1``):
    torch.export restores such attributes after tracing and bakes their example value into
    the graph, so the captured program would silently differ from eager from the second
    call on.

    Raises:
        PythonStateError: naming every changed attribute (``path.attr: old -> new``); the
            attributes are set back to their old values first.
    """
    before = python_state(model)
    a, k = copy_inputs(args, kwargs)
    with torch.no_grad():
        model(*a, **k)
    changed = changed_python_state(model, before)
    if changed:
        raise PythonStateError(f"opfuse: the forward of {type(model).__name__} changes Python attributes "
                           f"({'; '.join(changed)}); a captured graph would freeze them at their example "
                           "values (keep such state in a registered buffer instead)")
