"""One self-contained HTML page for a :class:`~opfuse.report.data.FusionReport`.

    report.to_html("report.html")        # or: opfuse optimize MODEL --report report.html

Sections: a header (model, shapes, dtype, device, θ, totals, version); the captured
graph of one repeated block drawn by Graphviz ``dot`` as SVG, each fused region an
outlined cluster coloured by pattern (``<g id="region-<i>" class="cluster region fused">``,
``i`` = index in ``report.regions``), rejected candidates as dashed notes; the whole
model with repeated blocks collapsed into ``×N``; a sortable region table whose cells
carry the raw numbers (``data-key``/``data-value``, equal to ``report.to_dict()``);
near misses; plotly charts (traffic per pattern, roofline of the device profile).

Nothing is loaded from the network: the SVG is inline and plotly's JavaScript is
embedded once. Without ``dot`` on PATH the page is still written, with a note where
the pictures would be. A small ``window.onerror`` hook records JavaScript errors in the
``data-js-errors`` attribute of ``<html>`` (the browser test reads it).
"""

from __future__ import annotations

import html
import json
import math
import shutil
import subprocess
import textwrap
from pathlib import Path

from .text import dynamic_line

DOT = "dot"                       # Graphviz executable (tests point it elsewhere)
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f",
           "#17becf", "#bcbd22"]
REJECTED = "#c0392b"
COLUMNS = [  # (key in RegionRecord, header, kind)
    ("pattern", "pattern", "text"), ("variant", "variant", "text"), ("block", "block", "text"),
    ("anchor", "anchor", "text"), ("nodes", "nodes", "nodes"), ("decision", "decision", "text"),
    ("bytes_unfused", "bytes before", "bytes"), ("bytes_fused", "bytes after", "bytes"),
    ("rho", "ρ", "num"), ("flops", "FLOPs", "flops"), ("intensity_unfused", "I before (FLOP/B)", "num"),
    ("intensity", "I after (FLOP/B)", "num"), ("time_unfused_s", "t before", "time"),
    ("time_fused_s", "t after", "time"), ("measured_unfused_s", "measured before", "time"),
    ("measured_fused_s", "measured after", "time"), ("gate", "decided by", "text"),
    ("verify_error", "verify error", "err"), ("reason", "reason", "text"),
]


# ----------------------------------------------------------------------------- helpers

def esc(value) -> str:
    return html.escape(str(value), quote=True)


def _dq(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def human_flops(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def human_time(s: float) -> str:
    return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def pattern_colours(report) -> dict[str, str]:
    names = sorted({r.pattern for r in report.regions})
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def _tint(colour: str, amount: float = 0.78) -> str:
    """``colour`` mixed with white (``amount`` of white)."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def _shape_text(shape) -> str:
    return "×".join(str(s) for s in shape) if shape else ""


# ----------------------------------------------------------------------------- graphs (DOT)

def block_dot(report, colours: dict[str, str]) -> str:
    """DOT source of the report's block: fused regions as clusters, rejected candidates as notes."""
    g = report.block_graph
    nodes = {n["name"]: n for n in g["nodes"]}
    members: dict[str, int] = {}          # node name -> index of its fused region
    in_any_region = set()
    for i, r in enumerate(report.regions):
        inside = [name for name in r.nodes if name in nodes]
        in_any_region.update(inside)
        if r.decision == "fused":
            for name in inside:
                members.setdefault(name, i)
    collapsed = {name for name, n in nodes.items() if n["view"] and name not in in_any_region}

    def source(name: str) -> str:
        while name in collapsed and nodes[name]["inputs"]:
            name = nodes[name]["inputs"][0]
        return name

    def node_line(n: dict) -> str:
        shape = _shape_text(n["shape"])
        if n["view"]:
            label = f'<<FONT POINT-SIZE="9" COLOR="#666666">{esc(n["op"])}</FONT>>'
            style = 'shape=box, style="rounded", color="#aaaaaa", height=0.2'
        else:
            label = f'<{esc(n["op"])}<BR/><FONT POINT-SIZE="8" COLOR="#777777">{esc(shape)}</FONT>>'
            style = 'shape=box, style="rounded,filled", fillcolor="#ffffff"'
        tip = f'{n["name"]} = {n["target"]} {shape} {n["module"]}'.strip()
        return f'  {_dq(n["name"])} [id={_dq("n-" + n["name"])}, label={label}, tooltip={_dq(tip)}, {style}];'

    lines = ["digraph block {",
             '  graph [rankdir=TB, nodesep=0.25, ranksep=0.28, fontname="Helvetica", fontsize=11, '
             'bgcolor="transparent", newrank=true];',
             '  node [fontname="Helvetica", fontsize=11, color="#555555", margin="0.12,0.03", height=0.3];',
             '  edge [color="#8a8a8a", arrowsize=0.6];']
    drawn = [n for n in g["nodes"] if n["name"] not in collapsed]
    for i, r in enumerate(report.regions):
        inside = [n for n in drawn if members.get(n["name"]) == i]
        if not inside:
            continue
        c = colours[r.pattern]
        lines += [f"  subgraph cluster_region_{i} {{",
                  f'    id={_dq(f"region-{i}")}; class={_dq(f"region fused pattern-{r.pattern}")};',
                  f'    label=<<B>{esc(r.pattern)}</B> <FONT POINT-SIZE="9">ρ={r.rho:.2f}</FONT>>; '
                  f'labeljust=l; fontcolor={_dq(c)};',
                  f'    style="filled,rounded"; color={_dq(c)}; fillcolor={_dq(_tint(c))}; penwidth=2;',
                  f'    tooltip={_dq(f"{r.pattern}/{r.variant}: {r.reason}")};']
        lines += ["  " + node_line(n) for n in inside]
        lines.append("  }")
    lines += [node_line(n) for n in drawn if n["name"] not in members]
    for e in g["external"]:
        label = f'{e["name"]}\\n{_shape_text(e["shape"])}'
        lines.append(f'  {_dq(e["name"])} [id={_dq("in-" + e["name"])}, label="{label}", shape=box, '
                     f'style="dashed,rounded", fontsize=9, fontcolor="#666666", color="#999999"];')
    edges = []
    for n in drawn:
        for a in n["inputs"]:
            src = source(a)
            if (src, n["name"]) not in edges and src != n["name"]:
                edges.append((src, n["name"]))
    lines += [f"  {_dq(a)} -> {_dq(b)};" for a, b in edges]
    if g["outputs"]:
        lines.append('  "__out" [label="block output", shape=box, style="dashed,rounded", fontsize=9, '
                     'fontcolor="#666666", color="#999999"];')
        lines += [f'  {_dq(source(o))} -> "__out";' for o in g["outputs"]]
    for i, r in enumerate(report.regions):
        if r.decision == "fused" or r.anchor not in nodes:
            continue
        mark = "✗" if r.decision == "rejected" else "↺ reverted:"
        reason = "\n".join(textwrap.wrap(r.reason, 34)[:3])
        lines.append(f'  "rej{i}" [id={_dq(f"rejected-{i}")}, class="rejected", shape=note, '
                     f'style="dashed,filled", fillcolor="#fff6f5", color="{REJECTED}", fontcolor="{REJECTED}", '
                     f'fontsize=8, label={_dq(f"{mark} {r.pattern}/{r.variant}" + chr(10) + reason)}, '
                     f'tooltip={_dq(f"{r.decision}: {r.pattern}/{r.variant} at {r.anchor}: {r.reason}")}];')
        lines.append(f'  {_dq(source(r.anchor))} -> "rej{i}" [style=dashed, color="{REJECTED}", arrowhead=none];')
    lines.append("}")
    return "\n".join(lines)


def model_dot(report) -> str:
    """DOT source of the whole model: inputs, top-level modules, repeated blocks as ``×N``."""
    model = report.block_graph["model"]
    fused_per_kind: dict[str, int] = {}
    for r in report.fused:
        kind = r.block.rstrip("0123456789") + "#" if r.block else "(outside blocks)"
        fused_per_kind[kind] = fused_per_kind.get(kind, 0) + 1
    lines = ["digraph model {",
             '  graph [rankdir=LR, nodesep=0.2, ranksep=0.35, bgcolor="transparent", fontname="Helvetica"];',
             '  node [fontname="Helvetica", fontsize=10, shape=box, style="rounded,filled", '
             'fillcolor="#ffffff", color="#555555"];',
             '  edge [color="#8a8a8a", arrowsize=0.6];']
    for s in model["segments"]:
        if s["repeats"] > 1:
            first, last = s["blocks"][0], s["blocks"][-1]
            fused = fused_per_kind.get(s["label"], 0)
            label = (f'<<B>{esc(s["label"])} ×{s["repeats"]}</B><BR/><FONT POINT-SIZE="8">{esc(first)} … '
                     f'{esc(last)}<BR/>{s["ops"] // s["repeats"]} ops per block, {fused} fused regions</FONT>>')
            extra = ', penwidth=2, fillcolor="#eef3fa", color="#4e79a7"'
        elif s["ops"] == 0:
            label = f'<{esc(s["label"])}>'
            extra = ', shape=ellipse, style="dashed", fontcolor="#555555"'
        else:
            label = f'<{esc(s["label"])}<BR/><FONT POINT-SIZE="8">{s["ops"]} ops</FONT>>'
            extra = ""
        lines.append(f'  {s["id"]} [id={_dq("seg-" + s["label"])}, label={label}{extra}];')
    lines += [f"  {a} -> {b};" for a, b in model["edges"]]
    lines.append("}")
    return "\n".join(lines)


def render_svg(dot_source: str) -> tuple[str | None, str | None]:
    """(inline SVG, None) or (None, a note saying why there is no picture)."""
    exe = shutil.which(DOT)
    if exe is None:
        return None, ("Graphviz <code>dot</code> was not found on PATH, so the graph is not drawn "
                      "(install Debian's <code>graphviz</code>, e.g. <code>make install</code>). "
                      "The region table below has the same regions.")
    try:
        done = subprocess.run([exe, "-Tsvg"], input=dot_source, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"Graphviz <code>dot</code> failed: {esc(exc)}"
    if done.returncode != 0 or "<svg" not in done.stdout:
        return None, f"Graphviz <code>dot</code> failed: <pre>{esc(done.stderr[-2000:])}</pre>"
    svg = done.stdout[done.stdout.index("<svg"):]
    head, rest = svg.split(">", 1)            # let CSS size it: drop the fixed pt width/height
    head = " ".join(part for part in head.split(" ") if not part.startswith(("width=", "height=")))
    return head + ">" + rest, None


# ----------------------------------------------------------------------------- plots (plotly)

def _plotly_divs(report, colours: dict[str, str], device) -> tuple[str, list[str]]:
    """(plotly.js source, [traffic bars div, roofline div]); ('', [notes]) without plotly."""
    try:
        import plotly.graph_objects as go
        from plotly.offline import get_plotlyjs
    except ImportError:
        note = '<p class="note">plotly is not installed (<code>pip install plotly</code>): no charts.</p>'
        return "", [note, note]
    config = {"displaylogo": False, "responsive": True}
    layout = dict(template="plotly_white", margin=dict(l=60, r=20, t=50, b=50), height=380,
                  font=dict(family="Helvetica, Arial, sans-serif", size=12),
                  legend=dict(orientation="h", y=-0.2))

    groups: dict[str, list] = {}
    for r in report.fused:
        groups.setdefault(r.pattern, []).append(r)
    names = sorted(groups)
    before = [sum(r.bytes_unfused for r in groups[p]) / 1e6 for p in names]
    after = [sum(r.bytes_fused for r in groups[p]) / 1e6 for p in names]
    bars = go.Figure([
        go.Bar(name="unfused", x=names, y=before, marker_color="#bab0ac",
               hovertemplate="%{x}: %{y:.3f} MB unfused<extra></extra>"),
        go.Bar(name="fused", x=names, y=after, marker_color=[colours[p] for p in names],
               hovertemplate="%{x}: %{y:.3f} MB fused<extra></extra>",
               text=[f"−{100 * (1 - a / b):.0f}%" if b else "" for a, b in zip(after, before)],
               textposition="outside")])
    bars.update_layout(title="Memory traffic of the fused regions, per pattern", barmode="group",
                       yaxis_title="MB (all regions of the pattern)", **layout)

    roof = go.Figure()
    pts = [r for r in report.regions if r.intensity > 0 and r.intensity_unfused > 0]
    lo = min([r.intensity_unfused for r in pts] + [0.1]) / 3
    hi = max([r.intensity for r in pts] + [10 * device.peak_flops / device.bandwidth]) * 3
    xs = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    ridge = device.peak_flops / device.bandwidth
    roof.add_trace(go.Scatter(x=xs, y=[min(device.peak_flops, x * device.bandwidth) for x in xs], mode="lines",
                              name=f"roof: {device.bandwidth / 1e9:.0f} GB/s, {device.peak_flops / 1e9:.0f} GFLOP/s",
                              line=dict(color="#333333", width=2), hoverinfo="skip"))

    def attainable(i: float) -> float:
        return min(device.peak_flops, i * device.bandwidth)

    for p in sorted({r.pattern for r in pts}):
        for decision, visible in (("fused", True), ("rejected", "legendonly")):
            rows = [r for r in pts if r.pattern == p and (r.decision == "fused") == (decision == "fused")]
            if not rows:
                continue
            x, y, text = [], [], []
            for r in rows:  # unfused point, fused point, gap: one segment per region
                x += [r.intensity_unfused, r.intensity, None]
                y += [attainable(r.intensity_unfused), attainable(r.intensity), None]
                label = f"{p}/{r.variant} at {r.anchor} ({decision})"
                text += [label + " — unfused", label + " — fused", None]
            roof.add_trace(go.Scatter(
                x=x, y=y, text=text, mode="lines+markers", name=f"{p} ({decision})", visible=visible,
                line=dict(color=colours[p], width=1, dash="solid" if decision == "fused" else "dot"),
                marker=dict(color=colours[p], size=9, symbol=["circle-open", "circle", "circle"] * len(rows)),
                hovertemplate="%{text}<br>I = %{x:.2f} FLOP/B<br>%{y:.3s}FLOP/s<extra></extra>"))
    roof.add_vline(x=ridge, line=dict(color="#999999", dash="dash", width=1),
                   annotation_text=f"ridge {ridge:.1f} FLOP/B", annotation_position="bottom right")
    roof.update_layout(title=f"Roofline of {device.name}: unfused ○ → fused ●", **layout)
    roof.update_xaxes(type="log", title="arithmetic intensity (FLOP/byte)", exponentformat="SI")
    roof.update_yaxes(type="log", title="attainable FLOP/s", exponentformat="SI")

    divs = [fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=config)
            for fig, div_id in ((bars, "plot-traffic"), (roof, "plot-roofline"))]
    return get_plotlyjs(), divs


# ----------------------------------------------------------------------------- page

_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;background:#f6f7f9;color:#222}
main{max-width:1680px;margin:0 auto;padding:16px 24px}
h1{font-size:22px;margin:4px 0 8px} h2{font-size:17px;margin:4px 0 10px}
.card{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:12px 16px;margin-bottom:16px}
.meta{display:grid;grid-template-columns:repeat(auto-fill,minmax(230px,1fr));gap:4px 18px;font-size:13px}
.meta b{color:#555;font-weight:600}
.totals{display:flex;gap:12px;flex-wrap:wrap;margin-top:10px}
.total{background:#f0f4fa;border-radius:6px;padding:6px 12px;min-width:150px}
.total .v{font-size:19px;font-weight:600} .total .k{font-size:11px;color:#666;text-transform:uppercase}
.grid{display:grid;grid-template-columns:minmax(420px,5fr) 7fr;gap:16px;align-items:start}
.graph svg{width:100%;height:auto;display:block}
.legend{display:flex;flex-wrap:wrap;gap:6px 14px;font-size:12px;margin:4px 0 8px}
.sw{display:inline-block;width:14px;height:11px;border-radius:3px;border:2px solid;vertical-align:-1px;margin-right:4px}
.note{background:#fff8e1;border:1px solid #f0d48a;border-radius:6px;padding:8px 12px;font-size:13px}
table{border-collapse:collapse;font-size:12px;width:100%}
th,td{padding:3px 7px;border-bottom:1px solid #eceef1;text-align:left;vertical-align:top}
th{background:#f3f4f6;position:sticky;top:0;cursor:pointer;user-select:none;white-space:nowrap}
th[data-sort=asc]::after{content:" ▲"} th[data-sort=desc]::after{content:" ▼"}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.fused td.decision{color:#2e7d32;font-weight:600} tr.rejected td.decision{color:#b26a00}
tr.reverted td.decision{color:#c62828;font-weight:600}
td.reason{max-width:520px} .muted{color:#777;font-size:12px}
.ops{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;word-break:break-word}
"""

_ERROR_HOOK = """
window.__opfuseErrors = [];
function __opfuseError(msg) {
  window.__opfuseErrors.push(String(msg));
  document.documentElement.setAttribute("data-js-errors", JSON.stringify(window.__opfuseErrors));
}
window.addEventListener("error", function (e) {
  __opfuseError((e.message || "error") + " @ " + (e.filename || "") + ":" + (e.lineno || ""));
}, true);
window.addEventListener("unhandledrejection", function (e) {
  __opfuseError("unhandled rejection: " + ((e.reason && e.reason.message) || e.reason));
});
(function () {
  var original = console.error;
  console.error = function () {
    __opfuseError("console.error: " + Array.prototype.join.call(arguments, " "));
    return original.apply(console, arguments);
  };
})();
"""

_SORT_JS = """
function __opfuseKey(td) {
  var v = td.getAttribute("data-value");
  if (v === null) v = td.textContent;
  return (v !== "" && isFinite(v)) ? [0, parseFloat(v)] : [1, v.toLowerCase()];
}
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("thead th").forEach(function (th, col) {
    th.addEventListener("click", function () {
      var asc = th.getAttribute("data-sort") !== "asc";
      table.querySelectorAll("thead th").forEach(function (h) { h.removeAttribute("data-sort"); });
      th.setAttribute("data-sort", asc ? "asc" : "desc");
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (a, b) {
        var x = __opfuseKey(a.cells[col]), y = __opfuseKey(b.cells[col]);
        var c = x[0] - y[0] || (x[1] < y[1] ? -1 : x[1] > y[1] ? 1 : 0);
        return asc ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
document.documentElement.setAttribute("data-plots", document.querySelectorAll(".js-plotly-plot").length);
document.documentElement.setAttribute("data-ready", "1");
"""


def _cell(key: str, kind: str, value) -> str:
    if kind == "nodes":
        return (f'<td class="n" data-key="nodes" data-value="{len(value)}" title="{esc(", ".join(value))}">'
                f"{len(value)}</td>")
    raw = "" if value is None else repr(value) if isinstance(value, float) else str(value)
    if kind == "text":
        return f'<td class="{esc(key)}" data-key="{esc(key)}" data-value="{esc(raw)}">{esc(value)}</td>'
    shown = ("" if value is None else
             human_bytes(value) if kind == "bytes" else human_flops(value) if kind == "flops" else
             human_time(value) if kind == "time" else f"{value:.1e}" if kind == "err" else
             f"{value:.2f}" if key == "rho" else f"{value:.1f}")
    return f'<td class="n" data-key="{esc(key)}" data-value="{esc(raw)}">{esc(shown)}</td>'


def region_table(report) -> str:
    head = "".join(f"<th>{esc(title)}</th>" for _key, title, _kind in COLUMNS)
    rows = []
    for i, r in enumerate(report.regions):
        cells = "".join(_cell(key, kind, getattr(r, key)) for key, _title, kind in COLUMNS)
        rows.append(f'<tr class="{esc(r.decision)}" data-region="{i}" id="row-{i}">{cells}</tr>')
    return (f'<table class="sortable" id="regions"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def near_miss_table(report) -> str:
    if not report.near_misses:
        return '<p class="muted">No near misses: every structural match went on to the cost model.</p>'
    rows = "".join(f'<tr><td>{esc(nm["pattern"])}/{esc(nm["variant"])}</td><td>{esc(nm["node"])}</td>'
                   f'<td class="reason">{esc(nm["reason"])}</td></tr>' for nm in report.near_misses)
    return ('<table class="sortable" id="near-misses"><thead><tr><th>pattern</th><th>node</th><th>reason</th>'
            f"</tr></thead><tbody>{rows}</tbody></table>")


def precision_card(report) -> str:
    """``precision=`` decisions: one row per GEMM region (its kind, precision, measured
    error, times, why) under the summary line; empty for a float32 plan."""
    p = getattr(report, "precision", None)
    if not p:
        return ""
    from .text import precision_line
    rows = "".join(
        f'<tr><td>{esc(g["node"])}</td><td>{esc(g.get("region", "gemm"))}</td><td>{g["m"]}×{g["k"]}×{g["n"]}</td>'
        f'<td>{esc(g["precision"])}</td>'
        f'<td>{g["error"]:.1e}</td><td>{esc("  ".join(f"{k} {human_time(v)}" for k, v in g["times_s"].items()))}</td>'
        f'<td class="reason">{esc(g["reason"])}</td></tr>' for g in p.get("gemms", []))
    return (f'<div class="card"><h2>Precision</h2><p>{esc(precision_line(report))}</p>'
            '<table class="sortable" id="precision"><thead><tr><th>node</th><th>region</th><th>M×K×N</th>'
            '<th>precision</th>'
            f'<th>error vs float32</th><th>median</th><th>why</th></tr></thead><tbody>{rows}</tbody></table></div>')


def gemm_table(report) -> str:
    """One row per GEMM node: op, M×K×N, backend chosen, median time per backend, the
    weight copy it keeps (pre-transposed or prepacked, MiB), why."""
    if not report.gemm:
        return '<p class="muted">No GEMM backend choice (not float32 on CPU, or gemm="aten").</p>'
    rows = "".join(
        f'<tr><td>{esc(g["node"])}</td><td>{esc(g["op"])}</td><td>{g["m"]}×{g["k"]}×{g["n"]}</td>'
        f'<td>{esc(g["backend"])}</td><td>{esc("  ".join(f"{k} {human_time(v)}" for k, v in g["times_s"].items()))}'
        f'</td><td>{g.get("extra_bytes", 0) / 2**20:.2f}</td><td class="reason">{esc(g["reason"])}</td></tr>'
        for g in report.gemm)
    return ('<table class="sortable" id="gemm"><thead><tr><th>node</th><th>op</th><th>M×K×N</th><th>backend</th>'
            f"<th>median per backend</th><th>extra MiB</th><th>why</th></tr></thead><tbody>{rows}</tbody></table>")


def header(report, device) -> str:
    t = report.totals
    err = "not checked" if t["max_error"] is None else f"{t['max_error']:.2e}"
    per = ", ".join(f"{k} {v}" for k, v in sorted(t["per_pattern"].items())) or "none"
    total_time = sum(report.timings_s.values())
    meta = [("model", report.model), ("inputs", "; ".join(report.inputs)), ("dtype", report.dtype),
            ("device", f"{report.device} ({device.name}: {device.bandwidth / 1e9:.0f} GB/s, "
                       f"{device.peak_flops / 1e9:.0f} GFLOP/s)"),
            ("θ", report.theta), ("opfuse", report.version),
            ("shapes", dynamic_line(report) or "static (the example inputs' shapes)"),
            ("verification", "per region on the example inputs" if report.verified else "skipped"),
            ("optimize time", f"{total_time:.2f} s (" + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                 report.timings_s.items()) + ")")]
    totals = [("traffic before", human_bytes(t["bytes_unfused"])), ("traffic after", human_bytes(t["bytes_fused"])),
              ("reduction", f"{100 * t['reduction']:.1f}%"), ("fused regions", str(t["fused_regions"])),
              ("max model error", err), ("graph FLOPs", human_flops(t["flops"]))]
    return (f'<div class="card" id="header"><h1>opfuse fusion report — {esc(report.model)}</h1>'
            '<div class="meta">' + "".join(f"<div><b>{esc(k)}</b> {esc(v)}</div>" for k, v in meta) + "</div>"
            '<div class="totals">' + "".join(f'<div class="total"><div class="k">{esc(k)}</div>'
                                             f'<div class="v">{esc(v)}</div></div>' for k, v in totals)
            + f'</div><p class="muted">Fused per pattern: {esc(per)}</p></div>')


def legend(report, colours: dict[str, str]) -> str:
    items = [f'<span><span class="sw" style="background:{_tint(c)};border-color:{c}"></span>{esc(p)}</span>'
             for p, c in colours.items()]
    items.append(f'<span><span class="sw" style="background:#fff6f5;border:2px dashed {REJECTED}"></span>'
                 "rejected / reverted candidate (note at its anchor)</span>")
    items.append('<span><span class="sw" style="background:#fff;border:2px dashed #999"></span>'
                 "block input / output</span>")
    return '<div class="legend">' + "".join(items) + "</div>"


def render_html(report, device=None) -> str:
    """The page as one string (see the module docstring)."""
    from ..cost.device import profile_for
    device = device or profile_for(report.device)
    colours = pattern_colours(report)
    g = report.block_graph or {}
    if g.get("nodes"):
        block_svg, block_note = render_svg(block_dot(report, colours))
        model_svg, model_note = render_svg(model_dot(report))
    else:
        block_svg = model_svg = None
        block_note = model_note = "This report carries no graph summary (<code>report.block_graph</code> is empty)."
    plotly_js, (bars_div, roof_div) = _plotly_divs(report, colours, device)
    block = g.get("block") or "whole graph"
    fused_here = sum(1 for r in report.fused if r.block == g.get("block"))
    ops = (f'<p class="ops"><b>before:</b> {esc(" ".join(report.ops_before))}<br>'
           f'<b>after:</b> {esc(" ".join(report.ops_after))}</p>') if report.ops_before else ""
    repeats = f" (one of ×{g['repeats']} {esc(g.get('kind', ''))})" if g.get("repeats", 1) > 1 else ""
    block_html = block_svg if block_svg else f'<p class="note" id="graph-note">{block_note}</p>'
    model_html = model_svg if model_svg else f'<p class="note">{model_note}</p>'
    body = f"""
<main>
{header(report, device)}
<div class="grid">
  <div class="card graph" id="block-graph">
    <h2>One block: {esc(block)}{repeats} — {fused_here} fused regions</h2>
    {legend(report, colours)}
    {block_html}
    {ops}
  </div>
  <div>
    <div class="card graph" id="model-graph"><h2>Whole model (repeated blocks collapsed)</h2>{model_html}</div>
    <div class="card">{bars_div}</div>
    <div class="card">{roof_div}</div>
  </div>
</div>
<div class="card"><h2>Regions ({len(report.regions)} candidates, {len(report.fused)} fused) — click a column to
sort</h2>{region_table(report)}</div>
<div class="card"><h2>Near misses ({len(report.near_misses)}): came close, did not fuse</h2>{near_miss_table(report)}</div>
<div class="card"><h2>GEMM backends ({len(report.gemm)} GEMMs, measured per shape at optimize time)</h2>{gemm_table(report)}</div>
{precision_card(report)}
<p class="muted">Bytes are modelled memory traffic (each ATen op as its own kernel vs the fused kernel);
ρ = (M<sub>orig</sub> − M<sub>fused</sub>)/M<sub>orig</sub>; I = FLOPs / bytes; t = roofline time on
{esc(device.name)} incl. launch overhead. Written by opfuse {esc(report.version)}.</p>
</main>"""
    data = json.dumps(_json_safe(report.to_dict()), default=str).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en" data-js-errors="[]">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>opfuse report — {esc(report.model)}</title>
<script>{_ERROR_HOOK}</script>
<style>{_CSS}</style>
<script>{plotly_js}</script>
<script type="application/json" id="report-data">{data}</script>
</head>
<body>{body}
<script>{_SORT_JS}</script>
</body>
</html>
"""


def _json_safe(obj):
    """NaN/inf (not valid JSON) as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_html(report, path, device=None) -> str:
    """Write :func:`render_html` to ``path``; returns the path as a string."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(report, device=device), encoding="utf-8")
    return str(path)
