"""opfuse.rope_qk_cache — RoPE on q and k with k's rotated rows and v written into the KV
cache in place — against float64 and against the unfused ops it replaces (rope_qk, then two
``index_copy_``); and the rewrite that fuses them: what it fuses, what it must refuse."""

import operator

import pytest
import torch

import opfuse  # noqa: F401  (registers torch.ops.opfuse.*)
from opfuse.kernels import reference
from opfuse.rewrite import rope_cache_writes

aten = torch.ops.aten
OP = torch.ops.opfuse.rope_qk_cache.default


def _inputs(b=2, h=4, hkv=2, s=1, d=8, length=6, strided=True, tables=None, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)
    q, k, v = r(b, s, h, d).transpose(1, 2), r(b, s, hkv, d).transpose(1, 2), r(b, s, hkv, d).transpose(1, 2)
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    bt = b if tables is None else tables
    cos, sin = r(bt, 1, s, d), r(bt, 1, s, d)
    return q, k, v, cos, sin, r(b, hkv, length, d), r(b, hkv, length, d)


def _unfused(q, k, v, cos, sin, layout, kc, vc, index):
    qo, ko = torch.ops.opfuse.rope_qk.default(q, k, cos, sin, layout)
    kc.index_copy_(2, index, ko)
    vc.index_copy_(2, index, v)
    return qo


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("case", [
    dict(s=1),                          # a decode step: by address
    dict(s=1, hkv=1, tables=1),         # MQA, one table for the batch
    dict(s=5, length=9),                # a prefill: strided q / k / v, the unfused path
    dict(s=3, strided=False, h=2, hkv=2, b=1),
])
def test_equals_float64_and_the_unfused_ops(layout, case):
    q, k, v, cos, sin, kc, vc = _inputs(**case)
    s, length = q.shape[2], kc.shape[2]
    index = torch.arange(s) + (length - s) // 2  # positions in the middle: rows before and after untouched
    ref_q, ref_k, ref_v = reference.rope_qk_cache(q, k, v, cos, sin, layout, kc, vc, index)
    kc2, vc2 = kc.clone(), vc.clone()
    want = _unfused(q, k, v, cos, sin, layout, kc2, vc2, index)
    out = OP(q, k, v, cos, sin, layout, kc, vc, index)
    torch.testing.assert_close(out.double(), ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc.double(), ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(vc.double(), ref_v)
    # the same float32 arithmetic as the ops it replaces: bit for bit (generate's tokens stay eager's)
    assert torch.equal(out, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert out.shape == q.shape and out.is_contiguous()


def test_cache_aliasing_an_input_takes_the_unfused_order():
    """k read from the cache itself (its rows are overwritten by the call): the result is the
    unfused ops' (rotate first, write after), not a row read half written."""
    q, _, v, cos, sin, kc, vc = _inputs(b=1, s=1)
    k = kc[:, :, 2:3]  # a view of the cache's row 2, written at row 2
    kc2, vc2 = kc.clone(), vc.clone()
    want = _unfused(q, kc2[:, :, 2:3], v, cos, sin, "rotate_half", kc2, vc2, torch.tensor([2]))
    out = OP(q, k, v, cos, sin, "rotate_half", kc, vc, torch.tensor([2]))
    assert torch.equal(out, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_bad_inputs_raise_named_errors_and_write_nothing():
    q, k, v, cos, sin, kc, vc = _inputs()
    before = kc.clone(), vc.clone()
    with pytest.raises(IndexError, match="outside the cache's 6 positions"):
        OP(q, k, v, cos, sin, "rotate_half", kc, vc, torch.tensor([6]))
    with pytest.raises(IndexError, match="outside"):
        OP(q, k, v, cos, sin, "rotate_half", kc, vc, torch.tensor([-1]))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])  # checked before any row is written
    with pytest.raises(ValueError, match="index must be a 1-D int64"):
        OP(q, k, v, cos, sin, "rotate_half", kc, vc, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="k_cache is torch.float16, the rows written into it are torch.float32"):
        OP(q, k, v, cos, sin, "rotate_half", kc.half(), vc, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"v_cache shape .* is not \[B, Hkv, L, D\]"):
        OP(q, k, v, cos, sin, "rotate_half", kc, vc[:, :1], torch.tensor([1]))
    with pytest.raises(ValueError, match="v shape"):
        OP(q, k, v[..., :4], cos, sin, "rotate_half", kc, vc, torch.tensor([1]))
    with pytest.raises(ValueError, match="q has no heads"):
        OP(q[:, :0], k, v, cos, sin, "rotate_half", kc, vc, torch.tensor([1]))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_no_new_tokens_writes_nothing():
    q, k, v, cos, sin, kc, vc = _inputs(s=0)
    before = kc.clone()
    out = OP(q, k, v, cos, sin, "rotate_half", kc, vc, torch.zeros(0, dtype=torch.int64))
    assert out.shape == q.shape and torch.equal(kc, before)


# --- the rewrite ------------------------------------------------------------------------


def _graph(variant: str = "plain") -> torch.fx.GraphModule:
    """rope_qk, then k_rot and v written into two cache placeholders by index_copy_ (the
    decode step's attention prologue), then an attention-like reader of q_rot and both
    caches. ``variant`` breaks one legality condition."""
    g = torch.fx.Graph()
    q, k, v, cos, sin, kc, vc, pos = (g.placeholder(n) for n in ("q", "k", "v", "cos", "sin", "kc", "vc", "pos"))
    example = _inputs()
    for node, value in zip((q, k, v, cos, sin, kc, vc), example):
        node.meta["val"] = value
    index = g.call_function(aten.add.Tensor, (pos, 0))
    both = g.call_function(torch.ops.opfuse.rope_qk.default, (q, k, cos, sin, "rotate_half"))
    q_rot = g.call_function(operator.getitem, (both, 0))
    k_rot = g.call_function(operator.getitem, (both, 1))
    wk = g.call_function(aten.index_copy_.default, (kc, 2, index, k_rot))
    between = g.call_function(aten.sum.default, (kc,)) if variant == "read_between" else None
    v_index = g.call_function(aten.add.Tensor, (pos, 0)) if variant == "other_index" else index
    wv = g.call_function(aten.index_copy_.default, (vc, 2, v_index, v))
    # readers after both writes: q_rot and the written caches (through the writes' results)
    extra = [g.call_function(aten.mul.Tensor, (q_rot, 2.0)), g.call_function(aten.mul.Tensor, (wk, 1.0)),
             g.call_function(aten.mul.Tensor, (wv, 1.0))]
    if variant == "k_rot_read":
        extra.append(g.call_function(aten.sum.default, (k_rot,)))
    if between is not None:
        extra.append(between)
    g.output(tuple(extra))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _assert_same(got, want):
    (outs, kc, vc), (outs0, kc0, vc0) = got, want
    assert len(outs) == len(outs0) and all(torch.equal(a, b) for a, b in zip(outs, outs0))
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def _run(gm):
    q, k, v, cos, sin, kc, vc = _inputs()
    return gm(q, k, v, cos, sin, kc, vc, torch.tensor([3])), kc, vc


def test_rewrite_fuses_rope_and_both_cache_writes():
    gm = _graph()
    want = _run(gm)
    assert rope_cache_writes(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert OP in targets
    assert not {aten.index_copy_.default, torch.ops.opfuse.rope_qk.default} & set(targets)
    _assert_same(_run(gm), want)


@pytest.mark.parametrize("variant", ["k_rot_read", "read_between", "other_index"])
def test_rewrite_refuses_what_would_change_a_result(variant):
    gm = _graph(variant)
    want = _run(gm)
    assert rope_cache_writes(gm) == 0
    assert OP not in [n.target for n in gm.graph.nodes]
    _assert_same(_run(gm), want)
