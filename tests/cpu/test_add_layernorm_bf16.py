"""opfuse.add_layernorm_bf16 (precision="bf16"'s SkipLayerNorm: a bf16 GEMM's output + the
float32 residual, LayerNorm, written in float32 and bf16) against the float64 oracle; its
bf16 output is its float32 output rounded; NaN rows as eager's; refused inputs named; in
the precision pass it replaces cast + add + layer_norm + cast, and is undone exactly. Its
in-place form writes the same bits into its inputs, and runs only where nothing reads them
again (not where the hidden states are returned)."""

import copy

import pytest
import torch
from kernel_testing import needs_onednn_bf16

from opfuse import precision as P
from opfuse.kernels import reference
from opfuse.kernels.cpu.add_layernorm_bf16 import add_layernorm_bf16, add_layernorm_bf16_

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="bf16 plans run through oneDNN")
FASTER = lambda node, fp32, bf16: {"fp32": 2e-4, "bf16": 1e-4}  # noqa: E731  injected clock


def _inputs(m=33, n=96, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * 3 + offset).to(torch.bfloat16)
    return x, torch.randn(m, n, generator=g) + offset, torch.randn(n, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("offset", [0.0, 1e4])  # 1e4: the row shift keeps the variance exact
def test_against_float64(offset):
    x, r, w, b = _inputs(offset=offset)
    out, out_b = add_layernorm_bf16(x, r, w, b, 1e-5)
    ref, _ = reference.add_layernorm(x, r, w, b, 1e-5, False)
    assert out.dtype == torch.float32 and out_b.dtype == torch.bfloat16 and out.shape == x.shape
    assert float((out.double() - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    assert torch.equal(out_b, out.to(torch.bfloat16))  # round to nearest even, as torch's cast


def test_nan_rows_and_infinities_as_eager():
    x, r, w, b = _inputs(m=4, n=16)
    x[1, 3] = float("nan")
    r[2, 0] = float("inf")
    out, out_b = add_layernorm_bf16(x, r, w, b, 1e-5)
    eager = torch.nn.functional.layer_norm(x.float() + r, (16,), w, b, 1e-5)
    assert torch.equal(out.isnan(), eager.isnan()) and torch.equal(out_b.isnan(), eager.isnan())
    assert torch.allclose(out[[0, 3]], eager[[0, 3]], atol=1e-5)


def test_strided_and_empty_inputs():
    x, r, w, b = _inputs(m=8, n=32)
    rt = r.t().contiguous().t()  # same values, column-major
    assert torch.equal(add_layernorm_bf16(x, rt, w, b, 1e-5)[0], add_layernorm_bf16(x, r, w, b, 1e-5)[0])
    out, out_b = add_layernorm_bf16(x[:0], r[:0], w, None, 1e-5)
    assert out.shape == (0, 32) and out_b.shape == (0, 32)


def test_refuses_what_it_does_not_compute():
    x, r, w, b = _inputs(m=4, n=16)
    with pytest.raises(ValueError, match="add_layernorm_bf16: x must be bfloat16"):
        add_layernorm_bf16(x.float(), r, w, b, 1e-5)
    with pytest.raises(ValueError, match="add_layernorm_bf16: residual shape"):
        add_layernorm_bf16(x, r[:2], w, b, 1e-5)
    with pytest.raises(ValueError, match="add_layernorm_bf16: weight shape"):
        add_layernorm_bf16(x, r, w[:3], b, 1e-5)


def _plan():
    import opfuse
    from opfuse.models import load
    loaded = load("minilm", batch=2, seq=9)
    fused = opfuse.optimize(loaded.model, loaded.args, example_kwargs=loaded.kwargs, decide="rho", gemm="onednn",
                            theta=1.5)  # nothing fuses: the plain add + layer_norm a plan keeps
    return loaded, next(iter(fused._plans.values())).gm


@needs_onednn_bf16
def test_the_precision_pass_fuses_cast_add_layernorm_cast():
    """MiniLM (real weights), every region bf16: each LayerNorm after a bf16 GEMM (attention
    output, FFN output: 12) reads the GEMM's bf16 result and feeds the next GEMM bf16."""
    loaded, gm = _plan()
    ref = P._outputs(gm, loaded.args, loaded.kwargs)
    info = P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", timer=FASTER)
    assert info["add_layernorm_bf16"] == 12
    # each one's inputs (the GEMM's bf16 result, the residual stream) are read nowhere else
    # afterwards: all twelve run in place, the residual stream one buffer
    assert info["add_layernorm_bf16_inplace"] == 12
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.opfuse.add_layernorm_bf16_.default) == 12
    assert targets.count(torch.ops.opfuse.add_layernorm_bf16.default) == 0
    assert targets.count(torch.ops.aten.layer_norm.default) == 1  # the embeddings' LayerNorm
    e2e = P.end_to_end(P._outputs(gm, loaded.args, loaded.kwargs), ref)
    assert e2e["min_cosine"] >= P.COSINE_MIN and e2e["max_error"] <= P.E2E_FACTOR * info["tolerance"]
    from types import SimpleNamespace

    from opfuse.report.text import precision_line
    assert "12 add + LayerNorm after a bf16 GEMM fused" in precision_line(SimpleNamespace(precision=info))
    assert "12 in place)" in precision_line(SimpleNamespace(precision=info))


@needs_onednn_bf16
def test_undone_exactly(monkeypatch):
    """fuse → undo gives the plan's outputs bit for bit (the end-to-end check's way back)."""
    real = P.fuse_add_layernorm_bf16
    monkeypatch.setattr(P, "fuse_add_layernorm_bf16", lambda gm: [])
    loaded, plain = _plan()
    P.apply_precision(plain, loaded.args, loaded.kwargs, "bf16", timer=FASTER)
    before = P._outputs(plain, loaded.args, loaded.kwargs)
    done = real(plain)
    assert len(done) == 12
    plain.recompile()
    fused = P._outputs(plain, loaded.args, loaded.kwargs)
    assert not all(torch.equal(a, b) for a, b in zip(before, fused))  # it did run
    P._unfuse_add_layernorm_bf16(plain, done)
    plain.recompile()
    after = P._outputs(plain, loaded.args, loaded.kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@needs_onednn_bf16
def test_the_fused_float32_add_layernorm_is_taken_over_too():
    """A plan whose SkipLayerNorms are already opfuse.add_layernorm (the float32 plan's fusion,
    as BERT-base's): after a bf16 GEMM each becomes opfuse.add_layernorm_bf16 as well (12), the
    embeddings' (no bf16 operand) stays; the outputs within the budget of the float32 plan."""
    loaded, gm = _plan()
    for ln in [n for n in gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default]:
        add = ln.args[0]
        if add.target is not torch.ops.aten.add.Tensor:
            continue
        with gm.graph.inserting_before(ln):
            op = gm.graph.call_function(torch.ops.opfuse.add_layernorm.default, (*add.args, *ln.args[2:5]))
        op.meta["val"] = ln.meta["val"]
        ln.replace_all_uses_with(op)
        gm.graph.erase_node(ln)
        gm.graph.erase_node(add)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.opfuse.add_layernorm.default) == 13
    ref = P._outputs(gm, loaded.args, loaded.kwargs)
    info = P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", timer=FASTER)
    assert info["add_layernorm_bf16"] == 12
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.opfuse.add_layernorm_bf16.default) \
        + targets.count(torch.ops.opfuse.add_layernorm_bf16_.default) == 12
    assert targets.count(torch.ops.opfuse.add_layernorm.default) == 1
    e2e = P.end_to_end(P._outputs(gm, loaded.args, loaded.kwargs), ref)
    assert e2e["min_cosine"] >= P.COSINE_MIN and e2e["max_error"] <= P.E2E_FACTOR * info["tolerance"]


def test_in_place_form_writes_the_same_bits_into_its_inputs():
    x, r, w, b = _inputs(m=17, n=64, offset=3.0)
    x[2, 5] = float("nan")  # NaN rows as the functional form's
    out, out_b = add_layernorm_bf16(x, r, w, b, 1e-5)
    xi, ri = x.clone(), r.clone()
    assert torch.ops.opfuse.add_layernorm_bf16_(xi, ri, w, b, 1e-5) is None
    assert torch.equal(ri.nan_to_num(7.0), out.nan_to_num(7.0)) and torch.equal(xi.nan_to_num(7.0), out_b.nan_to_num(7.0))
    ref, _ = reference.add_layernorm(x, r, w, b, 1e-5, False)
    keep = ~ref.isnan().any(-1)
    assert float((ri[keep].double() - ref[keep]).abs().max()) < 1e-4 * float(ref[keep].abs().max())
    with pytest.raises(ValueError, match="add_layernorm_bf16_: x and residual must be contiguous"):
        add_layernorm_bf16_(x, r.t().contiguous().t(), w, b, 1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_in_place_by_address_and_by_views_write_the_same_bits(monkeypatch, with_bias, threads):
    """The in-place form reads float32 contiguous tensors by address when it runs serially,
    through numpy views otherwise (a strided weight, several threads): the same bits."""
    from opfuse.kernels.cpu import add_layernorm_bf16 as M
    x, r, w, b = _inputs(m=70, n=128, offset=2.0)
    x[3, 7] = float("nan")
    b = b if with_bias else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, _ = reference.add_layernorm(x, r, w, b, 1e-5, False)
        runs = []
        for address in (True, False):
            monkeypatch.setattr(M, "by_address", M.by_address if address else (lambda *t: False))
            xi, ri = x.clone(), r.clone()
            add_layernorm_bf16_(xi, ri, w, b, 1e-5)
            runs.append((xi.nan_to_num(7.0), ri.nan_to_num(7.0)))
        strided_w = torch.stack([w, w], 1)[:, 0]  # not contiguous: the views path, same values
        xi, ri = x.clone(), r.clone()
        assert not strided_w.is_contiguous()
        add_layernorm_bf16_(xi, ri, strided_w, b, 1e-5)
        runs.append((xi.nan_to_num(7.0), ri.nan_to_num(7.0)))
    finally:
        torch.set_num_threads(old)
    for xi, ri in runs[1:]:
        assert torch.equal(xi, runs[0][0]) and torch.equal(ri, runs[0][1])
    keep = ~ref.isnan().any(-1)
    assert keep.sum() == 69
    got = runs[0][1][keep].double()
    assert float((got - ref[keep]).abs().max()) < 1e-4 * float(ref[keep].abs().max())


@needs_onednn_bf16
def test_in_place_only_where_nothing_reads_the_inputs_again():
    """output_hidden_states=True returns every layer's hidden state: the attention block's
    SkipLayerNorm would overwrite the layer's input, a graph output, so those six stay
    functional; the FFN's six overwrite the attention block's output (read nowhere else) and
    run in place. The hidden states are bit for bit those of the plan without the pass."""
    import opfuse
    from opfuse.models import load
    loaded = load("minilm", batch=2, seq=9)
    loaded.model.config.output_hidden_states = True
    fused = opfuse.optimize(loaded.model, loaded.args, example_kwargs=loaded.kwargs, decide="rho", gemm="onednn",
                            theta=1.5)
    gm = next(iter(fused._plans.values())).gm
    plain = copy.deepcopy(gm)
    info = P.apply_precision(gm, loaded.args, loaded.kwargs, "bf16", timer=FASTER)
    assert info["add_layernorm_bf16"] == 12 and info["add_layernorm_bf16_inplace"] == 6
    outs = P._outputs(gm, loaded.args, loaded.kwargs)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(P, "inplace_add_layernorm_bf16", lambda g: [])
    try:
        P.apply_precision(plain, loaded.args, loaded.kwargs, "bf16", timer=FASTER)
    finally:
        monkey.undo()
    assert all(torch.equal(a, b) for a, b in zip(outs, P._outputs(plain, loaded.args, loaded.kwargs)))
    assert len(outs) >= 7  # last_hidden_state, pooler output, 7 hidden states
    with torch.no_grad():
        eager = loaded.model(*loaded.args, **loaded.kwargs)
    for got, want in zip(outs[-7:], eager.hidden_states):
        assert float((got - want).abs().max()) < 0.1 * float(want.abs().max())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.opfuse.add_layernorm_bf16_.default) == 6
    assert targets.count(torch.ops.opfuse.add_layernorm_bf16.default) == 6


def test_optimized_module_in_place_is_repeatable_and_leaves_inputs_alone():
    """precision="bf16" end to end: the in-place SkipLayerNorms reuse the plan's own buffers,
    so two calls give the same bits, the inputs are unchanged, and the output is within the
    bf16 budget of eager's."""
    import opfuse
    from opfuse.models import load
    loaded = load("minilm", batch=2, seq=16)
    ids, mask = (t.clone() for t in loaded.args)
    fused = opfuse.optimize(loaded.model, loaded.args, example_kwargs=loaded.kwargs, precision="bf16")
    p = fused.report.precision
    with torch.no_grad():
        a = fused(*loaded.args, **loaded.kwargs)[0].clone()
        b = fused(*loaded.args, **loaded.kwargs)[0]
        eager = loaded.model(*loaded.args, **loaded.kwargs)[0]
    assert torch.equal(a, b)
    assert torch.equal(loaded.args[0], ids) and torch.equal(loaded.args[1], mask)
    cos = torch.nn.functional.cosine_similarity(a.flatten(1), eager.flatten(1)).min()
    assert float(cos) >= P.COSINE_MIN
    assert p["add_layernorm_bf16_inplace"] <= p["add_layernorm_bf16"]
