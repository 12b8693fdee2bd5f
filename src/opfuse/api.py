"""Public entry points: :func:`optimize` and :func:`explain`."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

from . import pipeline
from .graph.capture import CaptureError, PythonStateError
from .graph.dynamic import TOKEN_BUCKETS
from .graph.meta import input_signature
from .report.data import FusionReport


class OptimizeError(ValueError):
    """Bad input to :func:`optimize`; the message names the problem."""


def _check_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if not isinstance(model, torch.nn.Module):
        raise OptimizeError(f"opfuse: expected a torch.nn.Module, got {type(model).__name__}")
    if model.training:
        raise OptimizeError("opfuse: the model is in training mode (dropout active); call model.eval() first "
                            "— opfuse fuses inference graphs only")
    if not isinstance(args, (tuple, list)):
        raise OptimizeError(f"opfuse: example_inputs must be a tuple of positional arguments, "
                            f"got {type(args).__name__}")


# Global count of parameter / buffer / submodule registrations in this process (torch's
# module registration hooks fire on ``model.layer[0].attn = ...``, ``register_buffer``,
# ``load_state_dict(assign=True)`` ...): a FusedModule re-reads its model's structure only
# when this moved, so the per-call guard stays cheap.
_REGISTRATIONS = [0]


def _count_registration(*_args) -> None:
    if torch.compiler.is_compiling():  # a module built inside a traced forward (HF caches) is
        return  # no change of the model, and a counter dynamo sees would make it recompile every call
    _REGISTRATIONS[0] += 1


for _hook in ("register_module_module_registration_hook", "register_module_parameter_registration_hook",
              "register_module_buffer_registration_hook"):
    getattr(torch.nn.modules.module, _hook)(_count_registration)


def _weight_slots(model: torch.nn.Module) -> list[tuple[dict, str, str]]:
    """(owner dict, name, qualified name) of every parameter and buffer, so a check reads
    the current tensor even after ``load_state_dict(assign=True)`` replaced it."""
    slots = []
    for path, mod in model.named_modules(remove_duplicate=False):
        prefix = path + "." if path else ""
        slots += [(mod._parameters, n, prefix + n) for n, p in mod._parameters.items() if p is not None]
        slots += [(mod._buffers, n, prefix + n) for n, b in mod._buffers.items() if b is not None]
    return slots


def _structure(model: torch.nn.Module) -> tuple:
    """Identity of every submodule, parameter and buffer (a replaced submodule changes it)."""
    return tuple((path, id(mod), tuple(map(id, mod._parameters.values())), tuple(map(id, mod._buffers.values())))
                 for path, mod in model.named_modules(remove_duplicate=False))


def _has_version(t: torch.Tensor) -> bool:
    try:
        t._version
        return True
    except RuntimeError:  # inference-mode tensors have no version counter
        return False


def _weights_version(slots: list, live: frozenset = frozenset()) -> tuple:
    """Storage and version counter of every parameter and buffer: changes on in-place
    updates, ``model.to(dtype)``, ``.data =`` and ``load_state_dict(assign=True)``. A
    buffer in ``live`` (written by the program itself, e.g. a KV cache) counts by storage
    only: its writes are part of every call and never a reason to re-plan."""
    def one(t, fqn):
        if fqn in live or not _has_version(t):
            return t.data_ptr()
        return t.data_ptr(), t._version
    return tuple(one(owner[name], fqn) for owner, name, fqn in slots)


#: Elements sampled per tensor by :func:`_fingerprint`.
FINGERPRINT_SAMPLES = 4096


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``FINGERPRINT_SAMPLES`` evenly spaced elements of ``t``: the change detector for
    tensors without a version counter (created under ``torch.inference_mode()``) from
    which a folded copy was made. A dense in-place update (a merged LoRA delta, a new
    checkpoint copied in) changes it; an edit that leaves every sampled element equal is
    not seen (call :meth:`FusedModule.refresh` after one)."""
    flat = t.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)].clone()


#: Interleaved timed calls of a token-bucket plan and the first plan at the bucket's
#: typical size (:meth:`FusedModule._bucket_plans`), and the speed-up it must show to be kept.
BUCKET_ROUNDS = 5
BUCKET_MARGIN = 0.03


def _meta(gm, key: str) -> dict:
    """``gm.meta[key]``: ``"opfuse_derived"`` (folded buffer -> the model tensors' names it
    was made from) or ``"opfuse_folded_from"`` (folded buffer -> the identity of the tensor
    it copies: storage address, offset, shape, strides, dtype; :func:`opfuse.gemm._fold`);
    {} for a plan run in pieces (a dynamo module, no meta)."""
    meta = getattr(gm, "meta", None)
    return meta.get(key, {}) if isinstance(meta, dict) else {}


def _copy_kind(name: str, t: torch.Tensor) -> tuple:
    """(kind, shape, dtype) of folded buffer ``name`` (``opfuse_folded_<kind>_...``)."""
    return name.split("_")[2], tuple(t.shape), t.dtype


def _equal_packed(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two oneDNN (mkldnn) tensors hold the same values (compared as dense tensors: the
    blocked layouts may differ); False where one cannot be read back."""
    try:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.to_dense(), b.to_dense())
    except RuntimeError:
        return False


def share_folded_copies(gm, others: list) -> int:
    """Make ``gm`` reuse a folded copy another plan made of the same weight (merged QKV,
    pre-transposed, prepacked), whatever the two graphs call it, instead of holding one copy
    per plan: plans of other input signatures or token buckets, and the generation plans
    (dynamo graphs) reading the copies the forward plan made through torch.export (Llama: 62
    of the decode plan's 127 MB). A plain copy matches one of the same kind (the buffer
    name's ``opfuse_folded_<kind>_``), shape and dtype that is equal (``torch.equal``),
    tried first where it copies the same model tensor (the identity :func:`opfuse.gemm._fold`
    records). A oneDNN prepacked weight (opaque: no ``torch.equal``) matches one of the same
    name, shape and source tensors (``opfuse_derived``), or of the same kind, shape and dtype
    made of the same tensors at the same versions under other names (``opfuse_derived_ids``:
    a dynamo graph's ``in6`` is the model's ``…q_proj.weight``; Llama bf16: the prefill
    plan's 44 MB of prepacked bf16 weights are the forward plan's), and in either case only
    where the values read back dense are equal (:func:`_equal_packed`: a square W and Wᵀ
    have the same sources and shape): the same weight, perhaps blocked for another row
    count, which any row count runs on (:func:`opfuse.gemm.pack`). Returns the bytes no
    longer held twice."""
    by_source, by_shape, packed, packed_of = {}, {}, {}, {}
    for o in others:
        if o is None or o is gm:
            continue
        for n, t in o.named_buffers():
            if not n.startswith("opfuse_folded_"):
                continue
            if t.is_mkldnn:
                packed.setdefault(n, (t, _meta(o, "opfuse_derived").get(n)))
                ids = _meta(o, "opfuse_derived_ids").get(n)
                if ids is not None:  # the same model tensors under another graph's names
                    packed_of.setdefault((_copy_kind(n, t), ids), t)
                continue
            kind = _copy_kind(n, t)
            src = _meta(o, "opfuse_folded_from").get(n)
            if src is not None:
                by_source.setdefault((kind, src), t)
            same_shape = by_shape.setdefault(kind, [])
            if all(c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for c in same_shape):
                same_shape.append(t)
    saved = 0
    for n, t in list(gm.named_buffers()) if gm is not None else []:
        if not n.startswith("opfuse_folded_"):
            continue
        if t.is_mkldnn:  # opaque: shared only where the values read back dense are equal
            key = (_copy_kind(n, t), _meta(gm, "opfuse_derived_ids").get(n))
            candidates = [packed_of[key]] if key in packed_of else []
            by_name, made_of = packed.get(n, (None, None))
            if by_name is not None and made_of and _meta(gm, "opfuse_derived").get(n) == made_of:
                candidates.append(by_name)  # a name is no identity across dynamo graphs (`in11` of the
            for same in candidates:         # prefill graph can be another weight than the decode's)
                if same is not t and _equal_packed(same, t):
                    gm.register_buffer(n, same)
                    saved += t.numel() * t.element_size()
                    break
            continue
        kind, src = _copy_kind(n, t), _meta(gm, "opfuse_folded_from").get(n)
        candidates = ([by_source[(kind, src)]] if (kind, src) in by_source else []) + by_shape.get(kind, [])
        for same in candidates:
            if same.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() and torch.equal(same, t):
                gm.register_buffer(n, same)
                saved += t.untyped_storage().nbytes()
                break
    return saved


def _describe(args: tuple, kwargs: dict) -> str:
    from .graph.meta import tensor_values
    return ", ".join(f"{list(t.shape)}:{str(t.dtype).replace('torch.', '')}"
                     for t in tensor_values(list(args) + list(kwargs.values())))


def _plan_inputs(plan) -> str:
    if plan.dynamic is not None:
        return "dynamic " + ", ".join(plan.dynamic.describe())
    return ", ".join(plan.report.inputs)


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
        self._aliases: dict = {}  # exact input signature -> the dynamic plan serving it
        self._max_plans = max_plans
        self.report: FusionReport | None = None
        self.replans: list[str] = []  # why plans were dropped and rebuilt, in order
        self._live: frozenset = frozenset()  # buffers the program writes (never guarded by version)
        self._derived: frozenset = frozenset()  # tensors a folded copy was made from

    @property
    def reports(self) -> list[FusionReport]:
        return [p.report for p in self._plans.values()]

    def refresh(self, reason: str = "refresh() called") -> None:
        """Drop every plan: the next call re-plans on the model as it is now."""
        if self._plans:
            self.replans.append(reason)
        self._plans.clear()
        self._aliases.clear()

    # -- guards: the model a plan was built from is still the model being called --------
    def _arm_guards(self) -> None:
        model = self._model[0]
        if model is None:  # loaded (opfuse.load): no model whose changes to guard
            return
        self._registrations = _REGISTRATIONS[0]
        self._structure = _structure(model)
        self._slots = _weight_slots(model)
        self._version = _weights_version(self._slots, self._live)
        self._fingerprints = [(owner, name, fqn, _fingerprint(owner[name])) for owner, name, fqn in self._slots
                              if fqn in self._derived and not _has_version(owner[name])]

    def _stale(self) -> str | None:
        """Why the plans no longer describe the model (None while they do)."""
        model = self._model[0]
        if model is None:
            return None
        if self._registrations != _REGISTRATIONS[0]:
            self._registrations = _REGISTRATIONS[0]
            if _structure(model) != self._structure:
                return "a submodule, parameter or buffer of the model was replaced"
        if _weights_version(self._slots, self._live) != self._version:
            return "a parameter or buffer changed (in place, .data, dtype or device)"
        for owner, name, fqn, fp in self._fingerprints:
            if not torch.equal(_fingerprint(owner[name]), fp):
                return f"inference-mode tensor {fqn} (folded into the plan) changed"
        return None

    def _dynamic_plan(self, args: tuple, kwargs: dict, key: tuple):
        """A dynamic plan whose key (sizes of its dynamic dims left out) and ranges hold this
        call, remembered under the call's exact key (bounded); None when there is none. A call
        of a dynamic plan's key outside its ranges re-plans statically with a warning
        (:class:`~opfuse.graph.dynamic.DynamicShapeError` under ``strict``)."""
        holding, outside = [], None
        for plan in list(self._plans.values()):
            spec = plan.dynamic
            if spec is None or input_signature(args, kwargs, spec.wildcards) != plan.dynamic_key:
                continue
            why = spec.out_of_range(args, kwargs)
            if why is None:
                holding.append(plan)
            else:
                outside = outside or why
        if holding:  # every one is correct here; the one planned for this call's token bucket is faster
            tokens = holding[0].dynamic.tokens_of(args, kwargs)
            plan = next((p for p in holding if p.dynamic.tokens is not None
                         and p.dynamic.tokens[0] <= tokens <= p.dynamic.tokens[1]), holding[0])
            if len(self._aliases) >= 4 * self._max_plans:
                self._aliases.pop(next(iter(self._aliases)))
            self._aliases[key] = plan
            return plan
        if outside is not None:
            if self._options.get("strict"):
                from .graph.dynamic import DynamicShapeError
                raise DynamicShapeError(f"opfuse: {outside} (strict=True: no re-plan)")
            warnings.warn(f"opfuse: {outside}: planning this shape statically (one re-plan)", stacklevel=4)
            self.replans.append(outside)
            return self._add_plan(key, self._plan(args, kwargs, dynamic=None))
        return None

    def _bucket_plans(self, args: tuple, kwargs: dict, first) -> None:
        """After the first dynamic plan (``first``, decided at the example as without
        buckets; it serves the example's token bucket and every call no other plan is kept
        for): one plan per other bucket of :func:`opfuse.graph.dynamic.token_buckets`,
        planned on the example resized to the bucket's typical tokens (its GEMM backends
        must win at the bucket's ends: :func:`opfuse.pipeline.gemm_sizes`), then timed there
        against ``first``
        (:data:`BUCKET_ROUNDS` interleaved calls each): kept only when at least
        :data:`BUCKET_MARGIN` faster, so no bucket is slower than the one plan. Every
        bucket's measurement and decision goes to ``first.report.dynamic["buckets"]``. A
        bucket whose capture is not dynamic is skipped (its calls run ``first``)."""
        from dataclasses import replace

        from .bench.timing import interleaved
        from .graph.dynamic import bucket_of, token_buckets
        spec, edges = first.dynamic, self._options.get("buckets")
        if spec is None or not edges:
            return
        own = bucket_of(spec, spec.tokens_of(args, kwargs), edges)
        if own is None:
            return
        spec = first.dynamic = replace(spec, tokens=own)
        first.report.dynamic["tokens"] = list(own)
        options = dict(self._plan_options(), buckets=edges)  # the pipeline decides these in their bucket
        example, rows = spec.sizes(args, kwargs), []
        for lo, hi, typical in token_buckets(spec, edges):
            if (lo, hi) == tuple(spec.tokens):
                continue
            a, k = spec.resized(args, kwargs, spec.sizes_for_tokens(example, typical))
            row = {"tokens": [lo, hi], "decided_at": spec.sizes(a, k)}
            rows.append(row)
            if not lo <= spec.tokens_of(a, k) <= hi:
                row.update(kept=False, reason="the example's batch alone has more tokens")
                continue
            try:
                plan = self._run(a, k, self._options.get("dynamic"), options)
            except CaptureError as exc:
                row.update(kept=False, reason=f"no dynamic capture at this size: {str(exc).splitlines()[0]}")
                continue
            if plan.dynamic is None or plan.dynamic.tokens is None \
                    or input_signature(a, k, plan.dynamic.wildcards) != first.dynamic_key:
                row.update(kept=False, reason="no dynamic capture of the same inputs at this size")
                continue
            plan.dynamic_key = first.dynamic_key
            try:
                with torch.no_grad():
                    t = interleaved({"bucket": lambda: plan.gm(*a, **k), "first": lambda: first.gm(*a, **k)},
                                    repeat=BUCKET_ROUNDS, warmup=1)
            except AssertionError as exc:  # the first capture's guards exclude this size
                row.update(kept=False, reason=f"not comparable at this size: {str(exc).splitlines()[0]}")
                continue
            gain = t["first"]["median_s"] / t["bucket"]["median_s"]
            keep = gain >= 1 + BUCKET_MARGIN
            row.update(kept=keep, bucket_s=t["bucket"]["median_s"], first_s=t["first"]["median_s"],
                       reason=f"{gain:.2f}x the first plan's speed at {row['decided_at']} "
                              f"({'kept' if keep else 'dropped'}: {BUCKET_MARGIN:.0%} needed)",
                       fused=plan.report.counts())
            if keep:
                self._add_plan(input_signature(a, k), plan)
        first.report.dynamic["buckets"] = [{"tokens": list(spec.tokens), "kept": True, "reason": "the example's"},
                                           *rows]

    def _add_plan(self, key: tuple, plan):
        share_folded_copies(plan.gm, [p.gm for p in self._plans.values()])
        self._plans[key] = plan
        if len(self._plans) > self._max_plans:
            self._plans.popitem(last=False)
        if self.report is None:
            self.report = plan.report
        self._live = self._live | plan.writes
        self._derived = self._derived | plan.derived
        self._arm_guards()  # after planning: versions as planning left them
        return plan

    def plan_for(self, args: tuple, kwargs: dict):
        if self._plans:
            reason = self._stale()
            if reason:
                self.refresh(reason)
        key = input_signature(args, kwargs)
        plan = self._plans.get(key) or self._aliases.get(key)
        if plan is None and self._plans:
            plan = self._dynamic_plan(args, kwargs, key)
        if plan is None:
            plan = self._plan(args, kwargs, dynamic=self._options.get("dynamic"))
            if plan.dynamic is not None:
                plan.dynamic_key = input_signature(args, kwargs, plan.dynamic.wildcards)
            self._add_plan(key, plan)
            self._bucket_plans(args, kwargs, plan)
        return plan

    def _plan_options(self) -> dict:
        """The options :func:`opfuse.pipeline.run` takes (``optimize``'s, less those this
        module handles: capture, dynamic, plan cache, token buckets)."""
        return {k: v for k, v in self._options.items() if k not in ("capture", "dynamic", "plan_cache", "buckets")}

    def _plan(self, args: tuple, kwargs: dict, dynamic=None):
        """The whole model captured and planned; where torch.export cannot capture it as a
        whole (and ``capture="auto"`` without ``strict``), dynamo's pieces, each planned
        (:func:`opfuse.partial.plan_in_pieces`), with the reason in ``report.capture``. A
        ``dynamic`` capture that torch.export refuses falls back to a static plan of these
        shapes, with the reason in ``report.dynamic["refused"]`` (raised under ``strict``)."""
        if self._model[0] is None:
            from .persist import LoadError
            raise LoadError("opfuse: this module was loaded (opfuse.load) and has no plan for inputs "
                            f"{_describe(args, kwargs)}: saved plans cover "
                            + "; ".join(_plan_inputs(p) for p in self._plans.values())
                            + " — optimize the model for these inputs and save again")
        options = self._plan_options()
        if dynamic is not None and dynamic is not False:
            try:
                return self._run(args, kwargs, dynamic, options)
            except CaptureError as exc:
                if options.get("strict") or isinstance(exc, PythonStateError):
                    raise
                plan = self._plan(args, kwargs, dynamic=None)
                plan.report.dynamic = {"refused": f"dynamic capture failed, static plan of these shapes: {exc}"}
                return plan
        try:
            return self._run(args, kwargs, None, options)
        except CaptureError as exc:
            if self._options.get("capture", "auto") != "auto" or options.get("strict") \
                    or isinstance(exc, PythonStateError):
                raise
            from .partial import plan_in_pieces
            return plan_in_pieces(self._model[0], args, kwargs, str(exc), options)

    def _run(self, args: tuple, kwargs: dict, dynamic, options: dict):
        """:func:`opfuse.pipeline.run`, or with ``plan_cache`` the stored plan of the same
        job (:func:`opfuse.persist.plan_key`: code, config, every weight's bytes, inputs,
        options, machine) — no capture, matching or verification — and a new plan stored
        there. ``report.capture["plan_cache"]`` says which happened."""
        model = self._model[0]
        cache = self._options.get("plan_cache")

        def planned():
            return pipeline.run(model, args, kwargs, dynamic=dynamic, **options)
        if not cache:
            return planned()
        from pathlib import Path

        from .persist import LoadError, SaveError, default_cache_dir, plan_key, read_plans, write_plans
        root = default_cache_dir() if cache is True else Path(cache)
        try:
            where = root / plan_key(model, args, kwargs, dict(options, dynamic=dynamic))
        except SaveError as exc:
            plan = planned()
            plan.report.capture = dict(plan.report.capture, plan_cache=f"not cached: {exc}")
            return plan
        note = ""
        if (where / "manifest.json").is_file():
            try:
                (_, plan), = read_plans(where, model, warn_cpu=False)
                capture = {k: v for k, v in plan.report.capture.items() if k not in ("loaded_from", "plan_cache")}
                plan.report.capture = dict(capture, plan_cache=f"reused {where} (no capture, matching or verification)")
                return plan
            except (LoadError, ValueError) as exc:
                note = f"the stored plan was unusable ({exc}); "
        plan = planned()
        try:
            write_plans([(input_signature(args, kwargs), plan)], where)
            plan.report.capture = dict(plan.report.capture, plan_cache=f"{note}planned and stored in {where}")
        except SaveError as exc:
            plan.report.capture = dict(plan.report.capture, plan_cache=f"{note}planned, not stored: {exc}")
        return plan

    @property
    def generation(self):
        """:class:`opfuse.generate.Generation` of this module (its prefill/decode plans,
        static-cache pool and the latest call's step timings); created on first use."""
        if self._model[0] is None:
            from .persist import LoadError
            raise LoadError("opfuse: a loaded module (opfuse.load) holds forward plans only; generate needs "
                            "opfuse.optimize of the model")
        if getattr(self, "_generation", None) is None:
            from .generate import Generation
            self._generation = Generation(self._model[0], self._options,
                                          forward_gms=lambda: [p.gm for p in self._plans.values()])
        return self._generation

    def generate(self, input_ids: torch.Tensor, **kwargs):
        """Hugging Face ``generate`` (same arguments and results: greedy, sampling,
        ``max_new_tokens``, ``min_new_tokens``, eos/pad, ``attention_mask`` with left padding)
        over a fused prefill graph and a fused decode-step graph with a preallocated KV cache
        written in place (:mod:`opfuse.generate`).

        Args:
            input_ids: [batch, prompt] int64 token ids.
        Returns:
            what the model's ``generate`` returns (a [batch, prompt + new] tensor by default).
        Raises:
            opfuse.generate.GenerateError: the model has no LM head, beam search, a cache
                that is not a big enough StaticCache, a length beyond the model's positions,
                or the model's modules changed during the call (a callback replaced a
                submodule, attribute or parameter; the next call re-plans). Changes between
                calls re-plan the generation graphs (:func:`opfuse.generate.module_fingerprint`).
        """
        return self.generation.generate(input_ids, **kwargs)

    def forward(self, *args, **kwargs):
        plan = self.plan_for(args, kwargs)
        with torch.no_grad():
            if plan.dynamic is None:
                return plan.gm(*args, **kwargs)
            try:
                return plan.gm(*args, **kwargs)
            except AssertionError as exc:  # the capture's input guards run first: nothing ran yet
                if not str(exc).startswith("Guard failed"):
                    raise
                return self._guarded(args, kwargs, exc)(*args, **kwargs)

    def _guarded(self, args: tuple, kwargs: dict, exc: AssertionError):
        """A call inside a dynamic plan's ranges that its capture's own guards exclude (a size
        torch.export saw as a special case): the static plan of this signature, planned once
        with a warning (:class:`~opfuse.graph.dynamic.DynamicShapeError` under ``strict`` or
        for a loaded module)."""
        from .graph.dynamic import DynamicShapeError
        if self._options.get("strict") or self._model[0] is None:
            raise DynamicShapeError(f"opfuse: the dynamic plan's capture excludes these inputs ({exc})") from None
        warnings.warn(f"opfuse: the dynamic plan's capture excludes these inputs ({exc}): planning this shape "
                      "statically (one re-plan)", stacklevel=3)
        self.replans.append(str(exc))
        key = input_signature(args, kwargs)
        self._aliases.pop(key, None)
        return self._add_plan(key, self._plan(args, kwargs, dynamic=None)).gm


def optimize(model: torch.nn.Module, example_inputs: tuple, theta: float = 0.3, device=None,
             verify: bool = True, strict: bool = False, example_kwargs: dict | None = None,
             name: str | None = None, gemm: str | None = None, capture: str = "auto",
             decide: str | None = None, dynamic: bool = False, dynamic_shapes=None,
             plan_cache=False, precision: str = "fp32", tolerance: float | None = None,
             buckets=None) -> FusedModule:
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
            keeps the fastest of eager's layout, a pre-transposed weight, oneDNN (on the
            weight as it is or prepacked) and, at ≤ 8 rows, opfuse's GEMV; ``"lean"`` the
            same among the backends that keep no weight copy (what ``generate``'s prefill
            graph uses); ``"aten"`` keeps eager's GEMMs; a backend name forces it.
        decide: ``"time"`` (default, or ``OPFUSE_DECIDE``): a region that passes ρ ≥ θ is
            fused only if its fused replacement is measured faster than its unfused ops on
            the example inputs (CPU; cached per shape, :mod:`opfuse.timegate`); ``"rho"``:
            the traffic gate alone (deterministic).
        capture: ``"auto"`` (default): the whole model through ``torch.export``, and where
            that fails, dynamo's pieces (graph breaks at what export cannot capture), each
            fused, the rest run eagerly, the reason in ``report.capture``; ``"whole"``:
            raise :class:`~opfuse.graph.capture.CaptureError` instead (also under ``strict``).
        dynamic: one plan for every batch size and sequence length: dim 0 (batch) of every
            input with ≥ 2 dims and dim 1 (sequence) of integer/bool and 3-D floating inputs
            are symbolic, the sequence up to the config's ``max_position_embeddings``
            (:mod:`opfuse.graph.dynamic`; decided at the example size, verified there, at the
            range's minimum and at an odd size between). Calls inside the range never re-plan;
            outside it one static re-plan with a warning (``DynamicShapeError`` under
            ``strict``). ``report.dynamic`` shows the ranges and verified sizes.
        dynamic_shapes: torch.export's own ``dynamic_shapes`` (implies ``dynamic``).
        buckets: with ``dynamic``, ``True`` (edges :data:`opfuse.graph.dynamic.TOKEN_BUCKETS`:
            [1, 16], [17, 128], [129, …] tokens, tokens = batch × sequence) or a tuple of
            edges: a dynamic plan per token bucket, each decided (fusion, GEMM backends)
            inside its bucket and verified over the whole range, all planned here; a
            bucket's plan is kept only when measured faster than the example's plan at the
            bucket's typical size, and a call runs its bucket's plan. ``report.dynamic
            ["buckets"]`` lists every bucket's measurement and decision. Default None: one
            plan, decided at the example (planning per bucket took ~4.5x the optimize time on
            BERT-base here, for 1.19x at ≤ 16 tokens and nothing above 128).
        plan_cache: ``True`` (directory ``OPFUSE_PLAN_CACHE`` or ``~/.cache/opfuse/plans``) or
            a directory: a plan made before for the same model code, config, weights (every
            byte hashed), input signature, options and machine is loaded instead of planned
            (no capture, matching, verification or timing); new plans are stored there.
            ``report.capture["plan_cache"]`` says which. Default off.
        precision: ``"fp32"`` (default: nothing lowered, results unchanged bit for bit) or
            ``"bf16"``: each GEMM region (a GEMM with its bias and GELU, or a fused op with
            GEMMs inside, whose epilogue stays float32) runs in bfloat16 (float32
            accumulation, weights converted and prepacked once) when its error on the example
            inputs is ≤ ``tolerance`` and it is measured faster, then the whole model is
            checked against the float32 plan and regions go back to float32 until it is
            within budget (:mod:`opfuse.precision`); ``report.precision`` lists every
            decision. ``"fp16"`` has no CPU path (reported, float32 kept).
        tolerance: per-region relative error budget of ``precision`` (default
            :data:`opfuse.precision.DEFAULT_TOLERANCE`, 1e-2); the whole model's budget is
            :data:`~opfuse.precision.E2E_FACTOR` times it and a cosine ≥
            :data:`~opfuse.precision.COSINE_MIN` for every output.
    Returns:
        :class:`FusedModule` whose outputs equal ``model(*inputs)`` within the dtype tolerance
        (:data:`opfuse.verify.TOLERANCE`); ``.report`` is the :class:`FusionReport`.
    Raises:
        OptimizeError: bad input (training mode, not a module, inputs not a tuple, unknown gemm
            capture, decide or precision mode, a tolerance that is not a positive number,
            ``buckets`` that are not token counts or come without ``dynamic``).
        opfuse.graph.capture.CaptureError: torch.export failed and ``capture="whole"`` or
            ``strict``; or the forward changes a plain Python attribute (never captured).
    """
    kwargs = dict(example_kwargs or {})
    _check_inputs(model, example_inputs, kwargs)
    from .gemm import check_mode
    try:
        check_mode(gemm)
    except ValueError as exc:
        raise OptimizeError(str(exc)) from None
    if capture not in ("auto", "whole"):
        raise OptimizeError(f"opfuse: capture must be 'auto' or 'whole', got {capture!r}")
    from .precision import check_precision
    try:
        check_precision(precision, tolerance)
    except ValueError as exc:
        raise OptimizeError(str(exc)) from None
    from .timegate import check_mode as check_decide
    try:
        check_decide(decide)
    except ValueError as exc:
        raise OptimizeError(str(exc)) from None
    if buckets not in (None, False, True) and not (isinstance(buckets, (tuple, list)) and all(
            isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in buckets)):
        raise OptimizeError(f"opfuse: buckets must be True, None or a tuple of token counts ≥ 1, got {buckets!r}")
    if buckets and not (dynamic or dynamic_shapes is not None):
        raise OptimizeError("opfuse: buckets= needs dynamic=True (or dynamic_shapes=): a static plan has one size")
    if dynamic_shapes is not None:
        dynamic = dynamic_shapes
    elif dynamic not in (True, False):
        raise OptimizeError(f"opfuse: dynamic must be True or False (or pass dynamic_shapes=), got {dynamic!r}")
    fused = FusedModule(model, dict(theta=theta, device=device, verify=verify, strict=strict, name=name, gemm=gemm,
                                    capture=capture, decide=decide, dynamic=dynamic or None,
                                    plan_cache=plan_cache or None, precision=precision, tolerance=tolerance,
                                    buckets=TOKEN_BUCKETS if buckets is True else tuple(buckets or ()) or None))
    fused.plan_for(tuple(example_inputs), kwargs)
    return fused


def explain(model: torch.nn.Module, example_inputs: tuple, theta: float = 0.3, device=None,
            example_kwargs: dict | None = None, name: str | None = None) -> FusionReport:
    """The :class:`FusionReport` of ``optimize`` without rewriting: one eager forward on
    copies of the inputs (the Python-state check; buffers restored), capture, matching and
    the cost model — no kernel runs, nothing is verified or timed (the plan is the traffic
    gate's: ``decide="time"`` needs the fused kernels).

    Raises:
        OptimizeError: bad input; opfuse.graph.capture.CaptureError: the model cannot be
            captured whole (``optimize`` would fuse it in pieces)."""
    kwargs = dict(example_kwargs or {})
    _check_inputs(model, example_inputs, kwargs)
    return pipeline.run(model, tuple(example_inputs), kwargs, theta=theta, device=device, verify=False,
                        rewrite_graph=False, name=name).report
