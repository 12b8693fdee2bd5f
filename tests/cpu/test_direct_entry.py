"""LibraryOp.direct: what plans call for opfuse's ops (rewrite.bind_op_builtins) — the op's
kernel without the dispatcher's round trip, with the same results, the same refusals and
the same profiler attribution."""

import pytest
import torch

import opfuse
from opfuse.kernels._library import LibraryOp
from opfuse.models import load


def _rms_args(requires_grad=False, rows=3):
    x = torch.randn(rows, 16)
    w = torch.randn(16, requires_grad=requires_grad)
    return x, w, 1e-6


def test_direct_equals_the_op():
    direct = LibraryOp.BY_NAME["rmsnorm"].direct
    args = _rms_args()
    assert torch.equal(direct(*args), torch.ops.opfuse.rmsnorm.default(*args))
    empty = _rms_args(rows=0)
    assert direct(*empty).shape == (0, 16)


def test_direct_refuses_what_needs_grad():
    direct = LibraryOp.BY_NAME["rmsnorm"].direct
    args = _rms_args(requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        direct(*args)
    with torch.no_grad():
        direct(*args)  # parameters that require grad are fine without grad mode


def test_profiled_calls_go_through_the_dispatcher():
    direct = LibraryOp.BY_NAME["rmsnorm"].direct
    args = _rms_args()
    with torch.profiler.profile() as prof:
        direct(*args)
    assert "opfuse::rmsnorm" in {e.name for e in prof.events()}


def test_plans_bind_opfuse_ops_to_their_direct_entry():
    loaded = load("bert-tiny", batch=2, seq=8)
    fused = opfuse.optimize(loaded.model, loaded.args, decide="rho")
    gm = next(iter(fused._plans.values())).gm
    scope = gm.forward.__func__.__closure__  # the bound forward (rewrite.bind_op_builtins)
    fast = next(c.cell_contents for c in scope if callable(c.cell_contents) and
                getattr(c.cell_contents, "__name__", "") == "forward")
    bound = {k: v for k, v in fast.__globals__.items() if k.startswith("_opfuse_bound_opfuse_")}
    assert bound and all(v is LibraryOp.BY_NAME[k.split("_opfuse_bound_opfuse_")[1].rsplit("_default", 1)[0]].direct
                         for k, v in bound.items())
    with torch.no_grad():
        torch.testing.assert_close(fused(*loaded.args).last_hidden_state, loaded.model(*loaded.args).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)
