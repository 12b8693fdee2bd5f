"""The README's per-architecture table, from the architecture tier (src/opfuse/zoo.py).

For every architecture (eager and SDPA attention; one row when both plan the same) it
prints fused / blocks for attention and the MLP, the norms and RoPE regions fused, the QKV
merges, and why what stays unfused did (legality refusals and near misses, node names
stripped). Decisions by the traffic gate (``OPFUSE_DECIDE=rho``), as the golden plans.

    .venv/bin/python benchmarks/zoo_table.py            # markdown on stdout
    .venv/bin/python benchmarks/zoo_table.py --json benchmarks/results/zoo_table.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OPFUSE_DECIDE", "rho")
os.environ.setdefault("OPFUSE_MEASURE_DEVICE", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "golden"))
sys.path.insert(0, str(ROOT / "src"))

NORMS = {"add_layernorm": "add+LN", "linear_add_layernorm": "linear+add+LN", "rmsnorm": "RMSNorm",
         "add_rmsnorm": "add+RMSNorm", "layernorm_gelu": "LN+GELU"}
MLPS = {"ffn": "FFN", "swiglu": "SwiGLU", "geglu": "GeGLU", "bias_gelu": "bias+GELU"}


def _cell(fused: dict, names: dict) -> str:
    parts = [f"{label} {fused[p]}" for p, label in names.items() if fused.get(p)]
    return ", ".join(parts) or "–"


def row(arch, attn: str) -> dict:
    import zoo as golden_zoo  # tests/golden/zoo.py
    record, _, fused, *_ = golden_zoo.plan(arch, attn)
    counts, blocks = record["fused"], arch.block_counts
    mlp = sum(counts.get(p, 0) for p in ("ffn", "swiglu", "geglu", "bias_gelu"))
    return {
        "arch": arch.name, "attn": attn,
        "attention": f"{counts.get('attention', 0)}/{blocks['attention']}",
        "mlp": f"{_cell(counts, MLPS)} ({mlp}/{blocks['mlp']})",
        "norms": _cell(counts, NORMS),
        "rope": str(counts.get("rope", "–")),
        "qkv": str(counts.get("qkv_merge", "–")),
        "unfused": list(arch.notes) + golden_zoo.unfused_reasons(fused),
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| architecture | attention | MLP | norms fused | RoPE | QKV merge | what stays unfused, and why |",
             "|---|---|---|---|---|---|---|"]
    merged: list[dict] = []
    for r in rows:  # eager and sdpa rows that plan alike become one
        prev = merged[-1] if merged else None
        same = prev and prev["arch"] == r["arch"] and all(prev[k] == r[k] for k in
                                                          ("attention", "mlp", "norms", "rope", "qkv", "unfused"))
        if same:
            prev["attn"] += " + " + r["attn"]
        else:
            merged.append(dict(r))
    for r in merged:
        why = "; ".join(r["unfused"][:3]).replace("|", "\\|") or "–"
        lines.append(f"| {r['arch']} ({r['attn']}) | {r['attention']} | {r['mlp']} | {r['norms']} | {r['rope']} | "
                     f"{r['qkv']} | {why} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--only", nargs="*", help="architecture names (default: all)")
    opts = ap.parse_args()
    import warnings

    from opfuse import zoo
    warnings.simplefilter("ignore")
    rows = [row(a, attn) for a, attn in zoo.cases() if not opts.only or a.name in opts.only]
    print(markdown(rows))
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
