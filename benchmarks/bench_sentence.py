"""sentence-transformers client: SentenceTransformer.encode() of real sentences (installed
packages' READMEs, opfuse.models.package_sentences) with all-MiniLM-L6-v2's real weights,
unoptimized vs opfuse.sentence.optimize, interleaved rounds in one process, one thread.

    .venv/bin/python benchmarks/bench_sentence.py --sentences 300 --rounds 3

Reports the median encode() seconds per batch size, the speed-up, the smallest cosine
between the two embeddings of each sentence, the number of opfuse plans (1: no re-plan)
and optimize's own time; writes benchmarks/results/cpu_sentence_minilm_t1.json.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parents[1] / "src"))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentences", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--threads", type=int, default=1)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    from sentence_transformers import SentenceTransformer

    import opfuse.sentence
    from opfuse.bench.machine import describe
    from opfuse.models import minilm_dir, package_sentences
    sents = package_sentences(ns.sentences)
    ref = SentenceTransformer(str(minilm_dir()), device="cpu")
    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    t = time.perf_counter()
    fused = opfuse.sentence.optimize(st)
    optimize_s = time.perf_counter() - t
    rows = []
    for bs in map(int, ns.batch_sizes.split(",")):
        times = {"eager": [], "opfuse": []}
        for r in range(ns.rounds + 1):
            for name, model in (("eager", ref), ("opfuse", st)) if r % 2 == 0 else (("opfuse", st), ("eager", ref)):
                t = time.perf_counter()
                emb = model.encode(sents, batch_size=bs, convert_to_tensor=True)
                if r:  # round 0 warms up
                    times[name].append(time.perf_counter() - t)
                if name == "eager":
                    a = emb
                else:
                    b = emb
        cos = float(torch.nn.functional.cosine_similarity(a, b).min())
        e, o = statistics.median(times["eager"]), statistics.median(times["opfuse"])
        rows.append({"batch_size": bs, "eager_s": e, "opfuse_s": o, "speedup": e / o, "min_cosine": cos})
        print(f"batch {bs:3d}: eager {e:.2f} s, opfuse {o:.2f} s ({e / o:.2f}x), min cosine {cos:.7f}")
    result = {"sentences": len(sents), "words": [min(len(s.split()) for s in sents), max(len(s.split()) for s in sents)],
              "optimize_s": optimize_s, "plans": len(fused.reports), "replans": list(fused.replans),
              "fused": fused.report.counts(), "rows": rows, "machine": describe()}
    print(f"optimize {optimize_s:.1f} s; {len(fused.reports)} plan(s); fused {fused.report.counts()}")
    out = Path(__file__).parent / "results" / f"cpu_sentence_minilm_t{ns.threads}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
