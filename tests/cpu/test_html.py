"""The HTML report (``report.to_html`` / ``--report``): structure of the parsed page, the
table's numbers equal ``report.to_dict()``, nothing loaded from the network, a note
instead of the picture without Graphviz, and no JavaScript errors in a real headless
Chromium (skipped where Chromium is not installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

import opfuse
from opfuse.models import load
from opfuse.report import FusionReport
from opfuse.report import html as report_html

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="Graphviz `dot` not installed (make install adds Debian's graphviz)")


class Page(HTMLParser):
    """Every start tag with its attributes, and the text of <script id=report-data>."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.data_json = ""
        self._in_data = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        self._in_data = tag == "script" and attrs.get("id") == "report-data"

    def handle_endtag(self, tag):
        self._in_data = False

    def handle_data(self, data):
        if self._in_data:
            self.data_json += data

    def with_class(self, *names: str, tag: str | None = None) -> list[dict]:
        return [a for t, a in self.tags
                if set(names) <= set((a.get("class") or "").split()) and tag in (None, t)]


@pytest.fixture(scope="module")
def report():
    loaded = load("bert-tiny", batch=2, seq=16)
    return opfuse.optimize(loaded.model, loaded.args, name="bert-tiny").report


@pytest.fixture(scope="module")
def page(report, tmp_path_factory):
    path = tmp_path_factory.mktemp("html") / "report.html"
    assert report.to_html(path) == str(path)
    return path


def test_report_carries_a_block_graph(report):
    g = report.block_graph
    assert g["block"] == "encoder.layer.0" and g["repeats"] == 2
    names = {n["name"] for n in g["nodes"]}
    assert {"linear", "softmax", "layer_norm_2"} <= names
    assert "layer_norm" in {e["name"] for e in g["external"]}          # the embeddings' output feeds the block
    blocks = [s for s in g["model"]["segments"] if s["repeats"] > 1]
    assert [s["label"] for s in blocks] == ["encoder.layer.#"] and blocks[0]["repeats"] == 2
    json.dumps(g)                                                        # plain data


@needs_dot
def test_one_outlined_cluster_per_fused_region_of_the_block(report, page):
    parsed = Page(page.read_text())
    block = report.block_graph["block"]
    expected = {f"region-{i}" for i, r in enumerate(report.regions) if r.decision == "fused" and r.block == block}
    drawn = {a["id"] for a in parsed.with_class("cluster", "region", "fused")}
    assert drawn == expected and len(expected) == 5      # qkv_merge, attention, linear_add_layernorm, ffn, add_layernorm
    for i in (int(x.split("-")[1]) for x in drawn):     # coloured by pattern
        assert f"pattern-{report.regions[i].pattern}" in next(
            a["class"] for a in parsed.with_class("cluster") if a["id"] == f"region-{i}")
    rejected = {a["id"] for a in parsed.with_class("rejected", tag="g")}   # dashed notes in the SVG
    assert rejected == {f"rejected-{i}" for i, r in enumerate(report.regions)
                        if r.decision != "fused" and r.block == block}
    assert any(a.get("id") == "seg-encoder.layer.#" for _t, a in parsed.tags)    # whole model, ×N
    assert "encoder.layer.# ×2" in page.read_text()


def test_table_numbers_equal_to_dict(report, page):
    parsed = Page(page.read_text())
    regions = report.to_dict()["regions"]
    rows: dict[int, dict] = {}
    current = None
    for tag, attrs in parsed.tags:
        if tag == "tr" and "data-region" in attrs:
            current = rows.setdefault(int(attrs["data-region"]), {})
        elif tag == "td" and current is not None and "data-key" in attrs:
            current[attrs["data-key"]] = attrs["data-value"]
    assert sorted(rows) == list(range(len(regions)))
    for i, region in enumerate(regions):
        row = rows[i]
        for key, value in region.items():
            if key == "nodes":
                assert int(row[key]) == len(value)
            elif value is None:
                assert row[key] == ""
            elif isinstance(value, float):
                assert float(row[key]) == value, (i, key)
            elif isinstance(value, int):
                assert int(row[key]) == value, (i, key)
            else:
                assert row[key] == str(value), (i, key)
    assert json.loads(parsed.data_json)["totals"] == json.loads(json.dumps(report.to_dict()["totals"]))
    near = [a for t, a in parsed.tags if t == "table" and a.get("id") == "near-misses"]
    assert bool(near) == bool(report.near_misses)


def test_page_is_self_contained(page):
    text = page.read_text()
    parsed = Page(text)
    for tag, attrs in parsed.tags:
        assert not (tag in ("script", "img", "iframe") and attrs.get("src")), (tag, attrs)
        assert not (tag == "link" and attrs.get("href")), (tag, attrs)
    assert "Plotly.newPlot" in text and "plot-roofline" in text and "plot-traffic" in text
    header = text[text.index('id="header"'):text.index('id="block-graph"')]
    for word in ("bert-tiny", "float32", "θ", "0.3", "traffic before", "max model error", opfuse.__version__):
        assert word in header


def test_without_dot_the_page_has_a_note(report, tmp_path, monkeypatch):
    monkeypatch.setattr(report_html, "DOT", "opfuse-no-such-dot")
    text = (tmp_path / "r.html").read_text() if report.to_html(tmp_path / "r.html") else ""
    assert 'id="graph-note"' in text and "not found" in text
    assert not Page(text).with_class("cluster", "region")
    assert 'id="regions"' in text                        # the rest of the page is there


def test_minimal_report_renders(tmp_path):
    empty = FusionReport(model="m", inputs=[], dtype="float32", device="cpu", theta=0.3)
    text = (tmp_path / "e.html").read_text() if empty.to_html(tmp_path / "e.html") else ""
    assert "no graph summary" in text and 'id="regions"' in text


def test_cli_report_flag(tmp_path):
    from opfuse.cli import main
    out = tmp_path / "cli.html"
    assert main(["explain", "bert-tiny", "--batch", "2", "--seq", "16", "--report", str(out)]) == 0
    assert out.stat().st_size > 100_000 and 'id="regions"' in out.read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium not installed (make install adds Debian's chromium)")
def test_chromium_renders_without_javascript_errors(page, tmp_path):
    shot = tmp_path / "report.png"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", "--window-size=1600,2000",
           f"--screenshot={shot}", "--dump-dom", page.as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    root = next(a for t, a in Page(done.stdout).tags if t == "html")
    assert json.loads(root["data-js-errors"]) == [], root["data-js-errors"]
    assert root.get("data-ready") == "1" and root.get("data-plots") == "2"   # the scripts ran to the end
    assert Page(done.stdout).with_class("main-svg")                          # plotly drew its charts
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    print(f"screenshot: {shot}")


def test_gemm_table_lists_every_choice(report, page):
    """One row per GEMM node of report.gemm, naming the backend chosen."""
    assert report.gemm, "bert-tiny is float32 on CPU: every GEMM gets a backend choice"
    text = open(page).read()
    body = text.split('id="gemm"', 1)[1].split("</table>", 1)[0]
    assert body.count("<tr>") - 1 == len(report.gemm)  # minus the header row
    for g in report.gemm:
        assert f'<td>{g["node"]}</td>' in body and g["backend"] in body
