"""Fused CPU kernels (torch.ops.opfuse.*) vs their unfused eager ops, one thread.

    .venv/bin/python benchmarks/bench_kernels.py [--sizes quick|full] [--threads 1] [--json PATH]

Prints time, speed-up, GB/s (bytes read + written once) and the fraction of this machine's
measured copy bandwidth; writes benchmarks/results/cpu_kernels_t{threads}.json / .csv with
the machine description. The harness is src/opfuse/bench/kernels.py.
"""

from __future__ import annotations

import argparse

import torch

from opfuse.bench import machine
from opfuse.bench.kernels import kernels_table, run
from opfuse.bench.models import set_threads
from opfuse.bench.results import RESULTS_DIR, write_csv, write_json
from opfuse.report.text import wide_console


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="full", choices=["quick", "full"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", default=None, help="default: benchmarks/results/cpu_kernels_t{threads}.json")
    ns = ap.parse_args()
    set_threads(ns.threads)
    console = wide_console()
    desc = machine.describe()
    with console.status("kernels") as status:
        result = run(ns.sizes, ns.repeat, log=status.update)
    desc["loadavg_end"] = machine.load_average()
    result = {"machine": desc, "threads": torch.get_num_threads(), "sizes": ns.sizes, **result}
    console.print(kernels_table(result))
    console.print("[dim]shared, noisy machine: medians of interleaved runs; compare ratios, not absolute ms[/]")
    path = ns.json or RESULTS_DIR / f"cpu_kernels_t{ns.threads}.json"
    write_json(result, path)
    write_csv(result["rows"], str(path).removesuffix(".json") + ".csv")
    console.print(f"wrote {path} (+ .csv)")


if __name__ == "__main__":
    main()
