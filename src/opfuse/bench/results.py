"""Result files under ``benchmarks/results/``: one JSON per run (machine description
included) and a flat CSV of its rows."""

from __future__ import annotations

import csv
import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def write_json(data: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def write_csv(rows: list[dict], path) -> Path:
    """Rows of scalars (nested values are written as JSON text)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()})
    return path
