"""Fusion decided by time (opfuse.timegate): driven by injected timing tables, never by
wall-clock in a test — except one structural check that real measurements are recorded."""

from __future__ import annotations

import pytest
import torch

import opfuse
from opfuse import timegate
from opfuse.cost.device import ON_CPU_MIN as _REAL_ON_CPU_MIN
from opfuse.cost.device import busy as _REAL_BUSY  # taken before conftest stubs it


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))  # no timings cached by other runs


def _timer(table: dict):
    """A timer that reads (fused s, unfused s) by pattern name."""
    calls = []

    def timer(cand, env, gemm=None):
        calls.append(cand.match.pattern.name)
        return table[cand.match.pattern.name]
    timer.calls = calls
    return timer


class AddLN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(32)

    def forward(self, x, r):
        return self.ln(x + r)


def test_region_measured_slower_is_not_fused_and_the_report_names_the_gate(monkeypatch):
    monkeypatch.setattr(timegate, "measure_region", _timer({"add_layernorm": (2e-5, 1e-5)}))
    model, args = AddLN().eval(), (torch.randn(8, 32), torch.randn(8, 32))
    fused = opfuse.optimize(model, args, decide="time")
    assert fused.report.counts() == {}
    (region,) = [r for r in fused.report.regions if r.pattern == "add_layernorm"]
    assert region.decision == "rejected" and region.gate == "time"
    assert region.measured_fused_s == 2e-5 and region.measured_unfused_s == 1e-5
    assert region.reason.startswith("decided by time: fused 20.0 µs vs unfused 10.0 µs")
    with torch.no_grad():
        torch.testing.assert_close(fused(*args), model(*args))


def test_a_tie_within_the_margin_is_not_fused(monkeypatch):
    """1% faster is within the timing noise (timegate.MARGIN = 3%): no gain, not fused."""
    monkeypatch.setattr(timegate, "measure_region", _timer({"add_layernorm": (0.99e-5, 1e-5)}))
    fused = opfuse.optimize(AddLN().eval(), (torch.randn(8, 32), torch.randn(8, 32)), decide="time")
    (region,) = [r for r in fused.report.regions if r.pattern == "add_layernorm"]
    assert region.decision == "rejected" and region.gate == "time" and "not 3% faster" in region.reason


def test_region_measured_faster_fuses_with_both_times(monkeypatch):
    monkeypatch.setattr(timegate, "measure_region", _timer({"add_layernorm": (1e-5, 3e-5)}))
    fused = opfuse.optimize(AddLN().eval(), (torch.randn(8, 32), torch.randn(8, 32)), decide="time")
    (region,) = fused.report.fused
    assert region.gate == "time" and "measured fused 10.0 µs < unfused 30.0 µs" in region.reason
    assert fused.report.to_dict()["regions"][0]["measured_unfused_s"] == 3e-5


def test_a_slower_winner_lets_the_regions_it_overlapped_fuse(monkeypatch):
    """bert-tiny: the traffic gate picks the blocked ffn kernel over bias+GELU and
    linear+add+LN; measured slower, it is rejected and those two fuse instead."""
    from opfuse.models import load
    loaded = load("bert-tiny", batch=2, seq=16)
    rho_plan = opfuse.optimize(loaded.model, loaded.args, decide="rho").report.counts()
    assert rho_plan.get("ffn") == 2
    timer = _timer({"ffn": (3e-4, 1e-4), "bias_gelu": (1e-5, 2e-5), "linear_add_layernorm": (1e-5, 2e-5),
                    "add_layernorm": (1e-5, 2e-5), "attention": (1e-5, 2e-5), "qkv_merge": (1e-5, 2e-5),
                    "out_proj_residual": (1e-5, 2e-5), "layernorm_gelu": (1e-5, 2e-5)})
    monkeypatch.setattr(timegate, "measure_region", timer)
    fused = opfuse.optimize(loaded.model, loaded.args, decide="time")
    counts = fused.report.counts()
    assert "ffn" not in counts and counts.get("bias_gelu") == 2, counts
    assert counts.get("linear_add_layernorm") == rho_plan.get("linear_add_layernorm", 0) + 2, (counts, rho_plan)
    assert all(r.gate == "time" for r in fused.report.regions if r.pattern == "ffn")
    with torch.no_grad():
        out, ref = fused(*loaded.args), loaded.model(*loaded.args)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-4, atol=1e-4)


def test_timings_are_cached_per_shape(monkeypatch):
    timer = _timer({"add_layernorm": (1e-5, 3e-5)})
    monkeypatch.setattr(timegate, "measure_region", timer)
    args = (torch.randn(8, 32), torch.randn(8, 32))
    opfuse.optimize(AddLN().eval(), args, decide="time")
    opfuse.optimize(AddLN().eval(), args, decide="time")
    assert timer.calls == ["add_layernorm"]  # the second optimize read the cache
    opfuse.optimize(AddLN().eval(), (torch.randn(4, 32), torch.randn(4, 32)), decide="time")
    assert timer.calls == ["add_layernorm"] * 2  # another shape is measured


@pytest.mark.parametrize("load, cached", [(0.9, True), (2.9, False)])
def test_timings_taken_on_a_busy_machine_are_not_cached(monkeypatch, load, cached):
    """A timing taken while other work shares the CPUs (load average above the usable CPUs)
    decides this optimize but is not stored: the next optimize measures again."""
    import os

    from opfuse.cost import device
    monkeypatch.setattr(device, "busy", _REAL_BUSY)  # the real check (conftest stubs it)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    timer = _timer({"add_layernorm": (1e-5, 3e-5)})
    monkeypatch.setattr(timegate, "measure_region", timer)
    args = (torch.randn(8, 32), torch.randn(8, 32))
    first = opfuse.optimize(AddLN().eval(), args, decide="time")
    opfuse.optimize(AddLN().eval(), args, decide="time")
    assert timer.calls == ["add_layernorm"] * (1 if cached else 2)
    assert ("busy" in first.report.fused[0].reason) == (not cached), first.report.fused[0].reason
    assert device.busy() == (None if cached else "load average 2.9 on 2 CPUs")


def test_timings_of_a_process_that_waited_for_a_core_are_not_cached(monkeypatch):
    """The load average can stay below the CPU count while this process waits for a core
    (another process on it, hypervisor steal): a timing window in which the process ran
    less than ON_CPU_MIN of the wall time on a CPU is used but not stored."""
    import time

    from opfuse.cost import device
    monkeypatch.setattr(device, "ON_CPU_MIN", _REAL_ON_CPU_MIN)
    timer = _timer({"add_layernorm": (1e-5, 3e-5)})

    def waiting(cand, env, gemm=None):
        time.sleep(0.05)  # wall time passes, no CPU time: as if the core ran other work
        return timer(cand, env)
    monkeypatch.setattr(timegate, "measure_region", waiting)
    args = (torch.randn(8, 32), torch.randn(8, 32))
    first = opfuse.optimize(AddLN().eval(), args, decide="time")
    opfuse.optimize(AddLN().eval(), args, decide="time")
    assert timer.calls == ["add_layernorm"] * 2
    assert "waited for a core" in first.report.fused[0].reason, first.report.fused[0].reason
    with device.TimingWindow() as window:
        sum(range(200_000))  # CPU work only: the window is quiet
    assert window.busy() is None and window.share > 0.5


def test_close_calls_are_measured_again(monkeypatch):
    """A timing within CACHE_CLEAR (fused 2% slower) is not frozen in the cache: noise on a
    shared machine decides such a call, so the next optimize measures it again; a clear
    result is cached."""
    close = _timer({"add_layernorm": (1.02e-5, 1e-5)})
    monkeypatch.setattr(timegate, "measure_region", close)
    args = (torch.randn(8, 32), torch.randn(8, 32))
    fused = opfuse.optimize(AddLN().eval(), args, decide="time")
    assert fused.report.counts() == {}  # not 3% faster: rejected
    opfuse.optimize(AddLN().eval(), args, decide="time")
    assert close.calls == ["add_layernorm"] * 2


def test_real_measurement_records_times():
    fused = opfuse.optimize(AddLN().eval(), (torch.randn(256, 32), torch.randn(256, 32)), decide="time")
    (region,) = fused.report.regions
    assert region.gate == "time" and region.measured_fused_s > 0 and region.measured_unfused_s > 0
    assert (region.decision == "fused") == (region.measured_fused_s < region.measured_unfused_s)


def test_unknown_decide_mode_is_refused():
    with pytest.raises(opfuse.OptimizeError, match="decide must be one of"):
        opfuse.optimize(AddLN().eval(), (torch.randn(2, 32), torch.randn(2, 32)), decide="bytes")


def test_regions_are_timed_with_the_gemm_backends_the_plan_gives_them(monkeypatch):
    """measure_region runs both sides after opfuse.gemm.apply_gemm_choices in the plan's mode:
    with gemm="onednn" forced, the unfused linears become oneDNN calls in the timed module
    (a fused op no backend serves keeps its own GEMM); with gemm="aten" nothing changes."""
    import transformers as T

    from opfuse import gemm as gemm_mod
    from opfuse.pipeline import cost, legality, select
    from opfuse.cost.device import profile_for
    from opfuse.graph.capture import capture
    from opfuse.graph.canonicalize import canonicalize
    from opfuse.patterns import LIBRARY, find_matches
    from opfuse.verify import record_values
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=50,
                                             use_cache=False)).model.layers[0].mlp.eval()
    x = torch.randn(1, 12, 32)
    gm = capture(model, (x,), {})
    canonicalize(gm)
    matches, _ = find_matches(gm.graph, LIBRARY)
    cands = legality(matches, gm.graph)
    cost(cands, profile_for(torch.device("cpu")))
    select(cands, 0.3)
    env = record_values(gm, (x,), {})
    (swiglu,) = [c for c in cands if c.match.pattern.name == "swiglu"]
    ran = []
    real = gemm_mod.apply_gemm_choices

    def spy(module, mode=None, also_at=None):
        out = real(module, mode, also_at)
        ran.append((mode, sorted({str(n.target) for n in module.graph.nodes if n.op == "call_function"})))
        return out
    monkeypatch.setattr(gemm_mod, "apply_gemm_choices", spy)
    fused_s, unfused_s = timegate.measure_region(swiglu, env, "onednn")
    assert fused_s > 0 and unfused_s > 0
    (fused_mode, fused_ops), (unfused_mode, unfused_ops) = ran
    assert fused_mode == unfused_mode == "onednn"
    assert "opfuse.swiglu.default" in fused_ops  # oneDNN serves no swiglu site: its own GEMM
    assert "mkldnn._linear_pointwise.default" in unfused_ops and "aten.linear.default" not in unfused_ops
    ran.clear()
    timegate.measure_region(swiglu, env, "aten")
    assert ran == []
