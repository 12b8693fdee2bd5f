"""The systems a model is compared on. Each peer is built once (its cold optimize /
compile / export time is measured) and then called like the eager model; a peer that
cannot be built (missing package, export error, optimizer crash) keeps its error message
and is shown as failed, never dropped.

    eager      the Hugging Face model as loaded
    opfuse     opfuse.optimize (capture → ... → verify → rewrite → GEMM backends), cold time
               includes verification and the GEMM measurements (cached afterwards)
    opfuse-aten  the same with eager's GEMMs (gemm="aten"): the fusions' share alone
    opfuse-bf16  opfuse.optimize(..., precision="bf16"): GEMMs in bf16 where measured error
               and time allow (opfuse.precision); the notes say how many
    autocast-bf16  the eager model under torch.autocast("cpu", dtype=torch.bfloat16)
    inductor   torch.compile(model) (default mode); cold time = first call
    ort        torch.onnx.export (dynamo=False first, then dynamo=True) + ONNX Runtime, ORT_ENABLE_ALL
    ort-opt    the same ONNX file through onnxruntime.transformers.optimizer.optimize_model
    openvino   openvino.convert_model(model, example_input) on the CPU device, one stream, the
               same thread count, INFERENCE_PRECISION_HINT f32
    openvino-default  the same converted model at the device's default precision (bf16 on
               CPUs with native bf16, f32 elsewhere; the precision it ran is in the notes)
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PEERS = ("eager", "opfuse", "opfuse-aten", "opfuse-bf16", "autocast-bf16", "inductor", "ort", "ort-opt", "openvino",
         "openvino-default")
# onnxruntime.transformers.optimizer model_type per opfuse model family
ORT_MODEL_TYPE = {"minilm": "bert", "bert": "bert", "gpt2": "gpt2", "llama": "gpt2", "vit": "vit"}


@dataclass
class Peer:
    """One system under test: ``fn()`` runs it on the benchmark inputs and returns the
    first output tensor; ``error`` is set (and ``fn`` is None) when it could not be built."""

    name: str
    fn: Callable[[], torch.Tensor] | None = None
    cold_s: float | None = None
    error: str | None = None
    detail: dict = field(default_factory=dict)


class FirstOutput(torch.nn.Module):
    """``model(*args)`` -> its first tensor output (``last_hidden_state``), so every peer
    (ONNX export included) returns one tensor."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        out = self.model(*args)
        if isinstance(out, torch.Tensor):
            return out
        return out[0]


def first_tensor(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def build_eager(model, args) -> Peer:
    def fn():
        with torch.inference_mode():
            return first_tensor(model(*args))
    return Peer("eager", fn, cold_s=0.0)


def build_opfuse(model, args, name: str, theta: float = 0.3, gemm: str | None = None,
                 label: str = "opfuse", precision: str = "fp32") -> Peer:
    import opfuse
    t = time.perf_counter()
    fused = opfuse.optimize(model, args, theta=theta, name=name, gemm=gemm, precision=precision)
    cold = time.perf_counter() - t

    def fn():
        with torch.inference_mode():
            return first_tensor(fused(*args))
    gemms = {}
    for g in fused.report.gemm:
        gemms[g["backend"]] = gemms.get(g["backend"], 0) + 1
    detail = {"fused": fused.report.counts(), "gemm": gemms, "module": fused}
    if fused.report.precision:
        p = fused.report.precision
        detail["export"] = (f"bf16 GEMMs {sum(g['precision'] == 'bf16' for g in p['gemms'])}/{len(p['gemms'])}"
                            + ("" if p.get("native") else " (no native bf16)"))
    return Peer(label, fn, cold_s=cold, detail=detail)


def build_autocast(model, args) -> Peer:
    def fn():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return first_tensor(model(*args)).float()
    t = time.perf_counter()
    fn()
    return Peer("autocast-bf16", fn, cold_s=time.perf_counter() - t)


def build_inductor(model, args) -> Peer:
    torch._dynamo.reset()
    compiled = torch.compile(FirstOutput(model).eval())
    t = time.perf_counter()
    with torch.inference_mode():
        compiled(*args)
    cold = time.perf_counter() - t

    def fn():
        with torch.inference_mode():
            return compiled(*args)
    return Peer("inductor", fn, cold_s=cold)


def export_onnx(model, args, path: str) -> str:
    """Export ``FirstOutput(model)`` to ``path``: TorchScript exporter first, then the
    dynamo exporter. Returns which one worked; raises with both errors when neither does."""
    names = ["input_ids", "attention_mask"][:len(args)] if args[0].dtype == torch.long else ["pixel_values"]
    errors = []
    for dynamo in (False, True):
        try:
            with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
                warnings.simplefilter("ignore")
                kw = {} if dynamo else {"opset_version": 17}
                torch.onnx.export(FirstOutput(model).eval(), tuple(args), path, input_names=names,
                                  output_names=["output"], dynamo=dynamo, **kw)
            return "dynamo=True" if dynamo else "dynamo=False"
        except Exception as exc:  # noqa: BLE001  any exporter failure is a reported result
            errors.append(f"dynamo={dynamo}: {_one_line(exc)}")
    raise RuntimeError("; ".join(errors))


def _session(path: str, threads: int):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _ort_peer(name: str, path: str, args, threads: int, cold: float, detail: dict) -> Peer:
    t = time.perf_counter()
    sess = _session(path, threads)
    feeds = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
    sess.run(None, feeds)
    cold += time.perf_counter() - t

    def fn():
        return torch.from_numpy(sess.run(None, feeds)[0])
    return Peer(name, fn, cold_s=cold, detail=detail)


def build_ort(model, args, family: str, threads: int, workdir: str | None = None) -> list[Peer]:
    """The ``ort`` and ``ort-opt`` peers (export once, shared)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        msg = f"onnxruntime not installed ({exc}); pip install 'opfuse[bench]'"
        return [Peer("ort", error=msg), Peer("ort-opt", error=msg)]
    workdir = workdir or tempfile.mkdtemp(prefix="opfuse-bench-")
    path = os.path.join(workdir, f"{family}.onnx")
    t = time.perf_counter()
    try:
        route = export_onnx(model, args, path)
    except Exception as exc:  # noqa: BLE001
        msg = f"export failed: {exc}"
        return [Peer("ort", error=msg), Peer("ort-opt", error=msg)]
    export_s = time.perf_counter() - t
    peers = []
    try:
        peers.append(_ort_peer("ort", path, args, threads, export_s, {"export": route, "export_s": export_s}))
    except Exception as exc:  # noqa: BLE001
        peers.append(Peer("ort", error=f"session failed ({route}): {_one_line(exc)}"))
    try:
        from onnxruntime.transformers.optimizer import optimize_model
        cfg = getattr(model, "config", None)
        heads = getattr(cfg, "num_attention_heads", 0) or 0
        hidden = getattr(cfg, "hidden_size", 0) or 0
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = optimize_model(path, model_type=ORT_MODEL_TYPE.get(family, "bert"), num_heads=heads,
                                 hidden_size=hidden, opt_level=1)
            opt_path = path.replace(".onnx", ".opt.onnx")
            opt.save_model_to_file(opt_path)
        stats = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        peers.append(_ort_peer("ort-opt", opt_path, args, threads, export_s + time.perf_counter() - t,
                               {"export": route, "fused": stats}))
    except Exception as exc:  # noqa: BLE001
        peers.append(Peer("ort-opt", error=f"optimize_model failed ({route}): {_one_line(exc)}"))
    return peers


def build_openvino(model, args, threads: int) -> list[Peer]:
    """The ``openvino`` (f32) and ``openvino-default`` peers, from one conversion."""
    names = ("openvino", "openvino-default")
    try:
        import openvino as ov
    except ImportError as exc:
        return [Peer(n, error=f"openvino not installed ({exc}); pip install 'opfuse[bench]'") for n in names]
    t = time.perf_counter()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            converted = ov.convert_model(FirstOutput(model).eval(), example_input=tuple(args))
    except Exception as exc:  # noqa: BLE001  a conversion failure is a reported result
        return [Peer(n, error=f"conversion failed: {_one_line(exc)}") for n in names]
    convert_s = time.perf_counter() - t
    core = ov.Core()
    feeds = [a.numpy() for a in args]
    peers = []
    for name, hint in zip(names, ("f32", None)):
        config = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
        if hint:
            config["INFERENCE_PRECISION_HINT"] = hint
        try:
            t = time.perf_counter()
            compiled = core.compile_model(converted, "CPU", config)
            request = compiled.create_infer_request()
            request.infer(feeds)
            cold = convert_s + time.perf_counter() - t
            precision = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
        except Exception as exc:  # noqa: BLE001
            peers.append(Peer(name, error=f"compile failed: {_one_line(exc)}"))
            continue

        def fn(request=request):
            request.infer(feeds)
            return torch.from_numpy(request.get_output_tensor(0).data.copy())
        peers.append(Peer(name, fn, cold_s=cold, detail={"export": f"precision {precision}"}))
    return peers


def build_peers(against: list[str], model, args, family: str, name: str, threads: int,
                theta: float = 0.3, log: Callable[[str], None] = lambda s: None) -> list[Peer]:
    """eager and opfuse always, then each of ``against`` (inductor, ort, openvino; ort brings
    ort-opt, openvino brings openvino-default)."""
    peers = [build_eager(model, args)]
    wanted = [a.strip() for a in against if a.strip() and a.strip() != "eager"]
    steps: list[tuple[str, Callable[[], list[Peer]]]] = [("opfuse", lambda: [build_opfuse(model, args, name, theta)])]
    if "opfuse-aten" in wanted:
        steps.append(("opfuse-aten", lambda: [build_opfuse(model, args, name, theta, gemm="aten", label="opfuse-aten")]))
    if "opfuse-bf16" in wanted:
        steps.append(("opfuse-bf16", lambda: [build_opfuse(model, args, name, theta, label="opfuse-bf16",
                                                            precision="bf16")]))
    if "autocast-bf16" in wanted:
        steps.append(("autocast-bf16", lambda: [build_autocast(model, args)]))
    if "inductor" in wanted:
        steps.append(("inductor", lambda: [build_inductor(model, args)]))
    if "ort" in wanted or "ort-opt" in wanted:
        steps.append(("ort", lambda: build_ort(model, args, family, threads)))
    if "openvino" in wanted or "openvino-default" in wanted:
        steps.append(("openvino", lambda: build_openvino(model, args, threads)))
    unknown = [a for a in wanted if a not in PEERS]
    for label, build in steps:
        log(f"building {label}")
        try:
            peers.extend(build())
        except Exception as exc:  # noqa: BLE001  a peer that fails is a result
            peers.append(Peer(label, error=_one_line(exc)))
    peers.extend(Peer(a, error=f"unknown peer (known: {', '.join(PEERS)})") for a in unknown)
    return peers
