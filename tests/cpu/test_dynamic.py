"""Dynamic shapes (opfuse.graph.dynamic): one optimize serves every batch and sequence length
of the range, each call equal to the eager model; the same fusions as the static plan;
out-of-range calls re-plan once with a warning (an error under strict); a legality check
that holds only at the example size, or a kernel wrong at another size, does not fuse."""

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

import opfuse
from opfuse import pipeline
from opfuse.graph.dynamic import DynamicShapeError, auto_shapes, resize
from opfuse.models import load

sys.path.insert(0, str(Path(__file__).parents[1] / "golden"))
from plans import CASES, path_of  # noqa: E402


def _inputs(vocab: int, batch: int, seq: int, mask: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if not mask:
        return (ids,)
    m = torch.ones(batch, seq, dtype=torch.long)
    m[0, seq // 2 + 1:] = 0  # right padding in the first row
    if batch > 1:
        m[-1, : seq // 3] = 0  # left padding in the last row
        m[-1, -1] = 1
    return ids, m


def _close(out, ref):
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{a}" for m, a, _, _ in CASES])
def test_golden_plan_is_the_same_dynamic(case):
    """Every golden plan is identical between the static and the dynamic capture, and the
    dynamic plan serves two other sizes without re-planning."""
    model, attn, batch, seq = case
    golden = json.loads(path_of(model, attn).read_text())
    loaded = load(model, batch=batch, seq=seq, attn=attn)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic=True)
    assert dict(sorted(fused.report.counts().items())) == golden["fused"]
    assert fused.report.dynamic["dims"], fused.report.dynamic
    if model.startswith("vit"):
        others = [(torch.randn(1, *loaded.args[0].shape[1:]),), (torch.randn(3, *loaded.args[0].shape[1:]),)]
    else:
        vocab = loaded.model.config.vocab_size
        mask = len(loaded.args) > 1
        others = [_inputs(vocab, 1, 7, mask), _inputs(vocab, 3, 77, mask)]
    for args in others:
        with torch.no_grad():
            _close(fused(*args), loaded.model(*args))
    assert len(fused.reports) == 1 and fused.replans == []


@pytest.fixture(scope="module")
def bert():
    loaded = load("bert-tiny", batch=4, seq=64)
    return loaded, opfuse.optimize(loaded.model, loaded.args, dynamic=True)


@pytest.mark.parametrize("seq", [1, 7, 77, 128, 129, 300])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_bert_every_length_no_replan(bert, batch, seq):
    loaded, fused = bert
    args = _inputs(loaded.model.config.vocab_size, batch, seq, mask=True, seed=batch * 1000 + seq)
    with torch.no_grad():
        _close(fused(*args), loaded.model(*args))
    assert len(fused.reports) == 1 and fused.replans == []


def test_bert_report_ranges_and_verified_sizes(bert):
    _, fused = bert
    d = fused.report.dynamic
    assert any("dim 1" in line and "[1, 512]" in line for line in d["dims"]), d  # max_position_embeddings
    assert len(d["verified_at"]) >= 3
    assert any(set(sizes.values()) == {1} for sizes in d["verified_at"])  # the range's minimum
    assert fused.report.max_error < 1e-4
    from opfuse.report.text import dynamic_line
    assert "one plan for" in dynamic_line(fused.report)


def test_decoder_dynamic_lengths():
    loaded = load("llama-tiny", batch=2, seq=32)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic=True)
    assert fused.report.counts().get("rope", 0) > 0 and fused.report.counts().get("attention", 0) > 0
    for batch, seq in [(1, 1), (1, 5), (3, 40), (2, 100)]:
        (ids,) = _inputs(loaded.model.config.vocab_size, batch, seq, mask=False, seed=seq)
        with torch.no_grad():
            _close(fused(ids), loaded.model(ids))
    assert len(fused.reports) == 1


def test_outside_the_range_replans_once_with_a_warning():
    loaded = load("bert-tiny", batch=2, seq=16)
    shapes = auto_shapes(loaded.model, loaded.args, {})
    seq_dim = torch.export.Dim("seq", min=2, max=32)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic_shapes={"input_ids": {1: seq_dim},
                                                                       "attention_mask": {1: seq_dim}})
    assert shapes  # the automatic form exists for this model too
    assert any("[2, 32]" in line for line in fused.report.dynamic["dims"]), fused.report.dynamic
    args = _inputs(loaded.model.config.vocab_size, 2, 40, mask=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            _close(fused(*args), loaded.model(*args))
            fused(*args)
    assert [w for w in caught if "outside the dynamic range [2, 32]" in str(w.message)]
    assert len(fused.reports) == 2 and len(fused.replans) == 1
    strict = opfuse.optimize(loaded.model, loaded.args, strict=True,
                             dynamic_shapes={"input_ids": {1: seq_dim}, "attention_mask": {1: seq_dim}})
    with pytest.raises(DynamicShapeError, match="input_ids|arg0"):
        strict(*args)


def test_a_check_that_assumes_a_size_does_not_fuse():
    """Legality must hold over the whole range: a check that compares a dynamic size
    (here: sequence > 64, true at the example) adds a shape guard and its region is refused,
    with the reason; the static plan of the same shapes fuses it."""
    from dataclasses import replace

    from opfuse.patterns import LIBRARY
    from opfuse.patterns.common import val

    def sized(original):
        def check(m):
            x = val(next(iter(m.inputs.values())))
            if x.shape[1] <= 64:  # a size assumption on the sequence dim
                return "too short"
            return original(m) if original else None
        return check
    library = [replace(p, check=sized(p.check)) if p.name == "add_layernorm" else p for p in LIBRARY]
    loaded = load("bert-tiny", batch=2, seq=100)
    dyn = pipeline.run(loaded.model, loaded.args, {}, dynamic=True, patterns=library).report
    static = pipeline.run(loaded.model, loaded.args, {}, patterns=library).report
    assert static.counts().get("add_layernorm", 0) > 0
    assert dyn.counts().get("add_layernorm", 0) == 0
    assert any(r.pattern == "add_layernorm" and "legal at the example size only" in r.reason for r in dyn.regions)


def test_a_region_wrong_at_another_size_reverts(monkeypatch):
    """Verification runs at the range's other sizes: a fused result that is wrong only for a
    batch of one reverts its regions (the static plan at the example size keeps them)."""
    from opfuse import verify
    real = verify.run_region

    def wrong_for_one_row(cand, env):
        outs = real(cand, env)
        if cand.match.pattern.name == "attention" and outs[0].shape[0] == 1:
            return [o + 1.0 for o in outs]
        return outs
    monkeypatch.setattr(verify, "run_region", wrong_for_one_row)
    loaded = load("bert-tiny", batch=2, seq=32)
    report = pipeline.run(loaded.model, loaded.args, {}, dynamic=True).report
    reverted = [r for r in report.regions if r.pattern == "attention" and r.decision == "reverted"]
    assert reverted and report.counts().get("attention", 0) == 0
    assert pipeline.run(loaded.model, loaded.args, {}).report.counts().get("attention", 0) > 0


def test_dynamic_capture_refused_falls_back_static(monkeypatch):
    from opfuse.graph import capture as cap
    from opfuse.graph.capture import CaptureError
    real = cap.capture

    def no_dynamic(model, args, kwargs=None, dynamic_shapes=None):
        if dynamic_shapes is not None:
            raise CaptureError("opfuse: torch.export could not capture it dynamically (test)")
        return real(model, args, kwargs)
    monkeypatch.setattr(pipeline, "capture", no_dynamic)
    loaded = load("bert-tiny", batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic=True)
    assert "static plan of these shapes" in fused.report.dynamic["refused"]
    with torch.no_grad():
        _close(fused(*loaded.args), loaded.model(*loaded.args))


def test_resize_keeps_values_and_bad_dynamic_arguments():
    t = torch.arange(6).reshape(2, 3)
    assert resize(t, {1: 7}).tolist() == [[0, 1, 2, 0, 1, 2, 0], [3, 4, 5, 3, 4, 5, 3]]
    assert resize(t, {0: 1, 1: 2}).tolist() == [[0, 1]]
    loaded = load("bert-tiny", batch=2, seq=16)
    with pytest.raises(opfuse.OptimizeError, match="dynamic must be True or False"):
        opfuse.optimize(loaded.model, loaded.args, dynamic="yes")


def test_decided_at_the_example_size_not_the_widened_capture():
    """A batch of one is captured as two (export would fix a dim of 1), but the cost model
    and the GEMM choices see the example's sizes: the same bytes and GEMM shapes as the
    static plan."""
    loaded = load("bert-tiny", batch=1, seq=16)
    static = opfuse.optimize(loaded.model, loaded.args).report
    dyn = opfuse.optimize(loaded.model, loaded.args, dynamic=True).report
    assert [(r.pattern, r.bytes_unfused, r.bytes_fused) for r in dyn.regions] == \
        [(r.pattern, r.bytes_unfused, r.bytes_fused) for r in static.regions]
    assert [g["m"] for g in dyn.gemm] == [g["m"] for g in static.gemm] and dyn.gemm[0]["m"] == 16
    assert dyn.dynamic["decided_at"] and set(dyn.dynamic["decided_at"].values()) == {1, 16}


def test_a_capture_wrong_at_another_size_is_not_dynamic(monkeypatch):
    """The unfused dynamic capture is checked against eager at the range's other sizes
    before anything fuses: a capture export specialised at the example size (simulated: the
    check reports an error at one token) gives the static plan, with the reason."""
    from opfuse.verify import model_error
    real = model_error

    def wrong_at_one_token(model, gm, args, kwargs):
        if args[0].shape[1] == 1:
            return 1.0
        return real(model, gm, args, kwargs)
    monkeypatch.setattr(pipeline, "model_error", wrong_at_one_token)
    loaded = load("bert-tiny", batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic=True)
    assert "differs from the eager model" in fused.report.dynamic["refused"]
    assert fused.report.counts()  # the static plan still fuses
    with pytest.raises(pipeline.DynamicCaptureError):
        opfuse.optimize(loaded.model, loaded.args, dynamic=True, strict=True)


def test_token_buckets_of_a_range():
    """Buckets cut the range's tokens (batch × sequence) at TOKEN_BUCKETS; a bucket is
    decided at its geometric middle (the last, open one at 3x its start), at the example's
    batch; a bucket plan's GEMMs must also win at its bucket's ends, the range's end
    excluded (no request has 1024 × 512 tokens)."""
    from dataclasses import replace

    from opfuse.graph.dynamic import DynamicSpec, bucket_of, token_buckets
    spec = DynamicSpec(dims=((0, 0, "b"), (0, 1, "s"), (1, 0, "b2"), (1, 1, "s")),
                       ranges=(("b", 1, 1024), ("s", 1, 512), ("b2", 1, 1024)))
    assert spec.token_range() == (1, 1024 * 512)
    assert token_buckets(spec) == [(1, 16, 4), (17, 128, 47), (129, 1024 * 512, 387)]
    assert bucket_of(spec, 16) == (1, 16) and bucket_of(spec, 17) == (17, 128) and bucket_of(spec, 0) is None
    assert spec.sizes_for_tokens({"b": 8, "s": 128, "b2": 8}, 4) == {"b": 8, "s": 1, "b2": 8}  # the batch stays
    assert spec.sizes_for_tokens({"b": 1, "s": 128, "b2": 1}, 600) == {"b": 1, "s": 512, "b2": 1}  # the range's end
    images = DynamicSpec(dims=((0, 0, "b"),), ranges=(("b", 1, 64),))  # only the batch: tokens = images
    assert token_buckets(images) == [(1, 16, 4), (17, 64, 33)]
    ids = torch.ones(1, 128, dtype=torch.long)
    at = lambda s: {"b": 1, "s": s, "b2": 1}  # noqa: E731
    assert pipeline.gemm_sizes(replace(spec, tokens=(17, 128)), (ids, ids), {}) == [at(17), at(128)]
    assert pipeline.gemm_sizes(replace(spec, tokens=(129, 1024 * 512)), (ids, ids), {}) == [at(129)]
    assert pipeline.gemm_sizes(spec, (ids, ids), {}) == [at(1), at(16)]  # no bucket: the minimum, a short call
    assert pipeline.gemm_sizes(images, (torch.ones(8, 3, 4, 4),), {}) == [{"b": 1}]  # no sequence: the minimum
    assert pipeline.gemm_sizes(None, (ids,), {}) is None


BIG = 1024 * 512  # tokens at the end of bert-tiny's range (batch 1024 × 512 positions)


@pytest.fixture(scope="module")
def bert_buckets():
    """bert-tiny, dynamic, a plan per token bucket, each kept whatever it measured."""
    from opfuse import api
    loaded = load("bert-tiny", batch=4, seq=64)  # 256 tokens: the example's bucket is the last
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "BUCKET_MARGIN", -1.0)
        return loaded, opfuse.optimize(loaded.model, loaded.args, dynamic=True, buckets=True)


BUCKET_CALLS = [(1, 7, (1, 16)), (3, 5, (1, 16)), (1, 100, (17, 128)), (4, 32, (17, 128)),
                (4, 64, (129, BIG)), (1, 300, (129, BIG))]


def test_each_call_runs_its_token_buckets_plan(bert_buckets, tmp_path):
    """With buckets, optimize plans every token bucket up front, each decided inside its
    bucket (fusion and GEMM backends timed there), and a call runs the plan of its bucket,
    also after save → load."""
    loaded, fused = bert_buckets
    plans = list(fused._plans.values())
    assert [tuple(p.dynamic.tokens) for p in plans] == [(129, BIG), (1, 16), (17, 128)]
    assert [(r["tokens"], r["kept"]) for r in fused.report.dynamic["buckets"]] == \
        [([129, BIG], True), ([1, 16], True), ([17, 128], True)]
    for i, plan in enumerate(plans):
        lo, hi = plan.dynamic.tokens
        decided, sym = plan.report.dynamic["decided_at"], {(i, d): s for i, d, s in plan.dynamic.dims}
        assert lo <= decided[sym[(0, 0)]] * decided[sym[(0, 1)]] <= hi, (plan.dynamic.tokens, decided)
        # GEMMs with symbolic rows were also timed at the range's minimum (the example's plan,
        # as without buckets) or at the bucket's ends (the others)
        sizes = {int(k.split("@M=")[1]) for g in plan.report.gemm for k in g["times_s"] if "@M=" in k}
        assert sizes and (sizes == {1, 16} if i == 0 else all(lo <= m <= hi for m in sizes)), (plan.dynamic.tokens, sizes)
    from opfuse.report.text import dynamic_line
    assert "one plan (for calls of 129–524288 tokens) for" in dynamic_line(fused.report)
    back = opfuse.load(opfuse.save(fused, tmp_path / "buckets"))
    vocab = loaded.model.config.vocab_size
    for batch, seq, want in BUCKET_CALLS:
        args = _inputs(vocab, batch, seq, mask=True, seed=seq)
        assert fused.plan_for(args, {}).dynamic.tokens == want, (batch, seq)
        assert back.plan_for(args, {}).dynamic.tokens == want, (batch, seq)
        with torch.no_grad():
            out = fused(*args)
            _close(out, loaded.model(*args))
            assert torch.equal(back(*args).last_hidden_state, out.last_hidden_state)
    assert len(fused.reports) == 3 and fused.replans == [] and len(back.reports) == 3


def test_a_bucket_plan_not_measured_faster_is_dropped(monkeypatch):
    """A bucket's plan that is not BUCKET_MARGIN faster than the example's plan at the
    bucket's typical size is not kept (the report says so, with the measurement): every
    call runs the example's plan, correctly."""
    from opfuse import api
    monkeypatch.setattr(api, "BUCKET_MARGIN", 10.0)
    loaded = load("bert-tiny", batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic=True, buckets=True)
    rows = fused.report.dynamic["buckets"]
    assert [(r["tokens"], r["kept"]) for r in rows] == [([17, 128], True), ([1, 16], False), ([129, BIG], False)]
    assert all("dropped" in r["reason"] and r["bucket_s"] > 0 and r["first_s"] > 0 for r in rows[1:])
    from opfuse.report.text import dynamic_line
    assert "other token buckets: 1–16 dropped (" in dynamic_line(fused.report)
    for batch, seq in [(1, 3), (3, 200)]:
        args = _inputs(loaded.model.config.vocab_size, batch, seq, mask=True, seed=seq)
        with torch.no_grad():
            _close(fused(*args), loaded.model(*args))
    assert len(fused.reports) == 1 and fused.replans == []


def test_bucket_plans_share_their_weight_copies(monkeypatch):
    """Plans of several token buckets hold one copy of each prepacked / folded weight: the
    later plans reuse the first one's (same name, same model tensors), and stay correct."""
    from opfuse import api
    monkeypatch.setattr(api, "BUCKET_MARGIN", -1.0)
    loaded = load("bert-tiny", batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic=True, gemm="packed", buckets=True)
    buffers = [dict(p.gm.named_buffers()) for p in fused._plans.values()]
    assert len(buffers) == 3
    packed = [n for n, t in buffers[0].items() if n.startswith("opfuse_folded_") and t.is_mkldnn]
    assert packed
    for other in buffers[1:]:
        common = [n for n in other if n.startswith("opfuse_folded_") and n in buffers[0]]
        assert set(packed) <= set(common)
        assert all(other[n] is buffers[0][n] for n in common)
    for batch, seq in [(1, 3), (2, 40), (2, 200)]:
        args = _inputs(loaded.model.config.vocab_size, batch, seq, mask=True, seed=seq)
        with torch.no_grad():
            _close(fused(*args), loaded.model(*args))


def test_bad_buckets_are_refused():
    loaded = load("bert-tiny", batch=2, seq=16)
    for bad in [(0, 16), ("16",), 16, (True,)]:
        with pytest.raises(opfuse.OptimizeError, match="buckets must be"):
            opfuse.optimize(loaded.model, loaded.args, dynamic=True, buckets=bad)
    with pytest.raises(opfuse.OptimizeError, match="needs dynamic=True"):
        opfuse.optimize(loaded.model, loaded.args, buckets=True)
