"""opfuse.bench: structure of the results (no timing assertions — the machine is shared)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import opfuse
from opfuse.bench import kernels as bk
from opfuse.bench import peers as bp
from opfuse.bench.models import bench_model
from opfuse.cost import device as dev

FAKE = {"bandwidth": 10e9, "cache_bandwidth": 50e9, "peak_flops": 50e9, "cache_bytes": 512 * 1024, "threads": 1}


@pytest.fixture
def fake_measure(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dev, "_measure_cpu", lambda seconds=1.0: calls.append(1) or dict(FAKE))
    return calls


def test_static_profile_only_when_asked(monkeypatch, fake_measure):
    monkeypatch.setenv("OPFUSE_MEASURE_DEVICE", "0")
    assert dev.profile_for("cpu") == dev.cpu_profile()
    assert dev.cpu_profile().cache_bandwidth == 0 and not fake_measure
    monkeypatch.delenv("OPFUSE_MEASURE_DEVICE")
    assert dev.profile_for("cpu").name == "cpu (measured)" and len(fake_measure) == 1  # the default


def test_measured_profile_is_cached_on_disk(monkeypatch, fake_measure, tmp_path):
    monkeypatch.setenv("OPFUSE_MEASURE_DEVICE", "1")
    p = dev.profile_for("cpu")
    assert (p.bandwidth, p.peak_flops, p.cache_bandwidth) == (10e9, 50e9, 50e9)
    assert (tmp_path / "device_cpu.json").exists()
    assert dev.profile_for(torch.device("cpu")) == p
    assert len(fake_measure) == 1  # second use read the cache


def test_cache_resident_intermediates_lower_unfused_time():
    import opfuse
    from opfuse.models import load
    loaded = load("bert-tiny", batch=1, seq=16)
    base = dev.DeviceProfile("cpu", 10e9, 50e9, 512 * 1024, 5e-6)
    cached = dev.DeviceProfile("cpu", 10e9, 50e9, 512 * 1024, 5e-6, cache_bandwidth=100e9)
    a = opfuse.explain(loaded.model, loaded.args, device=base)
    b = opfuse.explain(loaded.model, loaded.args, device=cached)
    pairs = [(x, y) for x, y in zip(a.regions, b.regions) if x.pattern == "add_layernorm"]
    assert pairs
    for x, y in pairs:
        assert y.time_unfused_s < x.time_unfused_s and y.time_fused_s == x.time_fused_s


def test_bench_model_rows(fake_measure):
    r = bench_model("bert-tiny", against=["ort", "nonsense"], batch=1, seq=16, repeat=2)
    rows = {row["peer"]: row for row in r["peers"]}
    assert {"eager", "opfuse", "ort", "ort-opt", "nonsense"} <= set(rows)
    assert rows["nonsense"]["status"] == "failed" and "unknown peer" in rows["nonsense"]["error"]
    assert rows["eager"]["speedup_vs_eager"] == pytest.approx(1.0)
    for row in rows.values():
        if row["status"] == "ok":
            assert row["median_ms"] > 0 and row["cold_s"] is not None and row["max_abs_diff"] < 1e-3
            assert 0.99999 <= row["pooled_cosine"] <= 1.0 + 1e-12
    assert r["fusion"]["fused_regions"] > 0
    for key in ("cpu", "logical_cpus", "versions", "loadavg_start", "loadavg_end"):
        assert key in r["machine"]
    assert r["device_profile"]["cache_bandwidth"] == 50e9
    floor = r["gemm_floor"]
    assert floor["gemm_flops"] > 0 and floor["floor_ms"] > 0 and set(floor["gemm_rates_flops"]) >= {"aten"}
    assert rows["opfuse"]["vs_gemm_floor"] > 0.5  # nothing runs much below the floor


def test_pooled_cosine_is_the_masked_mean_embeddings_cosine():
    """Mean pooling over the kept positions only (a padded position's garbage does not
    count), the worst row of the batch, against an explicit float64 computation."""
    from opfuse.bench.models import pooled_cosine
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    out = ref + 0.1 * torch.randn(2, 5, 8, generator=g)
    out[0, 3:] = 1e6  # padding: ignored
    pooled = [(t[i, : int(mask[i].sum())].double().mean(0)) for t in (out, ref) for i in range(2)]
    want = min(float(torch.dot(pooled[i], pooled[2 + i]) / (pooled[i].norm() * pooled[2 + i].norm()))
               for i in range(2))
    assert pooled_cosine(out, ref, mask) == pytest.approx(want, abs=1e-12)
    assert pooled_cosine(ref, ref, mask) == pytest.approx(1.0)
    assert pooled_cosine(-ref[0], ref[0]) == pytest.approx(-1.0)  # 2-D: flattened


def test_gemm_flops_count_linears_and_sdpa():
    from opfuse.bench.models import gemm_flops

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 16)

        def forward(self, x, q):
            return self.lin(x), torch.nn.functional.scaled_dot_product_attention(q, q, q)
    flops = gemm_flops(Two().eval(), (torch.randn(3, 8), torch.randn(1, 2, 5, 4)))
    assert flops == 2 * 3 * 8 * 16 + 4 * 2 * 5 * 5 * 4


def test_openvino_peers_or_a_reason():
    from opfuse.models import load
    loaded = load("bert-tiny", batch=1, seq=16)
    peers = bp.build_openvino(loaded.model, loaded.args, 1)
    assert [p.name for p in peers] == ["openvino", "openvino-default"]
    for p in peers:
        if p.fn is None:  # not installed / conversion failed: the reason is reported, never dropped
            assert p.error
        else:
            ref = loaded.model(*loaded.args).last_hidden_state
            torch.testing.assert_close(p.fn(), ref, rtol=1e-3, atol=1e-3)


def test_failed_export_is_reported(monkeypatch):
    pytest.importorskip("onnxruntime", reason="the `bench` extra (onnxruntime) is not installed")

    def boom(*a, **k):
        raise RuntimeError("dynamo=False: TypeError: nope; dynamo=True: ValueError: nope")
    monkeypatch.setattr(bp, "export_onnx", boom)
    from opfuse.models import load
    loaded = load("bert-tiny", batch=1, seq=16)
    peers = bp.build_ort(loaded.model, loaded.args, "bert", 1)
    assert [p.name for p in peers] == ["ort", "ort-opt"]
    assert all(p.fn is None and p.error.startswith("export failed") for p in peers)


def test_amdahl_and_theta_sweep_structure():
    from opfuse.bench.amdahl import amdahl
    from opfuse.bench.theta import theta_sweep
    from opfuse.models import load
    loaded = load("bert-tiny", batch=1, seq=16)
    a = amdahl(loaded.model, loaded.args, repeat=2)
    assert {r["pattern"] for r in a["patterns"]} >= {"attention", "add_layernorm"}
    assert 0 < a["p_total"] <= 1 and all(r["s_fused"] > 0 for r in a["patterns"])
    expect = 1 / ((1 - a["p_total"]) + sum(r["p"] / r["s_fused"] for r in a["patterns"]))
    assert math.isclose(a["predicted"], expect)
    assert 0 <= a["gemm_share"] <= 1 and a["measured"] > 0
    rows = theta_sweep(loaded.model, loaded.args, "bert-tiny", thetas=(0.0, 0.5, 0.9), repeat=2)
    counts = [r["fused_regions"] for r in rows]
    assert counts == sorted(counts, reverse=True) and all(r["latency_ms"] > 0 for r in rows)


def test_kernel_cases_match_their_eager_ops():
    from opfuse.kernels import ops  # noqa: F401  registers torch.ops.opfuse
    cases = bk.cases("tiny")
    assert {c.kernel for c in cases} >= {"add_layernorm", "layernorm_gelu", "rmsnorm", "add_rmsnorm", "linear_bias_gelu",
                                         "linear_residual", "linear_add_layernorm", "ffn", "swiglu", "geglu", "attention", "rope"}
    # two sizes: a case closure that reads a loop variable late (not bound per size) fails here
    with torch.inference_mode():
        for c in cases:
            f, e = c.fused(), c.eager()
            f = f[0] if isinstance(f, tuple) else f
            torch.testing.assert_close(f, e.clone(), rtol=1e-4, atol=1e-4, msg=f"{c.kernel} {c.shape}")
            assert c.nbytes > 0


def test_cli_bench_writes_json_and_csv(fake_measure, tmp_path, capsys):
    from opfuse.cli import main
    out = tmp_path / "r.json"
    assert main(["bench", "bert-tiny", "--against", "eager", "--batch", "1", "--seq", "16", "--repeat", "2",
                 "--breakdown", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["peer"] for r in data["peers"]] == ["eager", "opfuse"]
    assert set(data["breakdown"]) == {"eager", "opfuse"}
    assert all(b["per_call_s"]["GEMM"] > 0 and b["ops_per_call"] > 10 for b in data["breakdown"].values())
    assert (tmp_path / "r.csv").read_text().startswith("model,")
    printed = capsys.readouterr().out
    assert "vs eager" in printed and "where the time goes" in printed


def test_bench_generate_structure(monkeypatch):
    """``opfuse bench MODEL --generate`` on a tiny Llama: eager and opfuse generate the same
    tokens, ONNX Runtime / OpenVINO are failed peers with the reason, the floor is the
    decode step's weight bytes at the measured GEMV bandwidth (no timing asserted)."""
    from opfuse.bench import generate as bg
    tiny = ("LlamaForCausalLM", "LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=500))
    monkeypatch.setitem(bg.GENERATE_MODELS, "llama-tiny", tiny)
    result = bg.bench_generate("llama-tiny", batch=2, prompt=8, new=4, against=("ort", "openvino"), repeat=1,
                               with_breakdown=True)
    rows = {r["peer"]: r for r in result["peers"]}
    steps = result["breakdown"]  # per decode step: profiled generate(1 + n) minus generate(1)
    assert set(steps) == {"eager", "opfuse"} and all(b["ops_per_call"] > 5 and b["total_s"] > 0 for b in steps.values())
    assert steps["opfuse"]["per_call_s"]["GEMM"] > 0
    assert set(rows) == {"eager", "opfuse", "ort", "openvino"}
    assert rows["opfuse"]["same_tokens_as_eager"] and rows["eager"]["same_tokens_as_eager"]
    assert rows["ort"]["status"] == "failed" and "generate" in rows["ort"]["error"]
    assert {p["phase"] for p in rows["opfuse"]["plans"]} == {"prefill", "decode"}
    model = bg.build_lm("llama-tiny")
    emb = model.get_input_embeddings().weight.numel()
    assert result["floor"]["weight_bytes_per_step"] == 4 * (sum(p.numel() for p in model.parameters()) - emb)
    assert result["floor"]["decode_step_ms"] > 0 and rows["opfuse"]["decode_tok_s"] > 0
    assert "decode tok/s" in str([c.header for c in bg.generate_table(result).columns])
    # memory held beyond the weights: eager's cache of prompt + new tokens (2 layers × K/V ×
    # 2 rows × 2 KV heads × 12 tokens × head dim 16 × 4 bytes); opfuse's pooled static cache
    # of one 128-token bucket, and its folded weight copies as the plans' buffers count them
    assert rows["eager"]["held_bytes"] == {"folded": 0, "cache": 2 * 2 * 2 * 2 * 12 * 16 * 4}
    fused = rows["opfuse"]["held_bytes"]
    assert fused["cache"] == 2 * 2 * 2 * 2 * 128 * 16 * 4
    assert result["memory"]["static_cache_bytes"] == rows["eager"]["held_bytes"]["cache"]
    assert {"held_folded_bytes", "held_cache_bytes"} <= set(bg.csv_rows(result)[0])


def test_floor_streams_every_decode_weight_once_at_the_best_median_rate(monkeypatch):
    """The decode floor's bandwidth: one pass reads every >= 2-D decode weight (not the input
    embedding; the tied LM head once), each way's pass time is a median, the best way wins."""
    from opfuse.bench import generate as bg

    class Tied(torch.nn.Module):
        def __init__(self, tie):
            super().__init__()
            self.emb, self.mid = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 10, bias=False)
            if tie:
                self.head.weight = self.emb.weight

        def get_input_embeddings(self):
            return self.emb

        def get_output_embeddings(self):
            return self.head

    for tie in (False, True):
        m = Tied(tie)
        ws = bg.decode_weights(m)
        assert [tuple(w.shape) for w in ws] == [(8, 8), (10, 8)]  # mid.bias (1-D) and emb left out
        assert any(w.data_ptr() == m.emb.weight.data_ptr() for w in ws) == tie  # the tied head, once
        assert bg.decode_weight_bytes(m) == 4 * (64 + 8 + 80)
    seconds = iter([2.0, 0.5, 3.0])  # per way (as is, pre-transposed, sum): a pass's median, stubbed
    monkeypatch.setattr(bg, "_pass_seconds", lambda step, repeat: (step(), next(seconds))[1])
    assert bg.gemv_bandwidth(Tied(False)) == 4 * (64 + 80) / 0.5
    monkeypatch.undo()
    calls = []
    assert bg._pass_seconds(lambda: calls.append(1), 3) >= 0 and len(calls) == 4  # one warm-up + 3 timed
    with pytest.raises(ValueError, match="no >= 2-D"):
        bg.gemv_bandwidth(_NoMatrices())


class _NoMatrices(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.scale = torch.nn.Embedding(4, 2), torch.nn.Parameter(torch.ones(2))

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return None


def test_held_bytes_counts_each_folded_storage_once():
    from opfuse.bench import generate as bg
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(), torch.nn.Linear(32, 8)).eval()
    fused = opfuse.optimize(model, (torch.randn(1, 16),), gemm="wt")
    fused(torch.randn(3, 16))  # a second plan: its copies share the first one's storage
    assert len(fused._plans) == 2
    assert bg.held_bytes(fused) == {"folded": 4 * (16 * 32 + 32 * 8), "cache": 0}


def test_serving_benchmark_structure_and_values():
    """bench_serving on bert-tiny: every system's output checked against eager's on every
    request; one dynamic opfuse plan, no re-plan over random lengths."""
    from opfuse.bench.serving import bench_serving, make_requests
    from opfuse.models import load
    reqs = make_requests(3, 2, 4, 40, vocab=1000, seed=1)
    assert all(ids.shape == mask.shape and bool((ids[mask == 0] == 0).all()) for ids, mask in reqs)
    loaded = load("bert-tiny", batch=2, seq=16)
    result = bench_serving(loaded.model, n=4, batch=2, lo=4, hi=40, threads=1, against=("eager", "opfuse"),
                           example_seq=16)
    op = result["systems"]["opfuse"]
    assert op["max_abs_err"] < 1e-4 and op["total_s"] > 0 and op["p50_s"] <= op["p99_s"]
    assert result["opfuse"]["plans"] == 1 and result["opfuse"]["replans"] == []


def test_serving_benchmark_bf16_peer():
    """opfuse-bf16 in the serving loop: one dynamic bf16 plan (precision="bf16"), its outputs
    within the bf16 budget of eager's on every request, its regions reported; the table has
    a precision column."""
    from opfuse.bench.serving import bench_serving, serving_table
    from opfuse.models import load
    loaded = load("bert-tiny", batch=2, seq=16)
    result = bench_serving(loaded.model, n=3, batch=2, lo=4, hi=40, threads=1, against=("eager", "opfuse-bf16"),
                           example_seq=16)
    op = result["systems"]["opfuse-bf16"]
    assert 0 < op["max_abs_err"] < 0.1 and "bf16 regions" in op["precision"] and "replans 0" in op["precision"]
    assert "precision" in [c.header for c in serving_table(result).columns]
