"""Never a wrong answer: dtypes, legality refusals (must-not-fuse), bad inputs, NaN/Inf,
layouts, CLI errors, verification switches and peak memory (docs/reliability.md)."""

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse.verify import TOLERANCE, VerificationError, compare


def _tiny_bert(**cfg):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                vocab_size=1000, attn_implementation="eager")
    return BertModel(BertConfig(**{**base, **cfg})).eval()


def _ids(b=2, s=16):
    ids = torch.randint(0, 1000, (b, s))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[-1, s * 3 // 4:] = 0
    return ids, mask


def _check(model, fused, *args):
    with torch.no_grad():
        ref, out = model(*args), fused(*args)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if hasattr(ref, "last_hidden_state"):
        refs, outs = (ref.last_hidden_state,), (out.last_hidden_state,)
    for o, r in zip(outs, refs):
        err = compare(o, r)
        assert err <= TOLERANCE[r.dtype], f"error {err} > {TOLERANCE[r.dtype]} for {r.dtype}"
    return outs, refs


# --- 2. dtypes ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tiny_bert_each_dtype(dtype):
    model = _tiny_bert().to(dtype)
    args = _ids()
    fused = opfuse.optimize(model, args)
    _check(model, fused, *args)
    assert fused.report.dtype == str(dtype).replace("torch.", "")
    assert fused.report.counts().get("attention") == 2, fused.report.counts()
    assert fused.report.max_error <= TOLERANCE[dtype]


# --- 3. legality: constants read from the graph, unsupported shapes, layouts, consumers ----


def test_non_default_eps_and_tanh_gelu_are_carried():
    model = _tiny_bert(layer_norm_eps=0.25, hidden_act="gelu_pytorch_tanh")
    args = _ids()
    fused = opfuse.optimize(model, args)
    _check(model, fused, *args)
    variants = {(r.pattern, r.variant) for r in fused.report.fused}
    counts = fused.report.counts()
    assert ("ffn", "tanh") in variants and counts["add_layernorm"] == 3 and counts["linear_add_layernorm"] == 2


class _SDPA(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)


def test_sdpa_scale_and_bool_mask_semantics_kept():
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    mask = torch.rand(2, 1, 8, 8) > 0.3
    mask[..., 0] = True
    fused = opfuse.optimize(_SDPA().eval(), (q, k, v, mask))
    assert fused.report.counts() == {"attention": 1}
    _check(_SDPA(), fused, q, k, v, mask)


class _Eager(torch.nn.Module):
    def __init__(self, perm=None):
        super().__init__()
        self.perm = perm

    def forward(self, q, k, v, mask):
        kt = k.transpose(-2, -1) if self.perm is None else k.permute(*self.perm)
        return torch.matmul(torch.softmax(torch.matmul(q, kt) * 0.3 + mask, dim=-1), v)


@pytest.mark.parametrize("perm", [(0, 1, 3, 2), (0, 2, 3, 1), (0, 3, 1, 2)])
def test_attention_permuted_k_never_fused_wrongly(perm):
    q, k, v = (torch.randn(2, 8, 8, 8) for _ in range(3))  # all dims equal: every permute is shape-legal
    mask = torch.zeros(2, 1, 1, 8)
    model = _Eager(perm).eval()
    fused = opfuse.optimize(model, (q, k, v, mask))
    _check(model, fused, q, k, v, mask)
    if perm != (0, 1, 3, 2):  # not a transpose of the last two dims: must never fuse
        assert "attention" not in fused.report.counts()


def test_bool_mask_added_to_scores_is_refused():
    """``scores + bool_mask`` adds 0/1; the kernel would treat it as keep/drop. An all-True
    example mask would even pass verification, so legality must refuse it."""
    q, k, v = (torch.randn(2, 2, 8, 8) for _ in range(3))
    model = _Eager().eval()
    fused = opfuse.optimize(model, (q, k, v, torch.ones(2, 1, 1, 8, dtype=torch.bool)))
    assert fused.report.counts() == {}
    assert any("added to the scores" in r.reason for r in fused.report.regions)
    _check(model, fused, q, k, v, torch.rand(2, 1, 1, 8) > 0.5)


def test_layernorm_without_affine_refused():
    class M(torch.nn.Module):
        def forward(self, x, r):
            return F.layer_norm(x + r, (32,), eps=1e-5)

    x, r = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    fused = opfuse.optimize(M().eval(), (x, r))
    assert fused.report.counts() == {}
    assert any("no affine weight" in r.reason for r in fused.report.regions)
    _check(M(), fused, x, r)


@pytest.mark.parametrize("bias_shape, fuses", [((1, 64), True),    # per-feature, broadcast-shaped: legal
                                               ((8, 64), False)])  # varies over the sequence: refused
def test_broadcast_bias(bias_shape, fuses):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 32))
            self.b = torch.nn.Parameter(torch.randn(bias_shape))

        def forward(self, x):
            return F.gelu(F.linear(x, self.w, self.b))

    x, model = torch.randn(4, 8, 32), M().eval()
    fused = opfuse.optimize(model, (x,))
    assert ("bias_gelu" in fused.report.counts()) == fuses, fused.report.counts()
    if not fuses:
        assert any("kernel supports only [64]" in r.reason for r in fused.report.regions), \
            [r.reason for r in fused.report.regions]
    _check(model, fused, x)


def test_bias_gelu_intermediate_with_other_consumer_blocks():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(32, 64)

        def forward(self, x):
            y = self.fc(x)
            return F.gelu(y) + y

    x = torch.randn(4, 8, 32)
    fused = opfuse.optimize(M().eval(), (x,))
    assert "bias_gelu" not in fused.report.counts()
    assert any("consumer" in nm["reason"] for nm in fused.report.near_misses)


# --- 4. bad input ------------------------------------------------------------------------


def test_training_mode_model_refused():
    with pytest.raises(opfuse.OptimizeError, match="training mode"):
        opfuse.optimize(_tiny_bert().train(), _ids())


class _FFN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def test_other_dtype_call_errors_like_eager():
    model = _FFN().eval()
    fused = opfuse.optimize(model, (torch.randn(2, 8, 32),))
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="dtype"):
        model(x)
    with pytest.raises(RuntimeError, match="dtype"):
        fused(x)


def test_model_converted_after_optimize_is_replanned():
    model = _tiny_bert()
    args = _ids()
    fused = opfuse.optimize(model, args)
    model.to(torch.bfloat16)  # the folded QKV copy is float32: must not be reused
    _check(model, fused, *args)


def test_nan_embedding_row_matches_eager_nan_pattern():
    model = _tiny_bert()
    ids, mask = _ids()
    ids[0, 3] = 5
    ids[1] = torch.where(ids[1] == 5, 6, ids[1])
    fused = opfuse.optimize(model, (ids, mask))
    with torch.no_grad():
        model.embeddings.word_embeddings.weight[5] = float("nan")
    (out,), (ref,) = _check(model, fused, ids, mask)
    assert torch.isnan(ref[0]).all() and not torch.isnan(ref[1]).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))


def test_fully_masked_row_nan_like_eager():
    q, k, v = (torch.randn(2, 2, 8, 8) for _ in range(3))
    model = _Eager().eval()
    fused = opfuse.optimize(model, (q, k, v, torch.zeros(2, 1, 1, 8)))
    assert fused.report.counts() == {"attention": 1}
    dead = torch.zeros(2, 1, 1, 8)
    dead[1] = float("-inf")  # every key of batch 1 masked: eager softmax gives NaN
    (out,), (ref,) = _check(model, fused, q, k, v, dead)
    assert torch.isnan(ref[1]).all() and torch.equal(torch.isnan(out), torch.isnan(ref))


def test_inf_input_matches_eager_pattern():
    model = _FFN().eval()
    fused = opfuse.optimize(model, (torch.randn(2, 8, 32),))
    x = torch.randn(2, 8, 32)
    x[0, 1, 3] = float("inf")
    _check(model, fused, x)


def test_non_contiguous_and_channels_last_inputs():
    model = _FFN().eval()
    fused = opfuse.optimize(model, (torch.randn(2, 8, 32),))
    _check(model, fused, torch.randn(2, 32, 8).transpose(1, 2))
    _check(model, fused, torch.randn(4, 8, 32)[::2])

    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    x = torch.randn(2, 3, 12, 12).to(memory_format=torch.channels_last)
    fused = opfuse.optimize(conv, (x,))
    _check(conv, fused, x)
    _check(conv, fused, torch.randn(2, 3, 12, 12))


def test_no_matching_pattern_runs_unchanged_and_says_why():
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    x = torch.randn(2, 3, 12, 12)
    fused = opfuse.optimize(conv, (x,))
    assert fused.report.counts() == {}
    (why,) = fused.report.near_misses
    assert "no pattern" in why["reason"] and "conv2d" in why["reason"] and "relu" in why["reason"]
    assert "Fused regions: 0" in str(fused.report) and "no pattern" in str(fused.report)
    _check(conv, fused, x)


@pytest.mark.parametrize("name", ["nosuchmodel", "./missing/dir"])
def test_cli_bad_model_one_line_error(name, capsys):
    from opfuse.cli import main
    assert main(["optimize", name]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opfuse: error:") and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_broken_model_dir_one_line_error(tmp_path, capsys):
    from opfuse.cli import main
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert main(["optimize", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opfuse: error:") and len(err.splitlines()) == 1


# --- 6. verification switches ------------------------------------------------------------


def test_verify_false_says_skipped():
    model = _FFN().eval()
    fused = opfuse.optimize(model, (torch.randn(2, 8, 32),), verify=False)
    assert fused.report.verified is False and "SKIPPED" in str(fused.report)
    assert all(r.verify_error is None for r in fused.report.regions)


def test_strict_names_region_and_error(monkeypatch):
    from opfuse.kernels import registry
    real = registry.lookup("ffn", "cpu")
    monkeypatch.setitem(registry.REGISTRY._kernels, ("ffn", "cpu"), lambda *a: real(*a) * 1.01)
    model = _FFN().eval()
    x = torch.randn(2, 8, 32)
    with pytest.raises(VerificationError, match=r"ffn at \w+: verification failed: max error"):
        opfuse.optimize(model, (x,), strict=True)
    fused = opfuse.optimize(model, (x,))
    assert fused.report.counts() == {} and any(r.decision == "reverted" for r in fused.report.regions)
    _check(model, fused, x)


# --- 7. memory ---------------------------------------------------------------------------

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _status(field: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))


def _peak_rss(fn) -> int:
    """Peak RSS increase (bytes) while ``fn`` runs (after one warm-up call)."""
    import ctypes
    import gc
    with torch.no_grad():
        fn()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = _status("VmRSS:")
    with torch.no_grad():
        out = fn()
    del out
    return _status("VmHWM:") - base


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs") or sys.platform != "linux",
                    reason="needs Linux peak-RSS reset and glibc")
def test_peak_memory_not_above_eager():
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    model = _tiny_bert(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    ids, mask = torch.randint(0, 1000, (4, 128)), torch.ones(4, 128, dtype=torch.long)
    # gemm="aten": which GEMM layout is measured fastest per shape differs between machines
    # (a pre-transposed "wt" copy is an extra the report lists: tests/cpu/test_gemm.py)
    fused = opfuse.optimize(model, (ids, mask), gemm="aten")
    fused(torch.randint(0, 1000, (1, 8)), torch.ones(1, 8, dtype=torch.long))  # a second plan
    threads = torch.get_num_threads()
    libc.mallopt(M_MMAP_THRESHOLD, 65536)  # buffers >= 64 KiB via mmap: RSS follows every free
    torch.set_num_threads(1)
    try:
        # RSS is noisy (allocator state left by earlier tests): best of three, interleaved
        runs = [(_peak_rss(lambda: model(ids, mask)), _peak_rss(lambda: fused(ids, mask))) for _ in range(3)]
        eager, ours = min(r[0] for r in runs), min(r[1] for r in runs)
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        torch.set_num_threads(threads)
    assert ours <= eager, (ours, eager)  # activations: the S×S scores are never materialised
    # the only weights the fused module owns are the concatenated QKV weights, once for all plans
    model_ptrs = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
    extra = {t.data_ptr(): (n, t.numel() * t.element_size()) for p in fused._plans.values()
             for n, t in (*p.gm.named_parameters(), *p.gm.named_buffers()) if t.data_ptr() not in model_ptrs}
    qkv = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
              if any(k in n for k in ("query.", "key.", "value.")))
    assert sum(b for n, b in extra.values()) == qkv
