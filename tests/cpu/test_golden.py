"""Golden fusion plans per model family (tests/golden/*.json): the fused-region count per
pattern must not change silently, and the fused model must equal eager within 1e-4."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "golden"))
from plans import CASES, path_of, plan  # noqa: E402


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{a}" for m, a, _, _ in CASES])
def test_golden_plan(case):
    golden = json.loads(path_of(case[0], case[1]).read_text())
    record, loaded, fused = plan(*case)
    assert record["fused"] == golden["fused"], (record["fused"], golden["fused"])
    assert record["matched"] == golden["matched"]
    with torch.no_grad():
        ref = loaded.model(*loaded.args)
        out = fused(*loaded.args)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)
