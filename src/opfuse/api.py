"""Public entry points: :func:`optimize` and :func:`explain`."""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import pipeline
from .graph.meta import tensor_values
from .report.data import FusionReport


class OptimizeError(ValueError):
    """Bad input to :func:`optimize`; the message names the problem."""


def _signature(args: tuple, kwargs: dict) -> tuple:
    """(shape, dtype, device, contiguity) of every tensor input, plus non-tensor values."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), v.dtype, v.device.type, v.is_contiguous())
        if isinstance(v, (list, tuple)):
            return tuple(one(x) for x in v)
        return ("V", repr(v))
    return (tuple(one(a) for a in args), tuple(sorted((k, one(v)) for k, v in kwargs.items())))


def _check_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if not isinstance(model, torch.nn.Module):
        raise OptimizeError(f"opfuse: expected a torch.nn.Module, got {type(model).__name__}")
    if model.training:
        raise OptimizeError("opfuse: the model is in training mode (dropout active); call model.eval() first "
                            "— opfuse fuses inference graphs only")
    if not isinstance(args, (tuple, list)):
        raise OptimizeError(f"opfuse: example_inputs must be a tuple of positional arguments, "
                            f"got {type(args).__name__}")


def _weight_slots(model: torch.nn.Module) -> list[tuple[dict, str]]:
    """(owner dict, name) of every parameter and buffer, so a check reads the current
    tensor even after ``load_state_dict(assign=True)`` replaced it."""
    slots = []
    for mod in model.modules():
        slots += [(mod._parameters, n) for n, p in mod._parameters.items() if p is not None]
        slots += [(mod._buffers, n) for n, b in mod._buffers.items() if b is not None]
    return slots


def _weights_version(model: torch.nn.Module, slots: list | None = None) -> tuple:
    """Storage and version counter of every parameter and buffer: changes on in-place
    updates, ``model.to(dtype)``, ``.data =`` and ``load_state_dict(assign=True)``."""
    def one(t):
        try:
            return t.data_ptr(), t._version
        except RuntimeError:  # inference-mode tensors have no version counter
            return t.data_ptr(), -1
    if slots is None:
        slots = _weight_slots(model)
    return tuple(one(owner[name]) for owner, name in slots)


def _share_folded(gm, others: list) -> None:
    """Make ``gm`` reuse an equal folded constant (concatenated QKV weights) of an earlier
    plan instead of keeping one copy per input signature."""
    if gm is None:
        return
    seen = {n: t for o in others if o is not None for n, t in o.named_buffers() if n.startswith("opfuse_folded_")}
    for name, t in list(gm.named_buffers()):
        same = seen.get(name)
        if same is not None and same.shape == t.shape and same.dtype == t.dtype and torch.equal(same, t):
            gm.register_buffer(name, same)


class FusedModule(torch.nn.Module):
    """A model rewritten by opfuse. Calling it runs the fused graph built for the call's
    input signature (shapes, dtypes, devices); a new signature is optimized on first use
    (torch.export specialises shapes), so other shapes are never run on a wrong plan.

    Attributes:
        report: :class:`FusionReport` of the first (example-input) plan.
        reports: one report per input signature seen.
    """

    def __init__(self, model: torch.nn.Module, options: dict, max_plans: int = 8):
        super().__init__()
        self._model = [model]  # list: do not register the original as a submodule
        self._options = options
        self._plans: OrderedDict = OrderedDict()
        self._max_plans = max_plans
        self.report: FusionReport | None = None

    @property
    def reports(self) -> list[FusionReport]:
        return [p.report for p in self._plans.values()]

    def plan_for(self, args: tuple, kwargs: dict):
        if getattr(self, "_slots", None) is None:
            self._slots = _weight_slots(self._model[0])  # module structure is fixed after optimize
        version = _weights_version(self._model[0], self._slots)
        if version != getattr(self, "_version", version):
            self._plans.clear()  # weights changed in place: folded copies (QKV concat) are stale
        self._version = version
        key = _signature(args, kwargs)
        plan = self._plans.get(key)
        if plan is None:
            plan = pipeline.run(self._model[0], args, kwargs, **self._options)
            _share_folded(plan.gm, [p.gm for p in self._plans.values()])
            self._plans[key] = plan
            if len(self._plans) > self._max_plans:
                self._plans.popitem(last=False)
            if self.report is None:
                self.report = plan.report
        return plan

    def forward(self, *args, **kwargs):
        plan = self.plan_for(args, kwargs)
        with torch.no_grad():
            return plan.gm(*args, **kwargs)


def optimize(model: torch.nn.Module, example_inputs: tuple, theta: float = 0.3, device=None,
             verify: bool = True, strict: bool = False, example_kwargs: dict | None = None,
             name: str | None = None, gemm: str | None = None) -> FusedModule:
    """Capture, match, cost, select, verify and rewrite ``model``.

    Args:
        model: an ``nn.Module`` in eval mode.
        example_inputs: tuple of positional example inputs (shapes/dtypes as in real calls).
        theta: saving-ratio threshold θ: a region fuses only if ρ = (M_orig − M_fused)/M_orig ≥ θ.
        device: a :class:`~opfuse.cost.device.DeviceProfile` (default: the inputs' device).
        verify: check each fused region against its unfused subgraph (failing regions revert).
        strict: raise :class:`~opfuse.verify.VerificationError` instead of reverting.
        example_kwargs: keyword example inputs (e.g. ``attention_mask``).
        gemm: GEMM backend mode (:func:`opfuse.gemm.apply_gemm_choices`): ``"auto"``
            (default, or ``OPFUSE_GEMM``) measures each float32 CPU GEMM shape once and
            keeps the fastest of eager's layout, a pre-transposed weight and oneDNN;
            ``"aten"`` keeps eager's GEMMs.
    Returns:
        :class:`FusedModule` whose outputs equal ``model(*inputs)`` within the dtype tolerance
        (:data:`opfuse.verify.TOLERANCE`); ``.report`` is the :class:`FusionReport`.
    Raises:
        OptimizeError: bad input (training mode, not a module, inputs not a tuple, unknown gemm mode).
        opfuse.graph.capture.CaptureError: torch.export failed.
    """
    kwargs = dict(example_kwargs or {})
    _check_inputs(model, example_inputs, kwargs)
    from .gemm import check_mode
    try:
        check_mode(gemm)
    except ValueError as exc:
        raise OptimizeError(str(exc)) from None
    fused = FusedModule(model, dict(theta=theta, device=device, verify=verify, strict=strict, name=name, gemm=gemm))
    fused.plan_for(tuple(example_inputs), kwargs)
    return fused


def explain(model: torch.nn.Module, example_inputs: tuple, theta: float = 0.3, device=None,
            example_kwargs: dict | None = None, name: str | None = None) -> FusionReport:
    """The :class:`FusionReport` of ``optimize`` without rewriting (nothing is fused or run
    except capture, matching and the cost model)."""
    kwargs = dict(example_kwargs or {})
    _check_inputs(model, example_inputs, kwargs)
    return pipeline.run(model, tuple(example_inputs), kwargs, theta=theta, device=device, verify=False,
                        rewrite_graph=False, name=name).report
