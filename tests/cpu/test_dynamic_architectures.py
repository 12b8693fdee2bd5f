"""Dynamic shapes across the architecture tier (opfuse.zoo: tiny configs, default settings,
padded batches): one optimize(dynamic=True) per architecture, then calls at other batch
sizes and sequence lengths (images / audio: other batch sizes) equal eager without a
re-plan, and every layer's attention stays fused over the whole range. Where torch.export
guards the sequence length (Mistral's sliding window, BART) the range starts there; Mistral's
test below checks that shorter calls re-plan once with a warning."""

import re
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


def _sequence_floor(fused) -> int:
    """The lowest sequence length of the plan's range ("… dim 1: s53 in [3, 256]")."""
    lows = [int(m.group(1)) for d in fused.report.dynamic.get("dims", []) if " dim 1:" in d
            for m in [re.search(r"in \[(\d+),", d)] if m]
    return max(lows, default=1)


def _samples(arch, fused):
    if arch.kind in ("image", "audio"):
        side = arch.sizes[0][1]
        return [(1, side), (3, side)]
    low = _sequence_floor(fused)
    return [(1, max(1, low)), (1, max(5, low)), (3, 33)]


def _run(name):
    arch = zoo.BY_NAME[name]
    model = _build(name)
    args, kwargs = arch.inputs(model, *arch.sizes[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = opfuse.optimize(model, args, example_kwargs=kwargs, dynamic=True)
    for i, (batch, seq) in enumerate(_samples(arch, fused)):
        x, kw = arch.inputs(model, batch, seq, seed=i + 1)
        with torch.no_grad():
            out, ref = zoo.first_output(fused(*x, **kw)), zoo.first_output(model(*x, **kw))
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, equal_nan=True)
    return fused


@pytest.mark.parametrize("name", [a.name for a in zoo.ARCHITECTURES if a.name != "mistral"])
def test_one_dynamic_plan_per_architecture(name):
    fused = _run(name)
    assert fused.report.dynamic.get("dims") and not fused.report.dynamic.get("refused"), fused.report.dynamic
    assert len(fused.reports) == 1 and fused.replans == []
    counts = fused.report.counts()
    want = zoo.BY_NAME[name].block_counts["attention"]
    assert counts.get("attention") == want, counts  # every layer's attention, over the whole range


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
