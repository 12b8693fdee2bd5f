"""A small serialisable summary of a captured graph for the HTML report.

The pipeline calls :func:`graph_summary` once, on the canonicalized graph before any
rewrite, and stores the plain dict on ``FusionReport.block_graph``; the HTML renderer
needs nothing but the report. This module knows FX, not patterns: region membership
is joined later by node name (``RegionRecord.nodes``).

Shape of the summary::

    {"block": "encoder.layer.0",          # the first block of the most frequent kind
     "kind": "encoder.layer.#", "repeats": 6,
     "nodes": [{"name", "op", "target", "inputs", "shape", "view", "module"}, ...],   # in graph order
     "external": [{"name", "op", "shape"}],   # producers outside the block that feed it
     "outputs": ["layer_norm_2"],             # block nodes consumed outside the block
     "model": {"segments": [{"id", "label", "ops", "repeats", "blocks"}], "edges": [[a, b], ...]}}
"""

from __future__ import annotations

import re
from collections import Counter

from torch import fx

from ..graph.blocks import block_of, op_name
from ..graph.meta import VIEW_OPS


def _kind(block: str) -> str:
    return re.sub(r"\d+$", "#", block)


def _short_target(node: fx.Node) -> str:
    """``aten.transpose.int`` -> ``transpose``; placeholders keep their name."""
    if node.op != "call_function":
        return node.op
    text = str(node.target)
    parts = text.split(".")
    return parts[1] if text.startswith("aten.") and len(parts) > 1 else parts[-1]


def _shape(node: fx.Node) -> list[int] | None:
    val = node.meta.get("val")
    shape = getattr(val, "shape", None)
    return None if shape is None else [s if isinstance(s, int) else str(s) for s in shape]  # str: symbolic


def _module(node: fx.Node) -> str:
    """Innermost module path of a node ('' at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _type in stack.values()]
    return paths[-1] if paths else ""


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and "_assert" not in str(node.target)


def _node_record(node: fx.Node, inputs: list[str], block: str | None) -> dict:
    module = _module(node)
    if block and module.startswith(block):
        module = module[len(block):].lstrip(".")
    return {"name": node.name, "op": op_name(node) or _short_target(node), "target": str(node.target),
            "inputs": inputs, "shape": _shape(node), "view": node.target in VIEW_OPS, "module": module}


def block_nodes(graph: fx.Graph, block: str | None) -> tuple[list[dict], list[dict], list[str]]:
    """(nodes of ``block``, external producers feeding it, block nodes used outside it).
    Parameters (``get_attr``) and metadata asserts are left out."""
    inside = [n for n in graph.nodes if _is_compute(n) and (block is None or block_of(n) == block)]
    names = {n.name for n in inside}
    nodes, external, seen, outputs = [], [], set(), []
    for n in inside:
        ins = []
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                continue
            ins.append(a.name)
            if a.name not in names and a.name not in seen:
                seen.add(a.name)
                external.append({"name": a.name, "op": op_name(a) or _short_target(a), "shape": _shape(a)})
        nodes.append(_node_record(n, ins, block))
        if any(u.name not in names for u in n.users):
            outputs.append(n.name)
    return nodes, external, outputs


def model_segments(graph: fx.Graph) -> dict:
    """The whole model as segments in graph order: inputs, top-level modules (``embeddings``,
    ``pooler``...), and each kind of repeated block collapsed into one segment ``×N``."""
    kinds = Counter()
    blocks_of_kind: dict[str, list[str]] = {}
    for n in graph.nodes:
        b = block_of(n)
        if b:
            kinds[_kind(b)] += 1
            blocks_of_kind.setdefault(_kind(b), [])
            if b not in blocks_of_kind[_kind(b)]:
                blocks_of_kind[_kind(b)].append(b)
    segments: dict[str, dict] = {}
    seg_of: dict[str, str] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            key, label = f"in:{n.name}", n.name
        elif n.op == "output":
            key, label = "out", "output"
        elif not _is_compute(n):
            continue
        elif (b := block_of(n)):
            key = label = _kind(b)
        else:
            top = _module(n).split(".")[0]
            key = label = top or "(top level)"
        seg = segments.setdefault(key, {"id": f"seg{len(segments)}", "label": label, "ops": 0,
                                        "repeats": 1, "blocks": []})
        if key in blocks_of_kind:
            seg["repeats"], seg["blocks"] = len(blocks_of_kind[key]), blocks_of_kind[key]
        if op_name(n) or (n.op == "call_function" and n.target not in VIEW_OPS):
            seg["ops"] += 1
        seg_of[n.name] = key
    edges = []
    for n in graph.nodes:
        if n.name not in seg_of:
            continue
        for a in n.all_input_nodes:
            src, dst = seg_of.get(a.name), seg_of[n.name]
            if src and src != dst and [segments[src]["id"], segments[dst]["id"]] not in edges:
                edges.append([segments[src]["id"], segments[dst]["id"]])
    return {"segments": list(segments.values()), "edges": edges}


def graph_summary(graph: fx.Graph, block: str | None) -> dict:
    """Plain-data summary of ``block`` (one repeated layer; the whole graph when ``None``)
    and of the whole model with repeated blocks collapsed. JSON-serialisable."""
    nodes, external, outputs = block_nodes(graph, block)
    model = model_segments(graph)
    kind = _kind(block) if block else ""
    repeats = next((s["repeats"] for s in model["segments"] if s["label"] == kind), 1) if block else 1
    return {"block": block or "", "kind": kind, "repeats": repeats, "nodes": nodes, "external": external,
            "outputs": outputs, "model": model}
