"""``fused.generate(...)``: Hugging Face generation over a fused prefill graph and a fused
decode-step graph, with a preallocated KV cache written in place.

::

    fused.generate(input_ids, attention_mask=..., **hf_kwargs)
      │ Hugging Face's own ``model.generate`` loop (logits processors, greedy / sampling,
      │ min/max_new_tokens, eos/pad, stopping criteria): its semantics are HF's, unchanged
      │ model.forward routed, for the call, to dynamo → opfuse (one CompiledGraph per graph)
      │ cache = a StaticCache from this module's pool: [B, H_kv, L, D] per layer and for
      │         K and V, L = prompt + new tokens rounded up to CACHE_BUCKET (≤ the model's
      │         max positions), allocated once per (B, L, dtype) and reset in place
      ▼
      prefill graph  input_ids [B, P]  (HF asks for the last position's logits only; GEMM
                     backends without weight copies: :data:`PREFILL_GEMM`)
      decode graph   input_ids [B, 1]  one plan per (B, L): every step of every call runs it;
                     the cache write is an in-place ``index_copy_`` (pipeline pass
                     ``inplace_cache_writes``), no copy of the cache per token

Sliding-window models (Mistral) get full-length cache layers: the window is applied by the
attention mask (what HF computes from ``config.sliding_window``), not by rolling the cache,
whose Python-int position would make dynamo recompile on every step.

Why a StaticCache: a DynamicCache grows by concatenation, so every decode step would have a
new shape (a new capture and plan per token). Routing replaces ``model.forward`` by an
instance attribute for the duration of the call (restored afterwards; a concurrent call of
the same model object from another thread would also run fused).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
import warnings
from collections import OrderedDict

import torch

from .graph.dynamic import position_limit

#: Cache lengths are rounded up to a multiple of this (tokens), so that calls with nearby
#: prompt / generation lengths share the decode plan.
CACHE_BUCKET = 128
#: Static caches kept per FusedModule (least recently used dropped first).
MAX_CACHES = 2
#: GEMM backend mode of the prefill graph (:func:`opfuse.gemm.apply_gemm_choices`) unless the
#: user chose one (``gemm=`` or ``OPFUSE_GEMM``): measured among the backends that keep no
#: weight copy (``"lean"``: eager's, oneDNN on the weight as it is, the GEMV). The prefill
#: runs once per call; on the Llama benchmark its pre-transposed / prepacked copies held
#: 252 MB (more than the weights, on top of the decode plan's) and measured no faster than
#: eager's GEMMs on the Ice Lake machines; on the Zen 5 machines (MKL without its AVX-512
#: paths) oneDNN on the weight as it is ran the 1×128 prefill + first token in 60.0 ms
#: against 101.9 ms with eager's GEMMs (eager 95.9), with no copy. The decode step, run once
#: per token, keeps its measured choices.
PREFILL_GEMM = "lean"

#: dynamo guards the decode graph keeps (``torch.compile(options={"guard_filter_fn": ...})``):
#: none on nn.Module attributes — checking the ~1 000 guard managers over the model's
#: modules, parameters and buffers took 554 µs of every Llama decode step (200 µs with
#: this filter; step 8.53 → 8.00 ms, Zen 5, one thread, bf16). What those guards protected
#: is checked once per ``generate`` call instead (:func:`module_fingerprint`): the model
#: cannot change between the steps of one call. None where torch has no such helper.
GUARD_FILTER = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
_PRIMITIVES = (bool, int, float, str, type(None))


def _primitive(v) -> bool:
    return isinstance(v, _PRIMITIVES) or (isinstance(v, tuple) and all(isinstance(e, _PRIMITIVES) for e in v))


def module_fingerprint(model: torch.nn.Module) -> tuple:
    """What dynamo's guards on nn.Module attributes check, as one comparable value: for
    every submodule its path, identity, class, ``forward`` (the class's and an instance
    override), hook counts, every plain attribute (bools, ints, floats, strings, None and
    tuples of them — ``training``, HF's ``scaling``, ``is_causal``, ``layer_idx`` …) and the
    identity of every plain tensor attribute, and
    every parameter's and buffer's identity, dtype, shape, device and ``requires_grad``;
    then the model's ``config`` as a dict. Costs ~a millisecond for an 8-layer Llama (once
    per ``generate`` call, never per step). In-place weight updates are not in it: the
    fused plans guard versions themselves (:meth:`opfuse.FusedModule._stale`)."""
    rows = []
    for path, mod in model.named_modules(remove_duplicate=False):
        d = mod.__dict__
        rows.append((path, id(mod), type(mod), type(mod).forward, d.get("forward"),
                     len(mod._forward_hooks), len(mod._forward_pre_hooks),
                     tuple((k, v) for k, v in d.items() if _primitive(v)),
                     tuple((k, id(v)) for k, v in d.items() if isinstance(v, torch.Tensor)),  # plain tensor attributes
                     tuple((n, id(t), t.dtype, tuple(t.shape), t.device, t.requires_grad)
                           for table in (mod._parameters, mod._buffers) for n, t in table.items() if t is not None)))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        rows.append(repr(config.to_dict()))
    return tuple(rows)


class GenerateError(ValueError):
    """``fused.generate`` cannot run this request; the message names the problem."""


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def _kv_shape(cfg) -> tuple[int, int]:
    """(key/value heads, head dim) of the decoder's attention."""
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return kv, head_dim


def check_can_generate(model: torch.nn.Module) -> None:
    """Raises GenerateError unless ``model`` is a Hugging Face model with a generation head."""
    can = getattr(type(model), "can_generate", None)
    if not callable(getattr(model, "generate", None)) or not (callable(can) and can()):
        raise GenerateError(f"opfuse: {type(model).__name__} has no language-model head, so it cannot generate; "
                            "optimize a *ForCausalLM / *LMHeadModel (e.g. LlamaForCausalLM) to call generate()")


def wanted_length(model, input_ids: torch.Tensor, kwargs: dict) -> int:
    """Tokens the cache must hold: prompt + new tokens (HF's ``max_new_tokens``, else
    ``max_length``, from the call or the generation config).

    Raises:
        GenerateError: longer than the model's position limit (``max_position_embeddings``)."""
    gc = kwargs.get("generation_config") or model.generation_config
    prompt = input_ids.shape[-1]
    new = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None))
    total = prompt + new if new is not None else kwargs.get("max_length", gc.max_length)
    limit = position_limit(_text_config(model))
    if limit is not None and total > limit:
        raise GenerateError(f"opfuse: generating up to {total} tokens (prompt {prompt} + {total - prompt} new) "
                            f"exceeds the model's {limit} positions (max_position_embeddings)")
    return total


def _own_code(forward):
    """``forward`` behind a function with a code object of its own. Dynamo keeps compiled
    graphs, and counts recompiles against ``recompile_limit``, per code object; HF's
    forwards all run through one decorator's ``wrapped_func``, so without this every
    model compiled in the process would share (and exhaust) one cache."""
    def step(*args, **kwargs):
        return forward(*args, **kwargs)
    step.__code__ = step.__code__.replace()
    return step


@contextlib.contextmanager
def routed_forward(model: torch.nn.Module, fn):
    """For the ``with`` block, ``model(...)`` calls ``fn`` (an instance attribute shadowing
    the class's forward), with the original forward's signature: HF's ``generate`` reads it
    to choose the inputs it prepares (position ids, ``logits_to_keep``; a generic signature
    made GPT-2 generate other tokens for a left-padded row). What was there is restored."""
    had, previous = "forward" in model.__dict__, model.__dict__.get("forward")

    @functools.wraps(type(model).forward.__get__(model))
    def routed(*args, **kwargs):
        return fn(*args, **kwargs)
    model.forward = routed
    try:
        yield
    finally:
        if had:
            model.forward = previous
        else:
            del model.forward


class Generation:
    """The generation state of one :class:`~opfuse.FusedModule`: the dynamo-compiled
    forward whose graphs opfuse plans, the static-cache pool and per-call step timings.

    Attributes:
        graphs: ``(phase, CompiledGraph)`` for every graph dynamo handed over, phase
            ``"prefill"`` (first forward of a call) or ``"decode"``.
        last: timings of the latest call: ``prefill_s`` (seconds), ``decode_s`` (seconds
            per decode step, a list), ``new_tokens``.
    """

    def __init__(self, model: torch.nn.Module, options: dict, forward_gms=None):
        self.model = model
        self._forward_gms = forward_gms or (lambda: [])  # the owner's forward plans (copies to share)
        self._planned = 0  # plans of self.graphs whose folded copies were shared
        from .backend import PLAN_OPTIONS
        self.options = {k: v for k, v in options.items() if k in PLAN_OPTIONS}
        self.graphs: list[tuple[str, object]] = []
        self.caches: OrderedDict = OrderedDict()
        self.last: dict = {}
        self._phase = "prefill"
        self._runner = None
        self._fingerprint = None  # module_fingerprint(model) at the start of the latest generate call
        self.replans: list[str] = []  # why the generation graphs were dropped and re-planned

    # -- dynamo → opfuse ------------------------------------------------------------------
    def _collect(self, gm, example_inputs):
        from .backend import CompiledGraph
        options = dict(self.options, name=f"{type(self.model).__name__} {self._phase}")
        if self._phase == "prefill" and options.get("gemm") is None and not os.environ.get("OPFUSE_GEMM"):
            options["gemm"] = PREFILL_GEMM
        compiled = CompiledGraph(gm, example_inputs, options)
        self.graphs.append((self._phase, compiled))
        return compiled

    def _forward(self, *args, **kwargs):
        if self._runner is None:
            options = {"options": {"guard_filter_fn": GUARD_FILTER}} if GUARD_FILTER is not None else {}
            self._runner = torch.compile(_own_code(type(self.model).forward.__get__(self.model)),
                                         backend=self._collect, dynamic=False, **options)
        start = time.perf_counter()
        out = self._runner(*args, **kwargs)
        seconds = time.perf_counter() - start
        planned = sum(len(compiled.plans) for _, compiled in self.graphs)
        if planned != self._planned:  # a graph was planned in this call
            self._planned = planned
            self._share_copies()
        if self._phase == "prefill":
            self.last["prefill_s"] = seconds
            self._phase = "decode"
        else:
            self.last["decode_s"].append(seconds)
        return out

    def _share_copies(self) -> None:
        """Every generation plan reads the folded weight copies (pre-transposed weights) an
        earlier plan — the owner's forward plans first — made of the same model tensors,
        instead of holding its own (:func:`opfuse.api.share_folded_copies`)."""
        from .api import share_folded_copies
        gms = list(self._forward_gms())
        for _, compiled in self.graphs:
            for fused in compiled.plans.values():
                for plan in (fused._plans.values() if fused is not None else ()):
                    share_folded_copies(plan.gm, gms)
                    gms.append(plan.gm)

    # -- the static cache ----------------------------------------------------------------
    def cache_for(self, batch: int, length: int, dtype: torch.dtype, device: torch.device):
        """A reset StaticCache of ``length`` tokens for ``batch`` rows (pooled).

        Raises:
            GenerateError: the decoder has cache layers other than attention K/V."""
        from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer
        key = (batch, length, dtype, str(device))
        cache = self.caches.get(key)
        if cache is not None:
            self.caches.move_to_end(key)
            cache.reset()
            return cache
        cfg = _text_config(self.model)
        cache = StaticCache(config=cfg, max_cache_len=length)
        odd = {type(layer).__name__ for layer in cache.layers} - {"StaticLayer", "StaticSlidingWindowLayer"}
        if odd:
            raise GenerateError(f"opfuse: fused generate supports attention K/V caches; this decoder's cache has "
                                f"{', '.join(sorted(odd))} layers (run model.generate unfused)")
        cache.layers = [StaticLayer(max_cache_len=length) if isinstance(layer, StaticSlidingWindowLayer) else layer
                        for layer in cache.layers]
        heads, head_dim = _kv_shape(cfg)
        cache.early_initialization(batch_size=batch, num_heads=heads, head_dim=head_dim, dtype=dtype, device=device)
        self.caches[key] = cache
        while len(self.caches) > MAX_CACHES:
            self.caches.popitem(last=False)
        return cache

    # -- one generate call ---------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, **kwargs):
        model = self.model
        check_can_generate(model)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise GenerateError("opfuse: generate() takes input_ids as a [batch, prompt] integer tensor")
        gc = kwargs.get("generation_config") or model.generation_config
        if kwargs.get("num_beams", getattr(gc, "num_beams", 1)) not in (None, 1):
            raise GenerateError("opfuse: fused generate runs greedy search and sampling; beam search "
                                "(num_beams > 1) is not supported (call the original model's generate)")
        total = wanted_length(model, input_ids, kwargs)
        limit = position_limit(_text_config(model)) or total
        length = min(limit, math.ceil(total / CACHE_BUCKET) * CACHE_BUCKET)
        rows = input_ids.shape[0] * (kwargs.get("num_return_sequences") or getattr(gc, "num_return_sequences", 1) or 1)
        user_cache = kwargs.pop("cache", None)
        if user_cache is None:  # (not `or`: an empty DynamicCache has no layers and is falsy)
            user_cache = kwargs.pop("past_key_values", None)
        if user_cache is not None:
            from transformers.cache_utils import StaticCache
            if not isinstance(user_cache, StaticCache):
                raise GenerateError(f"opfuse: fused generate needs a StaticCache (preallocated, written in place); got "
                                    f"{type(user_cache).__name__} — omit it and opfuse allocates one")
            if user_cache.get_max_length() < total:
                raise GenerateError(f"opfuse: the StaticCache passed holds {user_cache.get_max_length()} tokens; "
                                    f"this generation needs {total}")
            cache = user_cache
        else:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
            cache = self.cache_for(rows, length, dtype, input_ids.device)
        self._check_model()
        self.last = {"prefill_s": None, "decode_s": [], "cache_tokens": cache.get_max_length(), "rows": rows}
        self._phase = "prefill"
        with routed_forward(model, self._forward), \
                torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
            out = model.generate(input_ids, cache=cache, **kwargs)
        if module_fingerprint(model) != self._fingerprint:  # changed by a callback while the graphs ran unguarded
            raise GenerateError("opfuse: the model's modules changed during this generate() call (a logits "
                                "processor, stopping criterion or streamer replaced a submodule, attribute or "
                                "parameter): the steps after the change ran the graphs planned before it. "
                                "Call generate() again: the next call re-plans")
        self.last["new_tokens"] = len(self.last["decode_s"]) + 1
        missing = [p for p in ("prefill", "decode") if p not in {phase for phase, _ in self.graphs}]
        if missing and (self.last["decode_s"] or "prefill" in missing):
            # correct (dynamo ran the frame eagerly) but unfused: say so, never silently slower
            self.last["unfused"] = missing
            warnings.warn(f"opfuse: dynamo handed over no {' or '.join(missing)} graph (it ran them eagerly, e.g. "
                          "at its recompile limit): that part of generate() ran unfused", stacklevel=3)
        return out

    def _check_model(self) -> None:
        """Drop the compiled runner and its graphs when the model's modules changed since
        they were made (:func:`module_fingerprint`; dynamo keeps no guards on them,
        :data:`GUARD_FILTER`): the next forward captures and plans the model as it is."""
        fingerprint = module_fingerprint(self.model)
        if self._fingerprint is not None and fingerprint != self._fingerprint and self._runner is not None:
            self.replans.append("a submodule, its attributes, or a parameter's identity, dtype or shape changed")
            self._runner = None
            self.graphs.clear()
            self._planned = 0
        self._fingerprint = fingerprint

    # -- what ran --------------------------------------------------------------------------
    def plans(self) -> list[dict]:
        """One row per fused graph: phase, input signature, fused counts per pattern,
        dispatched ops per call (FX call_function nodes of the fused graph, ``getitem``
        excluded), calls and fallbacks."""
        rows = []
        for phase, compiled in self.graphs:
            for key, fused in compiled.plans.items():
                ops, counts = None, {}
                if fused is not None:
                    for plan in fused._plans.values():
                        ops = sum(1 for n in plan.gm.graph.nodes if n.op == "call_function"
                                  and getattr(n.target, "__name__", "") != "getitem")
                        counts = plan.report.counts()
                rows.append({"phase": phase, "signature": str(key[0]), "fused": counts, "ops": ops,
                             "calls": dict(compiled.calls), "fallbacks": [f.reason for f in compiled.fallbacks]})
        return rows

    def summary(self) -> dict:
        """The latest call: prefill seconds, median decode-step seconds, decode tokens/s
        (rows × steps per second)."""
        steps = self.last.get("decode_s") or []
        step = statistics.median(steps) if steps else None
        return {"prefill_s": self.last.get("prefill_s"), "decode_step_s": step,
                "decode_tokens_per_s": (self.last.get("rows", 1) / step) if step else None,
                "new_tokens": self.last.get("new_tokens"), "cache_tokens": self.last.get("cache_tokens")}
