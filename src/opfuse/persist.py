"""Save an optimized model once, load it in a second: :func:`save` / :func:`load`.

A saved plan is a directory::

    manifest.json        format, opfuse / torch versions, CPU, the opfuse op schemas used,
                         one entry per plan (input signature, dynamic ranges) and the
                         SHA-256 of every other file
    plan<i>.graph.json   the rewritten FX graph as data: nodes with their op names
                         ("aten::linear.default", "opfuse::attention.default"), arguments
                         and the input/output pytree specs (torch's ``treespec_dumps``)
    plan<i>.safetensors  the plan's parameters and buffers (folded QKV weights and
                         pre-transposed GEMM weights included: no recipe to re-run);
                         oneDNN prepacked weights, float32 or bf16 (opaque, layout of this oneDNN
                         build) as their dense [N, K] values, packed again at load
    plan<i>.report.json  its :class:`~opfuse.report.data.FusionReport`

Loading executes no code from the files: no pickle (tensors through ``safetensors``),
every op is looked up by name in an allowlist of namespaces (``aten``, ``opfuse``,
``mkldnn``, ``prims``) or of Python operators (``operator.getitem`` ...), node names must
be identifiers, and output containers are looked up among pytree types already
registered (Hugging Face's ``ModelOutput`` classes: only ``transformers.*`` modules are
imported to register them). A file whose hash differs from the manifest (truncated,
edited), an unknown op, a schema that changed, or another opfuse / torch version gives
:class:`LoadError` naming the problem; another CPU model warns (the GEMM backends were
measured elsewhere: still correct, maybe slower).

``load`` does no capture, no matching and needs no model object: calls with a signature
(or dynamic range) that was saved run; any other raises :class:`LoadError` (re-optimize
the model for it).
"""

from __future__ import annotations

import hashlib
import json
import keyword
import operator
import re
import warnings
from pathlib import Path

import torch
from torch import fx

from . import __version__

FORMAT = 1

#: Op namespaces a saved graph may call (looked up as ``torch.ops.<ns>.<name>.<overload>``).
NAMESPACES = ("aten", "opfuse", "mkldnn", "prims")
#: oneDNN prepacked weights a plan may hold: float32 (:mod:`opfuse.gemm`'s ``packed``) and
#: bfloat16 (:mod:`opfuse.precision`), saved dense and packed again at load.
PACKED_PREFIXES = ("opfuse_folded_packed_", "opfuse_folded_bf16_")
PACKED_DTYPES = (torch.float32, torch.bfloat16)
#: Python builtins a saved graph may call (tuple outputs, symbolic size arithmetic).
BUILTINS = {f"operator.{f.__name__}": f for f in (
    operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv,
    operator.mod, operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge)}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PART = re.compile(r"^[A-Za-z0-9_]+$")  # one component of an attribute path ("layer", "0")


class SaveError(ValueError):
    """The fused module holds something :func:`save` cannot write as data (names it)."""


class LoadError(ValueError):
    """A saved directory that cannot be loaded safely: missing, truncated or edited files,
    another opfuse or torch version, an op or schema this opfuse does not have, or a call
    the saved plans do not cover. The message names the file and the problem."""


# -- graph <-> data ------------------------------------------------------------------

def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        if ns not in NAMESPACES:
            raise SaveError(f"opfuse.save: op {target} of namespace {ns!r} is not saveable "
                            f"(allowed: {', '.join(NAMESPACES)})")
        return f"{target._schema.name}.{target._overloadname}"
    for name, fn in BUILTINS.items():
        if target is fn:
            return name
    raise SaveError(f"opfuse.save: the graph calls {target!r}, which is not an ATen/opfuse op or an allowed operator")


def _resolve(name: str):
    if name in BUILTINS:
        return BUILTINS[name]
    m = re.fullmatch(r"(\w+)::(\w+)\.(\w+)", name)
    if not m or m.group(1) not in NAMESPACES:
        raise LoadError(f"opfuse.load: op {name!r} is not allowed (namespaces {', '.join(NAMESPACES)} and "
                        "Python operators only)")
    ns, op, overload = m.groups()
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        raise LoadError(f"opfuse.load: this torch/opfuse has no op {name} (saved by another version?)") from None


def _encode(a):
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        return {"float": repr(a)}  # inf / nan survive JSON
    if isinstance(a, (list, tuple)):
        return {"list" if isinstance(a, list) else "tuple": [_encode(x) for x in a]}
    if isinstance(a, dict):
        return {"dict": [[k, _encode(v)] for k, v in a.items()]}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).replace("torch.", "")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).replace("torch.", "")}
    if isinstance(a, torch.layout):
        return {"layout": str(a).replace("torch.", "")}
    raise SaveError(f"opfuse.save: cannot write a graph argument of type {type(a).__name__} ({a!r})")


def _torch_attr(name: str, kind: type):
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise LoadError(f"opfuse.load: unknown torch {kind.__name__} {name!r}")
    return value


def _decode(a, nodes: dict):
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if not isinstance(a, dict) or len(a) != 1:
        raise LoadError(f"opfuse.load: malformed graph argument {a!r}")
    (kind, v), = a.items()
    if kind == "node":
        if v not in nodes:
            raise LoadError(f"opfuse.load: graph argument names an unknown node {v!r}")
        return nodes[v]
    if kind == "float":
        return float(v)
    if kind in ("list", "tuple"):
        items = [_decode(x, nodes) for x in v]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _decode(x, nodes) for k, x in v}
    if kind == "dtype":
        return _torch_attr(v, torch.dtype)
    if kind == "device":
        return torch.device(v)
    if kind == "memory_format":
        return _torch_attr(v, torch.memory_format)
    if kind == "layout":
        return _torch_attr(v, torch.layout)
    raise LoadError(f"opfuse.load: unknown graph argument kind {kind!r}")


def graph_to_data(gm: fx.GraphModule) -> dict:
    """The graph of ``gm`` as JSON-serialisable data (see the module docstring).

    Raises:
        SaveError: a node calls something outside the allowlists or has an argument that
            is not plain data."""
    from torch.utils._pytree import treespec_dumps
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.target == "_guards_fn" and not n.users:
            continue  # torch.export's input-guard module: the loaded FusedModule checks signatures and ranges
        entry = {"op": n.op, "name": n.name}
        if n.op == "call_function":
            entry["target"] = _op_name(n.target)
        elif n.op in ("placeholder", "get_attr"):
            entry["target"] = n.target
        elif n.op != "output":
            raise SaveError(f"opfuse.save: node {n.name} is a {n.op} (only call_function, get_attr, placeholder, "
                            "output are saveable)")
        entry["args"], entry["kwargs"] = _encode(n.args), _encode(n.kwargs)
        nodes.append(entry)
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    pytree = None if info is None else {"orig_args": list(info.orig_args),
                                        "in_spec": treespec_dumps(info.in_spec) if info.in_spec else None,
                                        "out_spec": treespec_dumps(info.out_spec) if info.out_spec else None}
    return {"nodes": nodes, "pytree": pytree}


#: Classes a saved output spec may name inside a KV-cache context ("module:Class").
_CACHE_PATH = re.compile(r"^transformers(\.\w+)+:\w+(Cache|Layer)$")
#: Object kinds of transformers' cache contexts that rebuild data only (no constructor call).
_CONTEXT_KINDS = {"tensor", "sym", "device", "dtype", "layout", "size", "items", "obj"}


def _check_context(ctx, name: str) -> None:
    if isinstance(ctx, list):
        for c in ctx:
            _check_context(c, name)
    elif isinstance(ctx, dict):
        kind = ctx.get("_t")
        if kind is not None and kind not in _CONTEXT_KINDS:
            raise LoadError(f"opfuse.load: the saved {name} rebuilds a {kind!r} object (only "
                            f"{', '.join(sorted(_CONTEXT_KINDS))} are allowed)")
        if kind is not None and "p" in ctx and not _CACHE_PATH.match(str(ctx["p"])):
            raise LoadError(f"opfuse.load: the saved {name} names class {ctx['p']!r} (only transformers' "
                            "*Cache / *Layer classes are allowed)")
        for v in ctx.values():
            _check_context(v, name)


def _output_types(node, found: set) -> None:
    """Collect the type names of a treespec JSON node (``treespec_dumps``' protocol 1) and
    check every KV-cache context in it (:func:`_check_context`)."""
    if not isinstance(node, dict):
        raise LoadError("opfuse.load: malformed output spec")
    name = node.get("type")
    if name is not None:
        found.add(name)
        if ":" in name:
            if not _CACHE_PATH.match(name):
                raise LoadError(f"opfuse.load: output type {name!r} is not a transformers cache class")
            try:
                _check_context(json.loads(node.get("context") or "null"), name)
            except json.JSONDecodeError as exc:
                raise LoadError(f"opfuse.load: malformed context of {name}: {exc}") from None
    for child in node.get("children_spec") or []:
        _output_types(child, found)


def _register_output_types(spec: str) -> None:
    """Check ``spec`` (an output / input treespec JSON) and import the ``transformers``
    modules whose types it names: ModelOutput classes register themselves as pytree nodes
    on import; KV-cache classes (``transformers.cache_utils:DynamicCache``) are registered
    as the capture registered them (:func:`opfuse.graph.capture.register_cache_pytrees`).
    Any other type, or a cache context naming another class or rebuilding anything but
    data, is an error: loading constructs nothing the file names beyond those."""
    import importlib

    from torch.utils._pytree import SERIALIZED_TYPE_TO_PYTHON_TYPE
    try:
        parsed = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise LoadError(f"opfuse.load: malformed output spec: {exc}") from None
    if not (isinstance(parsed, list) and len(parsed) == 2):
        raise LoadError("opfuse.load: malformed output spec")
    names: set = set()
    _output_types(parsed[1], names)
    for name in sorted(names):
        if name in SERIALIZED_TYPE_TO_PYTHON_TYPE:
            continue
        module, _, cls_name = name.rpartition(":") if ":" in name else name.rpartition(".")
        if not module.startswith("transformers.") or not all(_IDENT.match(p) for p in module.split(".")):
            raise LoadError(f"opfuse.load: output type {name!r} is not a registered pytree type "
                            "(only transformers' ModelOutput and cache types are imported)")
        try:
            cls = getattr(importlib.import_module(module), cls_name, None)
        except ImportError as exc:
            raise LoadError(f"opfuse.load: output type {name} needs {module}: {exc}") from None
        if name not in SERIALIZED_TYPE_TO_PYTHON_TYPE and ":" in name and isinstance(cls, type):
            try:
                from transformers.exporters.exporter_dynamo import register_pytree_node
                register_pytree_node(cls)
            except ImportError:
                pass
        if name not in SERIALIZED_TYPE_TO_PYTHON_TYPE:
            raise LoadError(f"opfuse.load: output type {name!r} is not a registered pytree type")


def data_to_graph(data: dict, root: torch.nn.Module) -> fx.GraphModule:
    """Rebuild the GraphModule of :func:`graph_to_data` over ``root`` (holding the tensors).

    Raises:
        LoadError: a malformed graph, an op outside the allowlists, a name that is not an
            identifier."""
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
    from torch.utils._pytree import treespec_loads
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    try:
        for entry in data["nodes"]:
            op, name = entry["op"], entry["name"]
            if not isinstance(name, str) or not _IDENT.match(name) or keyword.iskeyword(name):
                raise LoadError(f"opfuse.load: node name {name!r} is not an identifier")
            args, kwargs = _decode(entry["args"], nodes), _decode(entry["kwargs"], nodes)
            if op == "placeholder":
                node = graph.placeholder(name)
            elif op == "get_attr":
                target = entry["target"]
                if not all(_PART.match(p) and not keyword.iskeyword(p) for p in str(target).split(".")):
                    raise LoadError(f"opfuse.load: attribute {target!r} is not a dotted identifier")
                node = graph.get_attr(target)
            elif op == "call_function":
                node = graph.call_function(_resolve(entry["target"]), tuple(args), dict(kwargs))
            elif op == "output":
                graph.output(args[0])
                continue
            else:
                raise LoadError(f"opfuse.load: node kind {op!r} is not allowed")
            node.name = name  # graph.placeholder/get_attr may rename; identifiers checked above
            nodes[name] = node
    except (KeyError, TypeError, IndexError) as exc:
        raise LoadError(f"opfuse.load: malformed graph ({type(exc).__name__}: {exc})") from None
    pytree = data.get("pytree")
    if pytree:
        for s in (pytree["in_spec"], pytree["out_spec"]):
            if s:
                _register_output_types(s)
        graph._codegen = _PyTreeCodeGen(_PyTreeInfo(
            pytree["orig_args"], treespec_loads(pytree["in_spec"]) if pytree["in_spec"] else None,
            treespec_loads(pytree["out_spec"]) if pytree["out_spec"] else None))
    gm = fx.GraphModule(root, graph)
    gm.graph.lint()
    return gm


# -- tensors ----------------------------------------------------------------------------

def _tensors(gm: fx.GraphModule) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every tensor a get_attr node reads, by its target, on the CPU; oneDNN prepacked
    weights (:func:`opfuse.gemm.pack`) as their dense values, listed in the second result
    (target -> the row count they were packed for) to be packed again by :func:`_repack`."""
    from operator import attrgetter
    out, packed = {}, {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target not in out:
            t = attrgetter(n.target)(gm)
            if not isinstance(t, torch.Tensor):
                raise SaveError(f"opfuse.save: attribute {n.target} is a {type(t).__name__}, not a tensor")
            if t.is_mkldnn and t.dim() == 2 and t.dtype in PACKED_DTYPES:
                packed[n.target] = int(gm.meta.get("opfuse_packed_rows", {}).get(n.target, 1))
                t = t.to_dense()
            elif t.layout != torch.strided:
                raise SaveError(f"opfuse.save: {n.target} is a {t.layout} tensor (only dense tensors are saveable)")
            out[n.target] = t.detach()
    return out, packed


def _repack(tensors: dict[str, torch.Tensor], packed: dict, root: Path) -> None:
    """Pack the weights a saved plan ran on oneDNN's prepacked layout again, in place of
    their dense values. Raises LoadError when this torch has no oneDNN or an entry is not
    a float32 [N, K] tensor of the file."""
    from .gemm import pack
    for target, rows in packed.items():
        t = tensors.get(target)
        if not (isinstance(target, str) and target.startswith(PACKED_PREFIXES)):
            raise LoadError(f"opfuse.load: {target!r} in the manifest of {root} is not a prepacked weight of opfuse")
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in PACKED_DTYPES \
                or not isinstance(rows, int) or rows < 1:
            raise LoadError(f"opfuse.load: prepacked weight {target!r} of {root} is not a float32 / bfloat16 "
                            "[N, K] tensor")
        if not torch.backends.mkldnn.is_available():
            raise LoadError(f"opfuse.load: {root} runs GEMMs on oneDNN prepacked weights and this torch has no "
                            "oneDNN (re-optimize the model here)")
        tensors[target] = pack(t, rows)


def _root(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    root = torch.nn.Module()
    for target, t in tensors.items():
        *path, leaf = target.split(".")
        mod = root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        mod.register_buffer(leaf, t)
    return root


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:  # streamed: no second copy of the weights in memory
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _release(version: str) -> str:
    """``major.minor`` of a version string (``2.13.0+cpu`` -> ``2.13``)."""
    return ".".join(str(version).split("+")[0].split(".")[:2])


def _schemas(gm: fx.GraphModule) -> dict[str, str]:
    return {str(n.target._schema.name) + "." + n.target._overloadname: str(n.target._schema)
            for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "opfuse"}


# -- public API ---------------------------------------------------------------------------

def save(fused, path) -> Path:
    """Write every plan of ``fused`` (an :class:`opfuse.FusedModule`) to the directory
    ``path`` (created; files of an earlier save are replaced).

    Returns:
        the directory. Raises:
        SaveError: nothing planned yet, a plan captured in dynamo's pieces, or a graph
            holding something that is not plain data (names it)."""
    plans = list(fused._plans.items())
    if not plans:
        raise SaveError("opfuse.save: the module has no plan yet (call optimize with example inputs)")
    return write_plans(plans, path)


def write_plans(plans: list, path) -> Path:
    """Write ``plans`` ((input signature, :class:`~opfuse.pipeline.Plan`) pairs) to the
    directory ``path`` (the format of :func:`save`). Raises SaveError (see :func:`save`)."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from .cost.device import cpu_model
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    entries, schemas = [], {}
    for i, (key, plan) in enumerate(plans):
        if plan.report.capture.get("mode") == "pieces":
            raise SaveError("opfuse.save: this plan was captured in dynamo's pieces (torch.export could not capture "
                            "the whole model); only whole-model plans are saveable")
        gm = plan.gm
        data = graph_to_data(gm)
        tensors, packed = _tensors(gm)
        unique: dict[tuple, str] = {}  # one copy of a tensor several attributes share (tied weights)
        stored: dict[str, torch.Tensor] = {}
        alias: dict[str, str] = {}
        for target, t in tensors.items():
            ident = (t.data_ptr(), tuple(t.shape), t.dtype, tuple(t.stride())) if target not in packed else target
            if ident in unique:
                alias[target] = unique[ident]
                continue
            unique[ident] = target
            stored[target] = t
        files = {"graph": f"plan{i}.graph.json", "tensors": f"plan{i}.safetensors", "report": f"plan{i}.report.json"}
        (out / files["graph"]).write_text(json.dumps(data))
        save_file({k: v.contiguous() for k, v in stored.items()}, str(out / files["tensors"]))
        (out / files["report"]).write_text(json.dumps(asdict(plan.report), default=str))
        schemas.update(_schemas(gm))
        spec = plan.dynamic
        entries.append({"files": files, "sha256": {k: _sha256(out / f) for k, f in files.items()},
                        "aliases": alias, "signature": _encode(key),
                        "dynamic_key": None if plan.dynamic_key is None else _encode(plan.dynamic_key),
                        "dynamic": None if spec is None else {"dims": [list(d) for d in spec.dims],
                                                              "ranges": [list(r) for r in spec.ranges],
                                                              "tokens": None if spec.tokens is None
                                                              else list(spec.tokens)},
                        "writes": sorted(plan.writes), "derived": sorted(plan.derived), "packed": packed})
    manifest = {"format": FORMAT, "opfuse": __version__, "torch": torch.__version__, "cpu": cpu_model(),
                "schemas": schemas, "plans": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def _read_manifest(root: Path) -> dict:
    path = root / "manifest.json"
    if not path.is_file():
        raise LoadError(f"opfuse.load: {root} has no manifest.json (not a directory written by opfuse.save)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoadError(f"opfuse.load: {path} is not valid JSON (truncated or edited?): {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise LoadError(f"opfuse.load: {path} has format {manifest.get('format') if isinstance(manifest, dict) else '?'}"
                        f", this opfuse reads format {FORMAT}")
    if manifest.get("opfuse") != __version__:
        raise LoadError(f"opfuse.load: {root} was written by opfuse {manifest.get('opfuse')}, this is {__version__}: "
                        "re-optimize the model (the fused kernels may differ)")
    if _release(torch.__version__) != _release(manifest.get("torch", "")):
        raise LoadError(f"opfuse.load: {root} was written with torch {manifest.get('torch')}, this is "
                        f"{torch.__version__}: re-optimize the model (ATen op semantics may differ)")
    return manifest


def load(path):
    """Load a directory written by :func:`save` as an :class:`opfuse.FusedModule` without
    a model: no capture, matching or verification runs.

    Returns:
        a FusedModule whose calls run the saved plans (``.report``, ``.reports`` as saved).
    Raises:
        LoadError: see the module docstring (missing or edited files, versions, ops,
            schemas); calling the result with an input signature no saved plan covers
            raises it too."""
    from .api import FusedModule
    fused = FusedModule(None, {"strict": True})
    for key, plan in read_plans(path):
        fused._add_plan(key, plan)
    return fused


def _shared(tensors: dict, model: torch.nn.Module | None) -> dict:
    """``tensors`` with every entry that names a parameter or buffer of ``model`` (same
    shape and dtype) replaced by the model's own tensor: a plan from the plan cache, whose
    key includes a hash of every weight, then holds no second copy of the weights."""
    if model is None:
        return tensors
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers(remove_duplicate=False)))
    out = {}
    for target, t in tensors.items():
        mine = own.get(target)
        out[target] = mine.detach() if mine is not None and mine.shape == t.shape and mine.dtype == t.dtype else t
    return out


def read_plans(path, model: torch.nn.Module | None = None, warn_cpu: bool = True) -> list:
    """The (input signature, :class:`~opfuse.pipeline.Plan`) pairs of a directory written by
    :func:`save` / :func:`write_plans`; with ``model``, tensors that are its parameters or
    buffers are shared with it (:func:`_shared`). Raises LoadError (see :func:`load`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .cost.device import cpu_model
    from .graph.dynamic import DynamicSpec
    from .kernels import ops as _ops  # noqa: F401  (registers torch.ops.opfuse.*)
    from .pipeline import Plan
    from .report.data import FusionReport, RegionRecord
    from .rewrite import bind_op_builtins
    root = Path(path)
    manifest = _read_manifest(root)
    for name, schema in manifest.get("schemas", {}).items():
        op = _resolve(name)
        if str(op._schema) != schema:
            raise LoadError(f"opfuse.load: op {name} has schema {op._schema} here but {schema} in {root}")
    if warn_cpu and manifest.get("cpu") != cpu_model():
        warnings.warn(f"opfuse.load: {root} was planned on {manifest.get('cpu')!r}, this is {cpu_model()!r}: its "
                      "GEMM backends were measured there (results stay correct; re-optimize for this CPU's "
                      "fastest)", stacklevel=2)
    plans = []
    for entry in manifest["plans"]:
        files = entry["files"]
        for kind, fname in files.items():
            if not _IDENT.match(fname.replace(".", "_")) or "/" in fname:
                raise LoadError(f"opfuse.load: file name {fname!r} in the manifest is not a plain file name")
            fpath = root / fname
            if not fpath.is_file():
                raise LoadError(f"opfuse.load: {fpath} is missing")
            if _sha256(fpath) != entry["sha256"][kind]:
                raise LoadError(f"opfuse.load: {fpath} does not match its SHA-256 in the manifest "
                                "(truncated or edited after save)")
        try:
            tensors = load_file(str(root / files["tensors"]))
        except (SafetensorError, OSError, ValueError) as exc:
            raise LoadError(f"opfuse.load: cannot read {root / files['tensors']}: {exc}") from None
        # safetensors hands back tensors at the file's byte offsets (8-byte aligned); a fresh
        # torch allocation is 64-byte aligned as the saved module's were, and MKL's results
        # depend on operand alignment (one ulp apart on the Zen 5 machines), so copy them
        tensors = {name: t.clone() for name, t in tensors.items()}
        for target, source in entry.get("aliases", {}).items():
            tensors[target] = tensors[source]
        _repack(tensors, entry.get("packed", {}), root)
        try:
            data = json.loads((root / files["graph"]).read_text())
            report_data = json.loads((root / files["report"]).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise LoadError(f"opfuse.load: a plan file of {root} is not valid JSON: {exc}") from None
        gm = data_to_graph(data, _root(_shared(tensors, model)))
        bind_op_builtins(gm)
        report_data["regions"] = [RegionRecord(**r) for r in report_data.get("regions", [])]
        report = FusionReport(**report_data)
        report.capture = dict(report.capture, loaded_from=str(root))
        dyn = entry.get("dynamic")
        spec = None if dyn is None else DynamicSpec(tuple((i, d, s) for i, d, s in dyn["dims"]),
                                                     tuple((s, lo, hi) for s, lo, hi in dyn["ranges"]),
                                                     tuple(dyn["tokens"]) if dyn.get("tokens") else None)
        plan = Plan(gm, report, [], writes=frozenset(entry.get("writes", [])),
                    derived=frozenset(entry.get("derived", [])), dynamic=spec)
        if spec is not None:
            plan.dynamic_key = _decode(entry["dynamic_key"], {})
        plans.append((_decode(entry["signature"], {}), plan))
    return plans


# -- plan cache -----------------------------------------------------------------------------

def default_cache_dir() -> Path:
    """``OPFUSE_PLAN_CACHE`` or ``~/.cache/opfuse/plans``."""
    import os
    return Path(os.environ.get("OPFUSE_PLAN_CACHE") or Path.home() / ".cache" / "opfuse" / "plans")


def plan_key(model: torch.nn.Module, args: tuple, kwargs: dict, options: dict) -> str:
    """SHA-256 (hex) identifying one planning job: opfuse, torch and transformers versions,
    the CPU and thread count (GEMM backends and timings are measured per machine), the
    model's classes and their source code, its config, the bytes of every parameter and
    buffer (all of them: a changed weight is a new key, never a stale plan), the input
    signature (shapes, dtypes; the values of non-tensor inputs), the optimize options and
    the decision environment (``OPFUSE_DECIDE``, ``OPFUSE_GEMM``, ``OPFUSE_MEASURE_DEVICE``).

    Raises:
        SaveError: a weight that is not a dense CPU-readable tensor (then no cache)."""
    import inspect
    import os

    from .cost.device import cpu_model
    from .graph.meta import input_signature
    h = hashlib.sha256()

    def add(x) -> None:
        h.update(str(x).encode())
        h.update(b"\0")
    add(FORMAT), add(__version__), add(torch.__version__), add(cpu_model()), add(torch.get_num_threads())
    try:
        import transformers
        add(transformers.__version__)
    except ImportError:
        add("no transformers")
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        add(f"{cls.__module__}.{cls.__qualname__}")
        try:
            add(inspect.getsource(cls))
        except (OSError, TypeError):
            add("no source")
    config = getattr(model, "config", None)
    add(config.to_json_string() if hasattr(config, "to_json_string") else repr(config))
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if t.layout != torch.strided or t.is_meta:
            raise SaveError(f"opfuse: weight {name} is a {t.layout} tensor: no plan cache")
        add(name), add(tuple(t.shape)), add(t.dtype), add(t.device)
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                 if t.numel() else b"")
    add(input_signature(args, kwargs))
    add(sorted((k, repr(v)) for k, v in options.items() if k != "plan_cache"))
    add([os.environ.get(v) for v in ("OPFUSE_DECIDE", "OPFUSE_GEMM", "OPFUSE_MEASURE_DEVICE")])
    return h.hexdigest()
