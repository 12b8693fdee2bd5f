"""``opfuse bench MODEL --generate``: token generation, opfuse vs Hugging Face eager and HF
StaticCache + torch.compile, in one process, interleaved rounds after warm-up.

Per system and batch: greedy generation of exactly ``new`` tokens after a ``prompt``-token
prompt (the model's ``generation_config.eos_token_id`` unset, so every system generates exactly
``new`` tokens and does the same work; ``min_new_tokens = max_new_tokens`` did that before, at
the price of HF's min-length logits processors, which build a vocabulary-sized ``isin`` mask
on every step: 0.37 ms a Llama step, the same in every system), timed
whole (T_N) and with one new token (T_1, = prefill + one sampling step):

* prefill tokens/s = batch · prompt / T_1
* decode tokens/s = batch · (new − 1) / (T_N − T_1)
* end-to-end tokens/s = batch · new / T_N

The floor: a decode step reads every weight of the decoder and the LM head once (the
embedding table is only gathered), so no system runs a step faster than weight bytes /
the machine's weight-streaming bandwidth (measured here: a [1, K] × Wᵀ linear on every
decode weight in turn, ≫ the last-level cache; :func:`gemv_bandwidth`). ONNX Runtime and
OpenVINO have no offline ``generate`` path in this environment (optimum is not installed):
they are listed as failed peers with that reason.
"""

from __future__ import annotations

import statistics
import time

import torch

from . import machine
from .models import set_threads
from .peers import Peer

#: Decoder configs of the generation benchmark (HF defaults otherwise: use_cache=True).
GENERATE_MODELS = {
    # issue #13's Llama: 8 layers, hidden 512, GQA 8/4, vocab 32000 (158 MB of weights read per token)
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {}),  # GPT-2 small, 124 M parameters
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                                      num_attention_heads=8, num_key_value_heads=2,
                                                      vocab_size=32000)),
}


def build_lm(name: str, seed: int = 0) -> torch.nn.Module:
    """A decoder with a language-model head from :data:`GENERATE_MODELS`, random weights,
    eval mode. Raises KeyError for an unknown name."""
    import transformers
    model_cls, config_cls, overrides = GENERATE_MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**overrides)
    return getattr(transformers, model_cls)(config).eval()


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight a decode step reads: all parameters except the input embedding
    (gathered one row per token), plus the LM head when it is tied to that embedding."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    if head is not None and head.weight is emb:
        total += emb.numel() * emb.element_size()
    return total


def decode_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The matrices (≥ 2-D) a decode step streams: every parameter but the input embedding,
    plus the LM head when it is tied to that embedding (same rule as
    :func:`decode_weight_bytes`; 1-D norm weights and biases are left out, they are < 0.1 %)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    out = [p.detach() for p in model.parameters() if p is not emb and p.dim() >= 2]
    if head is not None and head.weight is emb:
        out.append(emb.detach())
    return out


def _pass_seconds(step, repeat: int) -> float:
    """Median seconds of ``repeat`` timed calls of ``step()`` after one warm-up call."""
    step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemv_bandwidth(model: torch.nn.Module, repeat: int = 5) -> float:
    """Bytes/s at which this machine streams a decode step's weights from memory: one pass
    = a [1, K] × Wᵀ linear on every decode weight in turn (:func:`decode_weights`, e.g.
    158 MB for the Llama config, ≫ the last-level cache, so no weight is still cached from
    the pass before), the median of ``repeat`` passes, the best of three ways to read them —
    the weight as it is ([N, K] rows), pre-transposed ([K, N], the ``wt`` GEMM backend) and
    a plain ``sum`` of each weight (a read with no GEMV arithmetic). The best case of a
    decode step's weight streaming, on this machine and thread count.

    An earlier version timed the LM head alone, best of 10: a 65 MB weight that a 32 MB L3
    partly serves between runs, which overstated the rate 1.7x on Zen 3 (29.7 GB/s vs 17
    from DRAM, measured 2026-12-04). Raises ValueError for a model without ≥ 2-D weights."""
    weights = decode_weights(model)
    if not weights:
        raise ValueError("gemv_bandwidth: the model has no >= 2-D decode weights to stream")
    total = sum(w.numel() * w.element_size() for w in weights)
    xs = [torch.randn(1, w.shape[-1], dtype=w.dtype) for w in weights]
    flat = [w.reshape(w.shape[0], -1) for w in weights]
    transposed = [w.t().contiguous().t() for w in flat]

    def linear(ws):
        return lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, ws)]

    ways = (linear(flat), linear(transposed), lambda: [w.sum() for w in weights])
    return total / min(_pass_seconds(way, repeat) for way in ways)


def kv_cache_bytes(model: torch.nn.Module, rows: int, tokens: int) -> int:
    """Bytes of a K and V cache of ``tokens`` positions for ``rows`` sequences (every layer:
    2 × rows × KV heads × tokens × head dim × element size, the weights' dtype)."""
    from opfuse.generate import _kv_shape, _text_config
    cfg = _text_config(model)
    heads, head_dim = _kv_shape(cfg)
    size = next(p.element_size() for p in model.parameters() if p.is_floating_point())
    return 2 * cfg.num_hidden_layers * rows * heads * tokens * head_dim * size


def held_bytes(fused) -> dict:
    """What an optimized model holds beyond the model's own weights, in bytes: ``folded``,
    the distinct storages (other than the model's parameters') of every plan's folded constants (pre-transposed / prepacked /
    bf16 weight copies, merged QKV weights) over the forward and generation plans; ``cache``,
    the pooled static KV caches of :class:`opfuse.generate.Generation`."""
    model = fused._model[0]
    own = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
    seen, folded = set(own), 0  # a buffer sharing a weight's storage (a wt view of it) adds nothing
    gms = [p.gm for p in fused._plans.values()]
    for _phase, compiled in fused.generation.graphs:
        gms += [plan.gm for f in compiled.plans.values() if f is not None for plan in f._plans.values()]
    for gm in gms:
        for name, t in gm.named_buffers():
            if not name.startswith("opfuse_folded_"):
                continue
            key = ("mkldnn", id(t)) if t.is_mkldnn else t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                folded += t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
    cache = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                for c in fused.generation.caches.values() for layer in c.layers if getattr(layer, "keys", None) is not None)
    return {"folded": folded, "cache": cache}


def _peers(model, ids, mask, against, log) -> list[Peer]:
    """Every system as a :class:`~opfuse.bench.peers.Peer` whose ``fn(n)`` generates ``n``
    tokens (``detail["module"]``: opfuse's FusedModule)."""
    def hf(n, **extra):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                  **extra)
    peers = [Peer("eager", hf, cold_s=0.0)]
    import opfuse

    def opfuse_peer(name: str, **options) -> Peer:
        """opfuse with ``options``: optimize + a first generate (prefill and decode plans), timed cold."""
        log(f"building {name} (optimize + first generate: prefill and decode plans)")
        start = time.perf_counter()
        fused = opfuse.optimize(model, (ids,), example_kwargs={"attention_mask": mask}, **options)

        def run(n):
            return fused.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
        run(2)
        return Peer(name, run, cold_s=time.perf_counter() - start, detail={"module": fused})
    peers.append(opfuse_peer("opfuse"))
    if "opfuse-aten" in against:  # eager's GEMMs: no weight copies
        peers.append(opfuse_peer("opfuse-aten", gemm="aten"))
    if "opfuse-lean" in against:  # GEMM backends measured among those without a weight copy
        peers.append(opfuse_peer("opfuse-lean", gemm="lean"))
    if "opfuse-bf16" in against:
        peers.append(opfuse_peer("opfuse-bf16", precision="bf16"))
    if "static-compile" in against:
        log("building HF StaticCache + torch.compile (inductor)")
        from opfuse.generate import _own_code, routed_forward  # own dynamo cache; HF reads the signature
        compiled = torch.compile(_own_code(type(model).forward.__get__(model)), dynamic=False)

        def static_compile(n):
            with routed_forward(model, compiled):
                return hf(n, cache_implementation="static")
        start = time.perf_counter()
        try:
            static_compile(2)
            peers.append(Peer("static-compile", static_compile, cold_s=time.perf_counter() - start))
        except Exception as exc:  # noqa: BLE001  a peer that fails is a result
            peers.append(Peer("static-compile", error=f"{type(exc).__name__}: {str(exc)[:200]}"))
    peers += [Peer(name, error="no offline generate() path here (needs optimum-onnxruntime / optimum-intel, not "
                               "installed): a decoder with a KV cache is not one exported graph")
              for name in ("ort", "openvino") if name in against]
    return peers


def bench_generate(name: str, batch: int = 1, prompt: int = 128, new: int = 128, threads: int = 1,
                   against=("static-compile", "ort", "openvino"), repeat: int = 3, log=lambda s: None,
                   with_breakdown: bool = False) -> dict:
    """Run the generation comparison and return it as plain data (module docstring)."""
    set_threads(threads)
    model = build_lm(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding on every other row, as a batch of unequal prompts would have
        mask[::2, : prompt // 8] = 0
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        ids[::2, : prompt // 8] = pad
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    model.generation_config.eos_token_id = None  # exactly `new` tokens in every system (module docstring)
    peers = _peers(model, ids, mask, set(against), log)
    ok = [p for p in peers if p.fn is not None]
    ref = ok[0].fn(new)  # eager
    if ref.shape[-1] != prompt + new:
        raise RuntimeError(f"bench_generate: eager generated {ref.shape[-1] - prompt} tokens, not {new}")
    same = {p.name: bool(torch.equal(p.fn(new), ref)) for p in ok}
    log(f"timing {', '.join(p.name for p in ok)} ({repeat} interleaved rounds of {new} and of 1 new token)")
    samples = {p.name: {"n": [], "one": []} for p in ok}
    for _ in range(repeat):
        for p in ok:
            for label, n in (("n", new), ("one", 1)):
                start = time.perf_counter()
                p.fn(n)
                samples[p.name][label].append(time.perf_counter() - start)
    bw = gemv_bandwidth(model)
    weight_bytes = decode_weight_bytes(model)
    floor_step_s = weight_bytes / bw
    rows = []
    for peer in peers:
        if peer.fn is None:
            rows.append({"peer": peer.name, "status": "failed", "error": peer.error})
            continue
        t_n, t_1 = statistics.median(samples[peer.name]["n"]), statistics.median(samples[peer.name]["one"])
        step = (t_n - t_1) / max(1, new - 1)
        row = {"peer": peer.name, "status": "ok", "cold_s": peer.cold_s, "total_s": t_n, "prefill_s": t_1,
               "prefill_tok_s": batch * prompt / t_1, "decode_step_ms": 1e3 * step,
               "decode_tok_s": batch / step if step > 0 else None, "e2e_tok_s": batch * new / t_n,
               "vs_floor": step / floor_step_s if step > 0 else None, "same_tokens_as_eager": same[peer.name]}
        fused = peer.detail.get("module")
        tokens = prompt + new
        # bytes held beyond the weights: eager's DynamicCache at the end of the generation, the
        # StaticCache of prompt + new tokens HF allocates, opfuse's folded copies + pooled caches
        row["held_bytes"] = ({"folded": 0, "cache": kv_cache_bytes(model, batch, tokens)} if fused is None
                             else held_bytes(fused))
        if fused is not None:
            row["plans"] = [{k: p[k] for k in ("phase", "fused", "ops", "calls", "fallbacks")}
                            for p in fused.generation.plans()]
        rows.append(row)
    eager_step = next(r["decode_step_ms"] for r in rows if r["peer"] == "eager")
    for r in rows:
        if r["status"] == "ok":
            r["decode_speedup_vs_eager"] = eager_step / r["decode_step_ms"]
    result_breakdown = {}
    if with_breakdown:
        from .breakdown import step_breakdown
        log("profiling a decode step of eager and opfuse")
        result_breakdown = {p.name: step_breakdown(p.fn) for p in ok if p.name in ("eager", "opfuse", "static-compile")}
    return {"model": name, "batch": batch, "prompt": prompt, "new": new, "threads": threads, "repeat": repeat,
            "breakdown": result_breakdown, "machine": machine.describe(),
            "memory": {"weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                       "static_cache_bytes": kv_cache_bytes(model, batch, prompt + new)},
            "floor": {"weight_bytes_per_step": weight_bytes, "gemv_bytes_per_s": bw,
                      "decode_step_ms": 1e3 * floor_step_s, "decode_tok_s": batch / floor_step_s},
            "peers": rows}


def csv_rows(result: dict) -> list[dict]:
    """One CSV row per peer of :func:`bench_generate`'s result (the per-plan lists left to the JSON)."""
    rows = []
    for r in result["peers"]:
        row = {k: v for k, v in r.items() if k not in ("plans", "held_bytes")}
        for k, v in (r.get("held_bytes") or {}).items():
            row[f"held_{k}_bytes"] = v
        rows.append(row)
    return rows


def generate_table(result: dict):
    """rich Table of :func:`bench_generate`'s result."""
    from rich.table import Table
    f = result["floor"]
    table = Table(title=f"{result['model']} generate: batch {result['batch']}, prompt {result['prompt']}, "
                        f"{result['new']} new tokens, {result['threads']} thread(s) — floor {f['decode_tok_s']:.1f} "
                        f"decode tok/s ({f['weight_bytes_per_step'] / 1e6:.0f} MB per step at "
                        f"{f['gemv_bytes_per_s'] / 1e9:.1f} GB/s)")
    for col in ("system", "cold s", "prefill tok/s", "decode ms/step", "decode tok/s", "vs eager", "× floor",
                "same tokens", "held MB (copies + cache)", "note"):
        table.add_column(col, justify="left" if col in ("system", "note") else "right")
    for r in result["peers"]:
        if r["status"] != "ok":
            table.add_row(r["peer"], "", "", "", "", "", "", "", "", f"failed: {r['error']}")
            continue
        held = r.get("held_bytes") or {"folded": 0, "cache": 0}
        table.add_row(r["peer"], f"{r['cold_s']:.1f}", f"{r['prefill_tok_s']:.0f}", f"{r['decode_step_ms']:.2f}",
                      f"{r['decode_tok_s']:.1f}", f"{r['decode_speedup_vs_eager']:.2f}x", f"{r['vs_floor']:.2f}",
                      "yes" if r["same_tokens_as_eager"] else "NO",
                      f"{held['folded'] / 1e6:.0f} + {held['cache'] / 1e6:.1f}", "")
    return table
