"""The Hugging Face architecture tier (issue #14): every row of ``opfuse.zoo`` built from
its tiny config with its default settings, with each attention implementation it has and a
padded batch; optimized once, then checked

* against the float64 model: the fused model's error may be at most a small multiple of
  eager float32's own error (plus a floor of a few float32 ulps of the output's scale);
* at a second shape (another batch and sequence length: a static re-plan);
* the fused count and the matched count per pattern against tests/golden/zoo.json;
* captured whole (no dynamo pieces) and optimized within a time bound.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from opfuse import zoo

sys.path.insert(0, str(Path(__file__).parents[1] / "golden"))
import zoo as golden_zoo  # noqa: E402  (tests/golden/zoo.py)

GOLDEN = json.loads(golden_zoo.PATH.read_text())
CASES = zoo.cases()
OPTIMIZE_SECONDS = 60.0   # tiny configs optimize in 0.3-2 s here; the bound catches a runaway search
ERROR_RATIO = 8.0         # fused error vs float64 <= ERROR_RATIO x eager float32's error + floor


def _double(args, kwargs):
    conv = (lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


def _check_against_float64(model, model64, fused, args, kwargs):
    with torch.no_grad():
        want = zoo.first_output(model64(*_double(args, kwargs)[0], **_double(args, kwargs)[1]))
        eager = zoo.first_output(model(*args, **kwargs))
        got = zoo.first_output(fused(*args, **kwargs))
    assert got.shape == want.shape and got.dtype == eager.dtype
    # NaN exactly where eager float32 has NaN; rows of a left-padded decoder that are fully
    # masked are NaN in the float64 model only (its finfo.min + finfo.min mask is -inf) and
    # are compared to eager, not to float64
    assert torch.equal(got.isnan(), eager.isnan()), "NaN positions differ from eager's"
    only64 = want.isnan() & ~eager.isnan()
    torch.testing.assert_close(got[only64], eager[only64], rtol=1e-4, atol=1e-4)
    ok = ~(want.isnan() | eager.isnan())
    want, eager, got = want[ok], eager[ok].double(), got[ok].double()
    assert ok.any()
    eager_err = float((eager - want).abs().max())
    err = float((got - want).abs().max())
    floor = 8 * torch.finfo(torch.float32).eps * float(want.abs().max())
    assert err <= ERROR_RATIO * eager_err + floor, (err, eager_err, floor)


@pytest.mark.parametrize("arch, attn", CASES, ids=[golden_zoo.key(a, t) for a, t in CASES])
def test_architecture(arch, attn):
    record, model, fused, args, kwargs, seconds = golden_zoo.plan(arch, attn)
    want = golden_zoo.expected(GOLDEN[golden_zoo.key(arch, attn)])
    assert record["fused"] == want["fused"], (record["fused"], want["fused"])
    assert record["matched"] == want["matched"], (record["matched"], want["matched"])
    assert record["capture"] == "whole", fused.report.capture
    assert seconds < OPTIMIZE_SECONDS, seconds
    model64 = copy.deepcopy(model).double()
    _check_against_float64(model, model64, fused, args, kwargs)
    batch, seq = arch.sizes[1]
    args2, kwargs2 = arch.inputs(model, batch, seq, seed=1)
    _check_against_float64(model, model64, fused, args2, kwargs2)


def test_tier_covers_the_issue_list():
    """At least 20 architectures, the issue's list among them, each with a golden plan."""
    names = {a.name for a in zoo.ARCHITECTURES}
    wanted = {"bert", "distilbert", "roberta", "albert", "electra", "deberta-v2", "modernbert", "clip-text",
              "clip-vision", "t5-encoder", "bart", "whisper-encoder", "opt", "gpt2", "gpt-neox", "gptj", "bloom",
              "falcon", "llama", "qwen2", "mistral", "gemma", "phi3", "vit", "dinov2", "swin"}
    assert wanted <= names and len(names) >= 20
    assert set(GOLDEN) == {golden_zoo.key(a, t) for a, t in CASES}
    sdpa = {a.name for a in zoo.ARCHITECTURES if "sdpa" in a.attns}
    assert {"bloom", "deberta-v2", "deberta-v3"}.isdisjoint(sdpa)  # transformers has no SDPA path for these


def test_cli_explains_a_tier_architecture(tmp_path):
    """``opfuse explain bloom`` (and ``optimize``) build the tier's row with its padded
    inputs: the plan fuses Bloom's ALiBi attention; an unknown name lists the tier's names."""
    from opfuse.cli import main
    from opfuse.models import ModelNotFound, load
    out = tmp_path / "bloom.json"
    assert main(["explain", "bloom", "--batch", "2", "--seq", "12", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert sum(r["decision"] == "fused" and r["pattern"] == "attention" for r in data["regions"]) == 2
    loaded = load("gemma", batch=2, seq=12, attn="sdpa")
    assert set(loaded.kwargs) == {"attention_mask"} and loaded.model.config._attn_implementation == "sdpa"
    with pytest.raises(ModelNotFound, match="deberta-v3"):
        load("no-such-model")
