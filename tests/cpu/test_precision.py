"""precision="bf16": per-GEMM decisions from measured (here: injected) errors and times,
the end-to-end budget with GEMMs put back to float32, the bf16 GEMM against a float64
oracle with bf16's error bound, and the default float32 plan unchanged bit for bit."""

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import precision as P
from opfuse.models import load

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="bf16 GEMMs run through oneDNN")

FASTER = lambda node, fp32, bf16: {"fp32": 2e-4, "bf16": 1e-4}  # noqa: E731  injected clock: bf16 2x faster
SLOWER = lambda node, fp32, bf16: {"fp32": 1e-4, "bf16": 2e-4}  # noqa: E731


def _plan(name="llama-tiny", batch=2, seq=7):
    loaded = load(name, batch=batch, seq=seq)
    fused = opfuse.optimize(loaded.model, loaded.args, example_kwargs=loaded.kwargs, decide="rho")
    return loaded, fused, next(iter(fused._plans.values())).gm


def _lowered(gm):
    return [n for n in gm.graph.nodes if n.meta.get("opfuse_precision") == "bf16"
            and n.target is torch.ops.mkldnn._linear_pointwise.default]


def test_bf16_gemm_within_its_error_bound_of_float64():
    """|y − y₆₄| ≤ 2⁻⁸·(|x|·|W|ᵀ) + 2⁻⁹·|y₆₄| (+ float32 accumulation): both operands
    rounded to bf16 once (unit roundoff 2⁻⁹ each), the product rounded to bf16 once."""
    g = torch.Generator().manual_seed(0)
    for m, k, n in [(1, 37, 53), (7, 512, 129), (129, 96, 40), (512, 64, 17)]:
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        y = P.bf16_linear(x, w.to(torch.bfloat16), b)
        exact = x.double() @ w.double().T
        bound = 2.0**-8 * (x.double().abs() @ w.double().abs().T) * 1.01 + 2.0**-9 * exact.abs() + 1e-5
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert bool(((y.double() - b.double() - exact).abs() <= bound).all())


def test_default_is_float32_bit_for_bit():
    loaded, fused, _ = _plan()
    explicit = opfuse.optimize(loaded.model, loaded.args, decide="rho", precision="fp32")
    assert fused.report.precision == {} and explicit.report.precision == {}
    with torch.no_grad():
        assert torch.equal(fused(*loaded.args).last_hidden_state, explicit(*loaded.args).last_hidden_state)


def test_faster_and_within_budget_goes_bf16():
    loaded, fused, gm = _plan()
    with torch.no_grad():
        ref = fused(*loaded.args).last_hidden_state
    sites = len(P._sites(gm))
    info = P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", timer=FASTER)
    assert sites >= 8 and len(info["gemms"]) == sites
    assert all(g["precision"] == "bf16" and 0 < g["error"] <= P.DEFAULT_TOLERANCE for g in info["gemms"])
    assert len(_lowered(gm)) == sites and info["reverted"] == 0
    assert [b for b, _ in gm.named_buffers() if b.startswith("opfuse_folded_bf16_")]
    e2e = info["end_to_end"]
    assert e2e["max_error"] <= P.E2E_FACTOR * P.DEFAULT_TOLERANCE and e2e["min_cosine"] >= P.COSINE_MIN
    with torch.no_grad():
        out = gm(*loaded.args).last_hidden_state
    assert not torch.equal(out, ref)  # it did change precision ...
    assert P.end_to_end([out], [ref]) == pytest.approx(e2e)  # ... by what the report says


def test_over_budget_or_slower_stays_float32():
    loaded, _, gm = _plan()
    names = [n.name for n in P._sites(gm)]
    bad = {names[0]: 0.5}  # this GEMM's measured error over the 1e-2 budget
    info = P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", timer=FASTER, errors=bad)
    by = {g["node"]: g for g in info["gemms"]}
    assert by[names[0]]["precision"] == "fp32" and "error 5.0e-01 > tolerance" in by[names[0]]["reason"]
    assert all(by[n]["precision"] == "bf16" for n in names[1:])
    _, _, gm2 = _plan()
    info = P.apply_precision(gm2, loaded.args, loaded.kwargs, "bf16", timer=SLOWER)
    assert all(g["precision"] == "fp32" and "not 3% faster" in g["reason"] for g in info["gemms"])
    assert _lowered(gm2) == [] and info["end_to_end"] is None


def test_whole_model_over_budget_puts_gemms_back():
    """Every GEMM passes its own (injected) check, but the whole model misses a tiny budget:
    GEMMs go back to float32, largest errors first, until none is left; the plan is then
    the float32 plan bit for bit."""
    loaded, fused, gm = _plan()
    with torch.no_grad():
        ref = fused(*loaded.args).last_hidden_state
    names = [n.name for n in P._sites(gm)]
    info = P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", tolerance=1e-9, timer=FASTER,
                             errors={n: 0.0 for n in names})
    assert info["reverted"] == len(names) and _lowered(gm) == []
    assert all(g["precision"] == "fp32" and "put back" in g["reason"] for g in info["gemms"])
    with torch.no_grad():
        assert torch.equal(gm(*loaded.args).last_hidden_state, ref)


def test_optimize_bf16_end_to_end_report_and_no_stale_weights(monkeypatch, tmp_path):
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(P, "_measure", lambda fp32, bf16, rows: {"fp32": 2e-4, "bf16": 1e-4})
    loaded = load("bert-tiny", batch=2, seq=9)
    fused = opfuse.optimize(loaded.model, loaded.args, decide="rho", precision="bf16")
    p = fused.report.precision
    assert p["requested"] == "bf16" and p["note"] and p["end_to_end"]["min_cosine"] >= P.COSINE_MIN
    assert any(g["precision"] == "bf16" for g in p["gemms"])
    from opfuse.report.text import render
    from rich.console import Console
    console = Console(record=True, width=200)
    console.print(render(fused.report))
    assert "Precision" in console.export_text()
    with torch.no_grad():
        exact = loaded.model.double()(*loaded.args).last_hidden_state
        loaded.model.float()
        out = fused(*loaded.args).last_hidden_state
        assert P.end_to_end([out], [exact.float()])["min_cosine"] >= P.COSINE_MIN
        loaded.model.encoder.layer[0].attention.self.query.weight.mul_(3.0)  # after optimize: never stale
        new = loaded.model(*loaded.args).last_hidden_state
        assert P.end_to_end([fused(*loaded.args).last_hidden_state], [new])["min_cosine"] >= P.COSINE_MIN


def test_bf16_plan_saves_and_loads(monkeypatch, tmp_path):
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(P, "_measure", lambda fp32, bf16, rows: {"fp32": 2e-4, "bf16": 1e-4})
    loaded = load("llama-tiny", batch=1, seq=12)
    fused = opfuse.optimize(loaded.model, loaded.args, decide="rho", precision="bf16")
    opfuse.save(fused, tmp_path / "p")
    back = opfuse.load(tmp_path / "p")
    with torch.no_grad():
        assert torch.equal(back(*loaded.args).last_hidden_state, fused(*loaded.args).last_hidden_state)


def test_fp16_on_cpu_says_so_and_bad_options_are_errors():
    loaded = load("bert-tiny", batch=1, seq=5)
    fused = opfuse.optimize(loaded.model, loaded.args, decide="rho", precision="fp16")
    assert "no CPU path" in fused.report.precision["note"] and fused.report.precision["gemms"] == []
    with pytest.raises(opfuse.OptimizeError, match="precision must be one of"):
        opfuse.optimize(loaded.model, loaded.args, precision="int8")
    with pytest.raises(opfuse.OptimizeError, match="tolerance must be a positive number"):
        opfuse.optimize(loaded.model, loaded.args, precision="bf16", tolerance=-1)


def test_native_flag_is_reported(monkeypatch):
    monkeypatch.setattr(P, "native_bf16", lambda: "avx512_bf16")
    loaded, _, gm = _plan(seq=3)
    info = P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", timer=SLOWER)
    assert info["native"] == "avx512_bf16" and info["note"].startswith("native bf16")


def test_generate_plans_take_the_precision(monkeypatch, tmp_path):
    """``fused.generate`` plans prefill and decode with the options of ``optimize``:
    both report ``precision="bf16"`` (here with the GEMMs measured slower: float32 kept,
    so the tokens are eager's)."""
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(P, "_measure", lambda fp32, bf16, rows: {"fp32": 1e-4, "bf16": 2e-4})
    import transformers as T
    torch.manual_seed(0)
    lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                          pad_token_id=0)).eval()
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(0))
    fused = opfuse.optimize(lm, (ids,), decide="rho", precision="bf16")
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        assert torch.equal(fused.generate(ids, **kw), lm.generate(ids, **kw))
    phases = {phase for phase, graph in fused.generation.graphs
              for r in graph.reports if r.precision.get("requested") == "bf16"}
    assert phases == {"prefill", "decode"}


def test_snapshots_skip_prepacked_weights():
    """Recording values (precision's measurement) on a plan holding oneDNN prepacked weights:
    the snapshot skips those opaque constants instead of failing on torch.equal."""
    loaded = load("bert-tiny", batch=1, seq=5)
    fused = opfuse.optimize(loaded.model, loaded.args, decide="rho", gemm="packed")
    gm = next(iter(fused._plans.values())).gm
    info = P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", timer=SLOWER)
    assert info["gemms"] and all(g["precision"] == "fp32" for g in info["gemms"])


def test_cli_optimize_precision_and_gemm(tmp_path, capsys):
    import json

    from opfuse.cli import main
    out = tmp_path / "r.json"
    assert main(["optimize", "bert-tiny", "--batch", "1", "--seq", "5", "--precision", "bf16", "--gemm", "packed",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["precision"]["requested"] == "bf16" and data["precision"]["gemms"]
    assert data["gemm"] and {g["backend"] for g in data["gemm"]} == {"packed"}
    assert "Precision" in capsys.readouterr().out
