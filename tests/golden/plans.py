"""Golden fusion plans per model family: pattern -> fused-region count, checked in CI.

Regenerate (then REVIEW the diff: a changed count is a behaviour change):
    .venv/bin/python tests/golden/plans.py --write
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The test tier's decisions (tests/cpu/conftest.py): the traffic gate and the static CPU
# profile, so that a golden plan does not depend on this machine's timings.
os.environ.setdefault("OPFUSE_DECIDE", "rho")
os.environ.setdefault("OPFUSE_MEASURE_DEVICE", "0")

HERE = Path(__file__).parent

# (model, attention implementation, batch, seq): small configs, shapes where the cost
# model's decisions are stable (not near θ).
CASES = [(m, attn, b, s) for m, b, s in [("bert-tiny", 4, 64), ("gpt2-tiny", 2, 64), ("llama-tiny", 2, 64),
                                         ("vit-tiny", 4, 0)] for attn in ("eager", "sdpa")]


def path_of(model: str, attn: str) -> Path:
    return HERE / f"{model}-{attn}.json"


def plan(model: str, attn: str, batch: int, seq: int) -> tuple[dict, object, object]:
    """(golden record, loaded model, fused module) for one case."""
    import opfuse
    from opfuse.models import load
    loaded = load(model, batch=batch, seq=seq, attn=attn)
    fused = opfuse.optimize(loaded.model, loaded.args, name=model)
    report = fused.report
    record = {
        "model": model, "attn": attn, "batch": batch, "seq": seq, "theta": report.theta,
        "fused": dict(sorted(report.counts().items())),
        "matched": dict(sorted({p: sum(r.pattern == p for r in report.regions)
                                for p in {r.pattern for r in report.regions}}.items())),
    }
    return record, loaded, fused


if __name__ == "__main__":
    for case in CASES:
        record, _, _ = plan(*case)
        if "--write" in sys.argv:
            path_of(case[0], case[1]).write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record))
