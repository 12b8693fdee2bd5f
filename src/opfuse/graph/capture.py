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


class CaptureError(RuntimeError):
    """Raised when torch.export cannot capture the model; the message names the cause."""


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> fx.GraphModule:
    """Export ``model(*args, **kwargs)`` to an ATen ``fx.GraphModule``.

    Args:
        model: an ``nn.Module`` in eval mode (training mode is refused by the caller).
        args, kwargs: example inputs; their shapes are baked into the graph (export
            specialises view sizes), so other shapes need another capture.
    Returns:
        ``ep.module()``: parameters and buffers are ``get_attr`` nodes, the only
        placeholders are the user inputs.
    Raises:
        CaptureError: when ``torch.export`` fails (unsupported Python control flow,
            data-dependent shapes...), with export's message.
    """
    try:
        ep = torch.export.export(model, tuple(args), dict(kwargs or {}), strict=False)
    except Exception as exc:  # export raises many types; name the stage and the cause
        raise CaptureError(f"opfuse: torch.export could not capture {type(model).__name__}: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return ep.module()


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
