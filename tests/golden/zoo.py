"""Golden plans of the Hugging Face architecture tier (src/opfuse/zoo.py): per
(architecture, attention implementation), the fused-region count per pattern and the
regions matched per pattern, in tests/golden/zoo.json.

Regenerate (then REVIEW the diff: a changed count is a behaviour change):
    .venv/bin/python tests/golden/zoo.py --write
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

# the test tier's decisions (tests/cpu/conftest.py): traffic gate, static CPU profile
os.environ.setdefault("OPFUSE_DECIDE", "rho")
os.environ.setdefault("OPFUSE_MEASURE_DEVICE", "0")

PATH = Path(__file__).parent / "zoo.json"


def key(arch, attn: str) -> str:
    return f"{arch.name}/{attn}"


def expected(entry: dict) -> dict:
    """A golden entry as this environment's transformers should plan it: ``by_transformers``
    ({"5.25": {...}}) overrides fields from that transformers version on (a newer release
    spelled a model's ops differently, e.g. Falcon's multi-query attention in 5.25 expands
    its one K/V head, so the GQA variant matches too and its subset rejected by overlap
    is counted as matched)."""
    import transformers
    from packaging.version import Version
    have = Version(transformers.__version__)
    out = {k: v for k, v in entry.items() if k != "by_transformers"}
    for since, fields in sorted(entry.get("by_transformers", {}).items(), key=lambda kv: Version(kv[0])):
        if have >= Version(since):
            out.update(fields)
    return out


def plan(arch, attn: str):
    """(record, model, fused, args, kwargs, optimize seconds) at the row's first size."""
    import opfuse
    model = arch.build(attn)
    batch, seq = arch.sizes[0]
    args, kwargs = arch.inputs(model, batch, seq)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = opfuse.optimize(model, args, example_kwargs=kwargs, name=arch.name)
    seconds = time.perf_counter() - start
    report = fused.report
    record = {
        "fused": dict(sorted(report.counts().items())),
        "matched": dict(sorted({p: sum(r.pattern == p for r in report.regions)
                                for p in {r.pattern for r in report.regions}}.items())),
        "capture": report.capture.get("mode"),
    }
    return record, model, fused, args, kwargs, seconds


def unfused_reasons(fused) -> list[str]:
    """Why blocks stayed unfused: near misses and legality refusals (not ρ or overlaps),
    one line per distinct reason with node names stripped."""
    import re
    seen: dict[str, None] = {}
    def line(pattern: str, reason: str) -> str:
        return reason if reason.startswith(pattern) or reason.startswith("illegal") else f"{pattern}: {reason}"
    lines = [line(m["pattern"], m["reason"]) for m in fused.report.near_misses]
    lines += [line(r.pattern, r.reason) for r in fused.report.regions
              if r.decision != "fused" and r.gate == "legality"]
    for line in lines:
        line = re.sub(r" (anchored )?at [A-Za-z_]+[0-9_]*(?=[:,) ]|$)", "", line)
        seen.setdefault(line, None)
    return list(seen)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[2] / "src"))
    from opfuse import zoo
    golden = {}
    for arch, attn in zoo.cases():
        record, *_, seconds = plan(arch, attn)
        golden[key(arch, attn)] = record
        print(key(arch, attn), json.dumps(record), f"{seconds:.1f} s", flush=True)
    if "--write" in sys.argv:  # the per-version overrides are kept: review them with the diff
        old = json.loads(PATH.read_text()) if PATH.exists() else {}
        for k, record in golden.items():
            if "by_transformers" in old.get(k, {}):
                record["by_transformers"] = old[k]["by_transformers"]
        PATH.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
