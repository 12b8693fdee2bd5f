"""Terminal rendering of a :class:`~opfuse.report.data.FusionReport` with ``rich``."""

from __future__ import annotations

import io

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

MB = 1e6
_COLOUR = {"fused": "green", "rejected": "yellow", "reverted": "red"}


def region_table(report, show: str = "all", limit: int | None = None, block: str | None = None) -> Table:
    """Table of regions: pattern, decision, reason, bytes before/after (MB), ρ, I (FLOP/B).
    With ``block``, only regions of that block and those outside any block."""
    title = "Regions" + (f" of {block} and outside the repeated blocks" if block else "")
    table = Table(title=title, show_lines=False, expand=False)
    for col, kw in [("pattern", {}), ("anchor", {}), ("decision", {}), ("MB before", {"justify": "right"}),
                    ("MB after", {"justify": "right"}), ("ρ", {"justify": "right"}),
                    ("I (FLOP/B)", {"justify": "right"}), ("max err", {"justify": "right"}),
                    ("reason", {"overflow": "fold", "max_width": 60})]:
        table.add_column(col, **kw)
    rows = [r for r in report.regions if (show == "all" or r.decision == show)
            and (block is None or r.block in (block, ""))]
    for r in rows[:limit]:
        table.add_row(f"{r.pattern}/{r.variant}", r.anchor, Text(r.decision, style=_COLOUR.get(r.decision, "")),
                      f"{r.bytes_unfused / MB:.3f}", f"{r.bytes_fused / MB:.3f}", f"{r.rho:.2f}",
                      f"{r.intensity:.1f}", "" if r.verify_error is None else f"{r.verify_error:.1e}", r.reason)
    if limit is not None and len(rows) > limit:
        table.caption = f"... {len(rows) - limit} more regions (report.to_dict() has them all)"
    return table


def pattern_table(report) -> Table:
    """One row per pattern: regions fused / matched, traffic before/after (MB), mean ρ, I."""
    table = Table(title="Per pattern (MB and I of the fused regions; mean ρ over all matches)")
    for col in ("pattern", "fused / matched", "MB before", "MB after", "mean ρ", "I (FLOP/B)"):
        table.add_column(col, justify="left" if col == "pattern" else "right")
    groups: dict[str, list] = {}
    for r in report.regions:
        groups.setdefault(r.pattern, []).append(r)
    for name, rows in groups.items():
        fused = [r for r in rows if r.decision == "fused"]
        before = sum(r.bytes_unfused for r in fused) / MB
        after = sum(r.bytes_fused for r in fused) / MB
        mean_rho = sum(r.rho for r in rows) / len(rows)  # over every match, fused or not
        inten = sum(r.flops for r in fused) / max(1, sum(r.bytes_fused for r in fused))
        table.add_row(name, f"{len(fused)} / {len(rows)}", f"{before:.2f}" if fused else "–",
                      f"{after:.2f}" if fused else "–", f"{mean_rho:.2f}", f"{inten:.1f}" if fused else "–")
    return table


def near_miss_table(report) -> Table:
    table = Table(title="Near misses (came close, did not fuse)")
    table.add_column("pattern")
    table.add_column("node")
    table.add_column("reason", overflow="fold", max_width=90)
    for nm in report.near_misses:
        table.add_row(f"{nm['pattern']}/{nm['variant']}", nm["node"], nm["reason"])
    return table


def gemm_table(report) -> Table:
    """One row per GEMM shape and op: backend chosen (``opfuse.gemm``), how many nodes, the
    measured median time of each backend (ms), the weight copies kept (pre-transposed or
    prepacked, MiB) and why."""
    table = Table(title="GEMM backends (measured per shape, cached)")
    for col in ("op", "M×K×N", "nodes", "backend", "median ms per backend", "extra MiB", "why"):
        table.add_column(col, justify="right" if col in ("nodes", "extra MiB") else "left")
    groups: dict[tuple, list] = {}
    for g in report.gemm:
        groups.setdefault((g["op"], g["m"], g["k"], g["n"], g["backend"]), []).append(g)
    for (op, m, k, n, backend), rows in groups.items():
        times = "  ".join(f"{name} {1e3 * t:.3f}" for name, t in rows[0]["times_s"].items())
        extra = sum(g.get("extra_bytes", 0) for g in rows) / 2**20
        table.add_row(op, f"{m}×{k}×{n}", str(len(rows)), backend, times, f"{extra:.2f}", rows[0]["reason"])
    return table


def precision_line(report) -> str:
    """One line on ``precision=``: how many GEMM regions run in bf16 (by kind: plain GEMM,
    + bias / GELU, fused op, attention), the budget, the end-to-end error against the
    float32 plan, regions put back, the bf16 SkipLayerNorms and bf16-in/out attentions, and
    the CPU's bf16 support."""
    p = report.precision
    gemms = p.get("gemms", [])
    low = sum(g["precision"] == "bf16" for g in gemms)
    e2e = p.get("end_to_end")
    check = (f"; whole model vs float32: max error {e2e['max_error']:.1e}, min cosine {e2e['min_cosine']:.6f}"
             + (f" (worst of {e2e['inputs']} input sizes)" if e2e.get("inputs") else "") if e2e else "")
    back = f"; {p['reverted']} put back to float32 by the whole-model check" if p.get("reverted") else ""
    if p.get("add_layernorm_bf16"):
        back += f"; {p['add_layernorm_bf16']} add + LayerNorm after a bf16 GEMM fused (float32 and bf16 out"
        back += f", {p['add_layernorm_bf16_inplace']} in place)" if p.get("add_layernorm_bf16_inplace") else ")"
    if p.get("attention_bf16_io"):
        back += f"; {p['attention_bf16_io']} bf16 attentions read and write bf16"
        if p.get("direct_sdpa"):
            back += f" ({p['direct_sdpa']} as ATen's SDPA called directly)"
    kinds: dict = {}
    for g in gemms:
        if g["precision"] == "bf16":
            kind = g.get("region", "gemm")
            kinds[kind] = kinds.get(kind, 0) + 1
    which = f" ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})" if kinds else ""
    t = p.get("regions_time_s")
    if t and t.get("planned"):
        which += (f"; the regions' measured time {t['fp32'] * 1e3:.2f} → {t['planned'] * 1e3:.2f} ms "
                  f"({t['fp32'] / t['planned']:.2f}x)")
    return (f"{p['requested']} requested (tolerance {p['tolerance']:.0e} per region): {low} of {len(gemms)} GEMM "
            f"regions in bf16{which}{check}{back} — {p.get('note', '')}")


def totals_text(report) -> Text:
    t = report.totals
    per = ", ".join(f"{k} {v}" for k, v in sorted(t["per_pattern"].items())) or "none"
    err = "not checked" if t["max_error"] is None else f"{t['max_error']:.2e}"
    return Text.assemble(
        ("Memory traffic: ", "bold"), f"{t['bytes_unfused'] / MB:.2f} MB -> {t['bytes_fused'] / MB:.2f} MB "
        f"({100 * t['reduction']:.1f}% less)\n",
        ("Fused regions: ", "bold"), f"{t['fused_regions']} ({per})\n",
        ("Verification: ", "bold"), ("per region on the example inputs" if report.verified
                                     else "SKIPPED (verify=False)") + f"; max model error {err} "
        "(max|Δ| / max(1, max|ref|) over the outputs)")


def header_text(report) -> Text:
    return Text.assemble(("opfuse ", "bold cyan"), f"{report.version}  model {report.model}  "
                         f"inputs {', '.join(report.inputs)}  dtype {report.dtype}  device {report.device}  "
                         f"θ={report.theta}")


def dynamic_line(report) -> str | None:
    """One line on the plan's shapes: the dynamic dims with their ranges, the token bucket
    it serves, the sizes it was decided and verified at; why a dynamic capture was refused;
    None for a static plan."""
    d = report.dynamic
    if not d:
        return None
    if "refused" in d:
        return d["refused"]
    sizes = lambda s: "×".join(str(v) for v in s.values())  # noqa: E731
    bucket = f" (for calls of {d['tokens'][0]}–{d['tokens'][1]} tokens)" if d.get("tokens") else ""
    line = (f"one plan{bucket} for " + "; ".join(d["dims"]) + f" — decided at {sizes(d['decided_at'])}, verified at "
            + (", ".join(sizes(s) for s in d["verified_at"]) or "none"))
    others = d.get("buckets", [])[1:]
    if others:  # the other token buckets' plans: kept or dropped, and why
        line += "; other token buckets: " + ", ".join(
            f"{r['tokens'][0]}–{r['tokens'][1]} {'kept' if r['kept'] else 'dropped'}"
            + (f" ({r['first_s'] / r['bucket_s']:.2f}x)" if r.get("bucket_s") else f" ({r['reason']})")
            for r in others)
    return line


def render(report, limit: int | None = 40, block_only: bool = True) -> Group:
    """Header, op sequence of one block before/after, regions (of the first repeated block
    unless ``block_only`` is False), per-pattern totals, traffic totals, near misses."""
    parts = [header_text(report)]
    if report.capture.get("mode") == "pieces":
        c = report.capture
        parts.append(Text.assemble(("Captured in pieces: ", "bold yellow"),
                                   f"torch.export could not capture the whole model ({c['reason']}); dynamo split "
                                   f"it into {c['pieces']} graph(s), each fused on its own, the code between them "
                                   "runs eagerly" + ("; run unfused: " + "; ".join(c["unfused"]) if c["unfused"] else "")))
    if dynamic_line(report):
        parts.append(Text.assemble(("Dynamic shapes: ", "bold"), dynamic_line(report)))
    first = next((r.block for r in report.regions if r.block), "")
    if report.ops_before:
        parts.append(Text.assemble((f"one block ({first or 'whole graph'}) before: ", "bold"),
                                   " ".join(report.ops_before)))
        parts.append(Text.assemble((f"one block ({first or 'whole graph'}) after:  ", "bold"),
                                   " ".join(report.ops_after)))
    table = region_table(report, limit=limit, block=first if block_only else None)
    parts += [table, pattern_table(report), totals_text(report)]
    if getattr(report, "shared_masks", 0):
        parts.append(Text.assemble(("Attention masks: ", "bold"), f"{report.shared_masks} boolean mask(s) made additive "
                                   "(0 / −inf) once and read by every attention call, instead of converted per call"))
    if getattr(report, "inplace_writes", 0) or getattr(report, "rope_cache_writes", 0):
        fused = getattr(report, "rope_cache_writes", 0)
        parts.append(Text.assemble(("KV cache: ", "bold"), f"{report.inplace_writes} write(s) in place (no copy of the "
                                   "cache)" + (f"; {fused} layer(s) write k's RoPE and v straight into the cache "
                                               "(rope_qk_cache)" if fused else "")))
    if report.gemm:
        parts.append(gemm_table(report))
    if getattr(report, "precision", None):
        parts.append(Text.assemble(("Precision: ", "bold"), precision_line(report)))
    if report.near_misses:
        parts.append(near_miss_table(report))
    else:
        parts.append(Text("Near misses: none (no pattern came close without matching; every full match is "
                          "in the region table with its decision)"))
    return Group(*parts)


def wide_console() -> Console:
    """A console at least 150 columns wide (rich defaults to 80 when not on a terminal)."""
    console = Console()
    if not console.is_terminal or console.width < 150:
        console = Console(width=max(150, console.width))
    return console


def print_report(report, console: Console | None = None, limit: int | None = 40) -> None:
    (console or wide_console()).print(render(report, limit))


def render_text(report, width: int = 160) -> str:
    """The report as plain text (no colour codes)."""
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(render(report, limit=None, block_only=False))
    return console.export_text()


def generation_table(plans: list[dict], summary: dict | None = None) -> Table:
    """The prefill and decode plans of ``fused.generation`` (:meth:`Generation.plans`):
    phase, input signature, fused regions per pattern, ops dispatched per call, calls and
    fallbacks; the caption gives the latest call's prefill seconds and decode step (ms)."""
    table = Table(title="Generation plans (prefill and decode step)")
    for col in ("phase", "fused per pattern", "ops per call", "calls (fused / unfused)", "fallbacks"):
        table.add_column(col, overflow="fold", max_width=60 if col == "fallbacks" else None)
    for p in plans:
        fused = ", ".join(f"{k} {v}" for k, v in sorted(p["fused"].items())) or "none"
        table.add_row(p["phase"], fused, str(p["ops"] if p["ops"] is not None else "–"),
                      f"{p['calls'].get('fused', 0)} / {p['calls'].get('fallback', 0)}",
                      "; ".join(p["fallbacks"]) or "–")
    if summary and summary.get("decode_step_s"):
        table.caption = (f"last call: prefill {summary['prefill_s'] * 1e3:.1f} ms, decode step "
                         f"{summary['decode_step_s'] * 1e3:.2f} ms ({summary['decode_tokens_per_s']:.1f} tok/s), "
                         f"cache {summary['cache_tokens']} tokens")
    return table
