"""Dynamic shapes across Hugging Face architectures (tiny configs, default settings, padding
masks): one optimize(dynamic=True), then batch 1 × 1, 1 × 5 and 3 × 33 equal eager without
a re-plan. Mistral's sliding-window mask makes torch.export guard the sequence length: its
range starts there, and shorter calls re-plan once with a warning."""

import warnings

import pytest
import torch

import opfuse
from opfuse import zoo

def _build(name):
    """The architecture tier's row (opfuse.zoo): tiny config, default settings, the
    class's default attention implementation (SDPA where it has one)."""
    arch = zoo.BY_NAME[name]
    return arch.build("sdpa" if "sdpa" in arch.attns else "eager")


def _run(name):
    torch.manual_seed(0)
    model = _build(name)
    ids = torch.randint(1, 500, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = opfuse.optimize(model, (ids,), example_kwargs={"attention_mask": mask}, dynamic=True)
    for batch, seq in [(1, 1), (1, 5), (3, 33)]:
        x = torch.randint(1, 500, (batch, seq))
        m = torch.ones(batch, seq, dtype=torch.long)
        if batch > 1:
            m[0, seq - 3:] = 0
        with torch.no_grad():
            out, ref = fused(x, attention_mask=m), model(x, attention_mask=m)
        torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=1e-4)
    return fused


@pytest.mark.parametrize("name", ["distilbert", "albert", "qwen2", "phi3", "gemma", "falcon", "gptj", "bloom", "opt",
                                  "t5-encoder"])
def test_one_dynamic_plan_per_architecture(name):
    fused = _run(name)
    assert fused.report.dynamic.get("dims"), fused.report.dynamic
    assert len(fused.reports) == 1 and fused.replans == []
    counts = fused.report.counts()
    assert counts.get("attention") == 2, counts  # every layer's attention (Bloom: ALiBi on 3-D bmm), whole range


def test_mistral_sliding_window_range_starts_where_export_guarded_it():
    """Mistral's sliding-window mask makes torch.export guard the sequence length (here
    ≥ 7 and ≠ 7 for a window of 8): the dynamic plan serves the rest, and calls its
    capture's guards exclude re-plan once, statically, with a warning — every call equal
    to eager."""
    torch.manual_seed(0)
    model = _build("mistral")
    ids = torch.randint(1, 500, (2, 12))
    fused = opfuse.optimize(model, (ids,), example_kwargs={"attention_mask": torch.ones(2, 12, dtype=torch.long)},
                            dynamic=True)
    assert any("input_ids dim 1" in d or "arg0 dim 1" in d for d in fused.report.dynamic["dims"])
    assert fused.report.dynamic.get("guarded"), fused.report.dynamic  # the excluded sample is named
    for batch, seq in [(1, 9), (3, 40), (2, 3), (1, 7)]:
        x = torch.randint(1, 500, (batch, seq))
        m = torch.ones(batch, seq, dtype=torch.long)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                torch.testing.assert_close(fused(x, attention_mask=m)[0], model(x, attention_mask=m)[0],
                                           atol=1e-4, rtol=1e-4)
        warned = [w for w in caught if "outside the dynamic range" in str(w.message) or "excludes" in str(w.message)]
        assert bool(warned) == (seq <= 7), (seq, [str(w.message) for w in caught])
    assert len(fused.reports) == 3 and len(fused.replans) == 2
