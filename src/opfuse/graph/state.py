"""Model and input state around planning: copies, snapshots and the mutations a captured
program performs.

Planning runs the model's forward several times (capture, per-region verification, the
whole-model check). A forward that writes a buffer (a rolling KV cache written with
``index_copy_``, a step counter ``self.step += 1``) or an input (``r.add_(...)``) would
advance that state once per run, so planning only ever runs on copies of the inputs and
restores every buffer afterwards (:class:`StateSnapshot`). The captured program keeps the
writes (torch.export records buffer and input mutations; :func:`mutated_targets` lists
them), so they happen exactly once per call of the fused module.

Python attributes that the forward changes (``self.calls += 1`` on an ``int``) cannot be
replayed by a captured graph (export bakes their value in): :func:`python_state` records
them so that capture can refuse such a model with the attribute's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils._pytree import tree_map

aten = torch.ops.aten

_SCALARS = (bool, int, float, complex, str)


def copy_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same shape, strides, dtype and device (contiguity and
    layout are part of a plan's input signature); views that overlap themselves
    (``expand``: a stride 0) are copied densely."""
    if t.layout != torch.strided or any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
        return t.detach().clone()
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t.detach())
    return out


def copy_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Copies of every tensor in ``args``/``kwargs`` (nested lists/tuples/dicts), so
    that a forward writing its inputs in place never changes the caller's tensors."""
    def one(v):
        return copy_tensor(v) if isinstance(v, torch.Tensor) else v
    return tree_map(one, tuple(args)), tree_map(one, dict(kwargs))


def python_state(model: torch.nn.Module) -> dict[tuple[str, str], object]:
    """(module path, attribute) -> value of every plain Python scalar attribute of every
    submodule (``training`` excluded: eval mode is checked elsewhere)."""
    state = {}
    for path, mod in model.named_modules():
        for k, v in vars(mod).items():
            if isinstance(v, _SCALARS) and not k.startswith("_") and k != "training":
                state[(path, k)] = v
    return state


def changed_python_state(model: torch.nn.Module, before: dict) -> list[str]:
    """Attributes of :func:`python_state` whose value differs from ``before``, restoring
    each one to its old value; returned as ``"path.attr: old -> new"``."""
    changes = []
    after = python_state(model)
    mods = dict(model.named_modules())
    for key, old in before.items():
        new = after.get(key, old)
        if new != old or type(new) is not type(old):
            path, attr = key
            changes.append(f"{path + '.' if path else ''}{attr}: {old!r} -> {new!r}")
            setattr(mods[path], attr, old)
    return changes


@dataclass
class StateSnapshot:
    """Copies of every buffer of a model (parameters are checked by version: a forward
    that writes a parameter is refused by torch.export), restored by :meth:`restore`."""

    model: torch.nn.Module
    buffers: list = field(default_factory=list)

    @classmethod
    def take(cls, model: torch.nn.Module) -> "StateSnapshot":
        snap = cls(model)
        for mod in model.modules():
            for name, b in mod._buffers.items():
                # an opaque (oneDNN prepacked) weight is a folded constant no program writes
                if b is not None and b.layout == torch.strided:
                    snap.buffers.append((mod._buffers, name, b, b.detach().clone()))
        return snap

    def restore(self) -> None:
        """Write every saved value back into the buffer it came from (the same tensor
        object, so the model and the fused plan, which share buffers, both see it)."""
        for owner, name, tensor, saved in self.buffers:
            owner[name] = tensor  # in case planning reassigned the attribute
            if tensor.shape == saved.shape and torch.equal(tensor, saved):
                continue  # unchanged: keep its version counter as it is
            with torch.no_grad(), torch.inference_mode(tensor.is_inference()):
                if tensor.shape != saved.shape:
                    tensor.resize_(saved.shape)
                tensor.copy_(saved)


def is_mutating(node: fx.Node) -> bool:
    """``node`` calls an op whose schema writes one of its arguments (``add_``, ``copy_``,
    ``index_copy_``...)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return bool(schema is not None and schema.is_mutable)


def write_backs(graph: fx.Graph) -> list[fx.Node]:
    """The inputs / attributes a captured program writes: every ``aten.copy_`` destination
    (torch.export's unlifted module writes mutated buffers and inputs back with ``copy_`` at
    the end of the graph) and the destination of every in-place op that the rewrite put
    back (:func:`opfuse.rewrite.inplace_cache_writes`: ``index_copy_`` into a KV cache), every
    argument its schema marks written (``opfuse.rope_qk_cache`` writes k_cache and v_cache)."""
    return [dest for n in graph.nodes for dest in written_args(n)]


def written_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes ``node``'s op writes (schema ``Tensor(a!)``): ``add_``'s self,
    ``index_copy_``'s buffer, ``opfuse.rope_qk_cache``'s k_cache and v_cache; [] for an op
    that writes nothing."""
    if not is_mutating(node):
        return []
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                out.append(value)
    return out


def mutated_targets(graph: fx.Graph) -> dict[str, set[str]]:
    """What a functional captured program writes (:func:`write_backs`) by name:
    ``{"buffers": get_attr targets, "inputs": placeholder names}``."""
    out: dict[str, set[str]] = {"buffers": set(), "inputs": set()}
    for dest in write_backs(graph):
        if dest.op == "get_attr":
            out["buffers"].add(dest.target)
        elif dest.op == "placeholder":
            out["inputs"].add(dest.target)
    return out


def check_functional(graph: fx.Graph) -> str | None:
    """None when the only writes in ``graph`` are trailing ``copy_`` nodes into
    placeholders or attributes that nothing but the output reads afterwards (so a fused op
    can never read across a write); else the first offending node, named."""
    seen_copy = set()
    for node in graph.nodes:
        if node.op == "output":
            break
        if any(inp in seen_copy for inp in node.all_input_nodes):
            return f"{node.name} reads {', '.join(i.name for i in node.all_input_nodes if i in seen_copy)} after it was written"
        if not is_mutating(node):
            continue
        dest = node.args[0] if node.args else None
        if node.target is aten.copy_.default and isinstance(dest, fx.Node) and dest.op in ("placeholder", "get_attr") \
                and all(u.op == "output" for u in node.users):  # a written-back buffer may be returned too
            seen_copy.add(dest)
            continue
        return f"{node.name} ({node.target}) writes its input in place"
    return None


def note_derived(gm: fx.GraphModule, name: str, sources: list[str]) -> None:
    """Record that attribute ``name`` of ``gm`` (a folded QKV concat, a pre-transposed
    weight) was computed from the attributes ``sources``; a derived source is resolved to
    the model tensors it came from. The runtime guards these sources (version counter, or
    a fingerprint where the tensor has none) so a folded copy is never used stale."""
    derived = gm.meta.setdefault("opfuse_derived", {})
    roots: list[str] = []
    for src in sources:
        roots += derived.get(src, [src])
    derived[name] = tuple(dict.fromkeys(roots))
    # the identities and version counters of those model tensors (``opfuse_derived_ids``):
    # another plan's copy made of the same tensors at the same versions, under other names
    # (a dynamo graph's ``in6``), is the same weight (:func:`opfuse.api.share_folded_copies`;
    # the version keeps a stale plan's copy from being shared after an in-place update); none
    # when a root is not an attribute here or has no version counter (inference tensors)
    by_id = gm.meta.setdefault("opfuse_derived_ids", {})
    ids: list[tuple[int, int]] = []
    for src in sources:
        if src in by_id:
            ids += by_id[src]
            continue
        t = _attribute(gm, src)
        if t is None or src.startswith("opfuse_folded_"):
            by_id.pop(name, None)
            return
        try:
            ids.append((id(t), t._version))
        except RuntimeError:  # an inference tensor: no version counter
            by_id.pop(name, None)
            return
    by_id[name] = tuple(dict.fromkeys(ids))


def _attribute(gm: fx.GraphModule, target: str) -> torch.Tensor | None:
    """The tensor at dotted attribute path ``target`` of ``gm``, or None."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def foldable(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``node`` is a ``get_attr`` whose tensor the program never writes (a buffer that the
    forward updates, like a KV cache, must be read live, never folded into a copy)."""
    return node.op == "get_attr" and node.target not in mutated_targets(gm.graph)["buffers"]
