"""GPU check of opfuse's Triton kernels: correctness, GB/s / TFLOP/s vs eager, block latency.

Run through ``benchmarks/gpu_check.sh`` (sets PYTHONPATH=src, a hard time limit). Needs
only torch + triton (+ numba for importing the CPU kernels; transformers optional).

    python benchmarks/gpu_check.py --dry-run          # print the plan; no GPU needed
    python benchmarks/gpu_check.py [--quick] [--sections correctness,bandwidth,kernels,e2e]

Figures: GB/s = the fused kernel's minimal DRAM bytes / time (the same byte count for the
eager time, i.e. "effective" bandwidth), set against a measured device-to-device copy;
TFLOP/s = 2MNK (GEMM) or 4·B·H·Sq·Sk·D (attention, halved when causal) / time.
Results are printed as they come and written to OUT/gpu_check.csv (OUT: --out, else $OUT,
else benchmarks/results).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass

SECTIONS = ("correctness", "bandwidth", "kernels", "e2e")
DTYPES = ("bfloat16", "float16")


# --- the plan: real shapes (BERT-base: hidden 768, 12 heads, FFN 3072; Llama-7B-like: hidden
#     4096, 32 q heads / 8 kv heads, head dim 128; tokens M = batch x sequence) ----------


@dataclass(frozen=True)
class Case:
    kernel: str
    name: str
    shape: dict


def plan(quick: bool) -> list[Case]:
    m_bert, m_llama = (2048, 2048) if quick else (8 * 512, 4 * 1024)
    cases = [
        Case("add_layernorm", "bert", dict(M=m_bert, N=768)),
        Case("add_layernorm", "llama", dict(M=m_llama, N=4096)),
        Case("layernorm_gelu", "bert", dict(M=m_bert, N=768)),
        Case("layernorm_gelu", "wide", dict(M=m_llama, N=8192)),
        Case("linear_bias_gelu", "bert-ffn1", dict(M=m_bert, K=768, N=3072)),
        Case("linear_residual", "bert-ffn2", dict(M=m_bert, K=3072, N=768)),
        Case("linear_residual", "llama-oproj", dict(M=m_llama, K=4096, N=4096)),
        Case("ffn", "bert", dict(M=m_bert, K=768, H=3072)),
        Case("attention", "bert-padmask", dict(B=8, H=12, Hkv=12, Sq=512, Sk=512, D=64, mask="bool", causal=False)),
        Case("attention", "bert-addmask", dict(B=8, H=12, Hkv=12, Sq=509, Sk=509, D=64, mask="add", causal=False)),
        Case("attention", "llama-gqa-causal", dict(B=4, H=32, Hkv=8, Sq=1024, Sk=1024, D=128, mask=None, causal=True)),
        Case("attention", "long-causal", dict(B=1, H=16, Hkv=16, Sq=4096, Sk=4096, D=128, mask=None, causal=True)),
        Case("attention", "head80", dict(B=4, H=16, Hkv=16, Sq=777, Sk=777, D=80, mask=None, causal=False)),
    ]
    return cases[:8] + cases[8:11] if quick else cases


def print_plan(args) -> None:
    print(f"gpu_check plan (sections: {', '.join(args.sections)}; dtypes {', '.join(args.dtypes)}; "
          f"budget {args.budget:.0f} s; quick={args.quick})")
    for c in plan(args.quick):
        shape = ", ".join(f"{k}={v}" for k, v in c.shape.items())
        print(f"  {c.kernel:17s} {c.name:17s} {shape}")
    if "correctness" in args.sections:
        print("  correctness: every case above and each dtype vs float64 oracle (reference.py) and torch eager;"
              " pass if err <= max(dtype tolerance, 2 x eager's err); fully masked rows vs ATen SDPA")
    if "bandwidth" in args.sections:
        print("  bandwidth: device-to-device copy of 1 GiB (clone), GB/s = 2 x bytes / time")
    if "kernels" in args.sections:
        print(f"  kernels: triton.testing.do_bench (warmup 10, rep {args.rep} ms) fused vs eager;"
              " GB/s + % of copy for norms, TFLOP/s for GEMM epilogues / attention (eager SDPA = flash/efficient)")
    if "e2e" in args.sections:
        print("  e2e: BERT-base-like layer [8x512x768] and Llama-like layer [4x1024x4096, GQA 32/8] in bf16:"
              " eager vs hand-fused torch.ops.opfuse vs opfuse.optimize (if the pipeline takes CUDA inputs);"
              " HF BertModel (2 layers, random weights) if transformers imports")
    print(f"  results -> {out_dir(args)}/gpu_check.csv")


def out_dir(args) -> str:
    return args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# --- helpers -------------------------------------------------------------------------------


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


ROWS: list[dict] = []


def record(**row) -> None:
    ROWS.append(row)


def inputs(case: Case, dtype, device="cuda", seed=0):
    """Tensors of one case: (fused args tuple for the registry launcher, eager fn, flops, bytes)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(seed)
    e = torch.finfo(dtype).bits // 8

    def r(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale + offset).to(dtype)

    s = case.shape
    k = case.kernel
    if k == "add_layernorm":
        m, n = s["M"], s["N"]
        x, res, w, b = r(m, n), r(m, n), r(n, scale=0.5, offset=1.0), r(n, scale=0.5)
        args = (x, res, w, b, 1e-5, True)

        def eager():
            h = x + res
            return F.layer_norm(h, (n,), w, b, 1e-5), h

        return args, eager, 0, e * (2 * m * n + 2 * m * n + 2 * n)
    if k == "layernorm_gelu":
        m, n = s["M"], s["N"]
        x, w, b = r(m, n, scale=2.0), r(n, scale=0.5, offset=1.0), r(n, scale=0.5)
        args = (x, w, b, 1e-5, "none")
        return args, (lambda: F.gelu(F.layer_norm(x, (n,), w, b, 1e-5))), 0, e * (2 * m * n + 2 * n)
    if k in ("linear_bias_gelu", "linear_residual"):
        m, kk, n = s["M"], s["K"], s["N"]
        x, w, b = r(m, kk), r(n, kk, scale=1 / math.sqrt(kk)), r(n, scale=0.5)
        if k == "linear_bias_gelu":
            return (x, w, b, "tanh"), (lambda: F.gelu(F.linear(x, w, b), approximate="tanh")), 2 * m * n * kk, \
                e * (m * kk + n * kk + m * n)
        res = r(m, n)
        return (x, w, b, res), (lambda: F.linear(x, w, b) + res), 2 * m * n * kk, e * (m * kk + n * kk + 2 * m * n)
    if k == "ffn":
        m, kk, h = s["M"], s["K"], s["H"]
        x = r(m, kk)
        w1, b1 = r(h, kk, scale=1 / math.sqrt(kk)), r(h, scale=0.5)
        w2, b2 = r(kk, h, scale=1 / math.sqrt(h)), r(kk, scale=0.5)
        return (x, w1, b1, w2, b2, "none", 64), (lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)), \
            4 * m * h * kk, e * (2 * m * kk + 2 * h * kk + 2 * m * h)
    if k == "attention":
        bb, hq, hkv, sq, sk, d = s["B"], s["H"], s["Hkv"], s["Sq"], s["Sk"], s["D"]
        q, kt, v = r(bb, hq, sq, d), r(bb, hkv, sk, d), r(bb, hkv, sk, d)
        mask = None
        if s["mask"] == "bool":  # padding mask: the last 10% keys of odd batches dropped
            mask = torch.ones(bb, 1, 1, sk, dtype=torch.bool, device=device)
            mask[1::2, ..., int(sk * 0.9):] = False
        elif s["mask"] == "add":  # HF-style additive mask with finfo.min
            mask = torch.zeros(bb, 1, 1, sk, dtype=dtype, device=device)
            mask[1::2, ..., int(sk * 0.9):] = torch.finfo(dtype).min
        scale = 1 / math.sqrt(d)
        causal = s["causal"]
        args = (q, kt, v, mask, scale, causal)

        def eager():
            return F.scaled_dot_product_attention(q, kt, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=hkv != hq)

        flops = 4 * bb * hq * sq * sk * d // (2 if causal else 1)
        return args, eager, flops, e * (2 * bb * hq * sq * d + 2 * bb * hkv * sk * d)
    raise KeyError(k)


def oracle(kernel: str, args):
    from opfuse.kernels import reference

    if kernel == "add_layernorm":
        return reference.add_layernorm(*args)
    if kernel == "ffn":
        return reference.ffn(*args)
    return getattr(reference, kernel)(*args)


def first(t):
    return t[0] if isinstance(t, tuple) else t


def max_err(a, ref) -> float:
    return (a.double() - ref).abs().max().item()


# --- sections ------------------------------------------------------------------------------


def check_correctness(args, budget) -> int:
    import torch
    import torch.nn.functional as F

    from opfuse.kernels.reference import TOLERANCE
    from opfuse.kernels.registry import lookup

    print("\n== correctness (max |err| vs float64 oracle; eager's err on the same inputs) ==")
    failures = 0
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        tol = TOLERANCE[dtype]
        for case in plan(args.quick):
            if budget.left() < 60:
                print("  (budget low: remaining correctness cases skipped)")
                return failures
            try:
                fargs, eager, _, _ = inputs(case, dtype)
                got = lookup(case.kernel, "cuda")(*fargs)
                ref = oracle(case.kernel, fargs)
                exp = eager()
                outs = [(first(got), first(ref), first(exp))]
                if case.kernel == "add_layernorm":
                    outs.append((got[1], ref[1], exp[1]))
                worst_ok, errs = True, []
                for g_, r_, e_ in outs:
                    err, eerr = max_err(g_, r_), max_err(e_, r_)
                    # relative scale: GEMM outputs grow with K; compare like assert_close would
                    bound = tol["atol"] + tol["rtol"] * r_.abs().max().item()
                    ok = bool(torch.isfinite(g_).all()) and (err <= bound or err <= 2 * eerr)
                    worst_ok &= ok
                    errs.append((err, eerr))
                failures += not worst_ok
                e_txt = "; ".join(f"err {a:.2e} eager {b:.2e}" for a, b in errs)
                print(f"  {'ok  ' if worst_ok else 'FAIL'} {dname:8s} {case.kernel:17s} {case.name:17s} {e_txt}")
                record(section="correctness", dtype=dname, kernel=case.kernel, case=case.name, ok=worst_ok,
                       err=errs[0][0], eager_err=errs[0][1])
            except Exception as e:
                failures += 1
                print(f"  FAIL {dname:8s} {case.kernel:17s} {case.name:17s} {type(e).__name__}: {e}")
                traceback.print_exc(limit=3)
            finally:
                torch.cuda.empty_cache()
    # fully masked rows: what ATen SDPA returns on CUDA for the same mask
    q = torch.randn(2, 4, 33, 64, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    for label, fill in (("-inf", float("-inf")), ("finfo.min", torch.finfo(torch.float16).min), ("bool", None)):
        if fill is None:
            m = torch.ones(33, 33, dtype=torch.bool, device="cuda")
            m[5] = False
        else:
            m = torch.zeros(33, 33, dtype=torch.float16, device="cuda")
            m[5] = fill
        got = lookup("attention", "cuda")(q, k, v, m, 0.125, False)
        exp = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.125)
        err = (got.float() - exp.float()).abs().nan_to_num(1e9).max().item()
        ok = err < 2e-2 and not got.isnan().any()
        failures += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} fully masked row ({label:9s}) vs SDPA: max |diff| {err:.2e};"
              f" SDPA row mean {exp[0, 0, 5].float().abs().mean().item():.3e}")
    return failures


def copy_bandwidth() -> float:
    import torch
    import triton

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=100)
    gbs = 2 * src.numel() / ms / 1e6
    print(f"\n== copy bandwidth: {gbs:,.0f} GB/s (1 GiB device-to-device) ==")
    record(section="bandwidth", kernel="copy", gbs=gbs)
    del src, dst
    torch.cuda.empty_cache()
    return gbs


def bench_kernels(args, budget, copy_gbs: float) -> None:
    import torch
    import triton

    from opfuse.kernels.registry import lookup

    dname = args.dtypes[0]
    dtype = getattr(torch, dname)
    print(f"\n== kernels ({dname}; ms, effective GB/s and % of copy, TFLOP/s; speed-up = eager / fused) ==")
    for case in plan(args.quick):
        if budget.left() < 45:
            print("  (budget low: remaining kernel timings skipped)")
            return
        try:
            fargs, eager, flops, nbytes = inputs(case, dtype)
            fn = lookup(case.kernel, "cuda")
            fn(*fargs)  # compile / autotune outside the timing
            t_f = triton.testing.do_bench(lambda: fn(*fargs), warmup=10, rep=args.rep)
            t_e = triton.testing.do_bench(eager, warmup=10, rep=args.rep)
            gb_f, gb_e = nbytes / t_f / 1e6, nbytes / t_e / 1e6
            line = (f"  {case.kernel:17s} {case.name:17s} fused {t_f:8.3f} ms  eager {t_e:8.3f} ms  x{t_e / t_f:5.2f}"
                    f"  | {gb_f:7,.0f} GB/s ({100 * gb_f / copy_gbs:3.0f}% copy) vs eager {gb_e:7,.0f}")
            if flops:
                line += f"  | {flops / t_f / 1e9:6.1f} TFLOP/s vs eager {flops / t_e / 1e9:6.1f}"
            print(line, flush=True)
            record(section="kernels", dtype=dname, kernel=case.kernel, case=case.name, fused_ms=t_f, eager_ms=t_e,
                   fused_gbs=gb_f, eager_gbs=gb_e, fused_tflops=flops / t_f / 1e9 if flops else "",
                   eager_tflops=flops / t_e / 1e9 if flops else "")
        except Exception as e:
            print(f"  FAIL {case.kernel} {case.name}: {type(e).__name__}: {e}")
        finally:
            torch.cuda.empty_cache()


def _blocks():
    """A BERT-base-like post-LN encoder layer and a Llama-like pre-norm layer (LayerNorm in
    place of RMSNorm, GELU MLP in place of SwiGLU: the kernels opfuse has), each with a
    ``fused`` switch that routes through torch.ops.opfuse."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import opfuse.kernels.ops  # noqa: F401

    ops = torch.ops.opfuse

    class BertLayer(nn.Module):
        def __init__(self, d=768, h=12, ff=3072):
            super().__init__()
            self.h = h
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
            self.f1, self.f2 = nn.Linear(d, ff), nn.Linear(ff, d)
            self.fused = False

        def forward(self, x, mask):  # x [B, S, d]; mask [B, 1, 1, S] bool (True = keep)
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            if self.fused:
                a = ops.attention(q, k, v, mask, 1 / math.sqrt(d // self.h), False)
                a = a.transpose(1, 2).reshape(b, s, d)
                h1 = ops.add_layernorm(self.o(a), x, self.ln1.weight, self.ln1.bias, self.ln1.eps)
                f = ops.linear_bias_gelu(h1, self.f1.weight, self.f1.bias, "none")
                return ops.add_layernorm(F.linear(f, self.f2.weight, self.f2.bias), h1, self.ln2.weight,
                                         self.ln2.bias, self.ln2.eps)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)
            h1 = self.ln1(self.o(a) + x)
            return self.ln2(self.f2(F.gelu(self.f1(h1))) + h1)

    class LlamaLikeLayer(nn.Module):
        def __init__(self, d=4096, h=32, hkv=8, ff=11008):
            super().__init__()
            self.h, self.hkv, self.hd = h, hkv, d // h
            self.qkv = nn.Linear(d, (h + 2 * hkv) * self.hd, bias=False)
            self.o = nn.Linear(d, d, bias=False)
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.up, self.down = nn.Linear(d, ff, bias=False), nn.Linear(ff, d, bias=False)
            self.fused = False

        def forward(self, x):
            b, s, d = x.shape
            qkv = self.qkv(self.n1(x))
            q, k, v = qkv.split([self.h * self.hd, self.hkv * self.hd, self.hkv * self.hd], dim=-1)
            q = q.view(b, s, self.h, self.hd).transpose(1, 2)
            k = k.view(b, s, self.hkv, self.hd).transpose(1, 2)
            v = v.view(b, s, self.hkv, self.hd).transpose(1, 2)
            if self.fused:
                a = ops.attention(q, k, v, None, 1 / math.sqrt(self.hd), True).transpose(1, 2).reshape(b, s, d)
                h1 = ops.linear_residual(a, self.o.weight, None, x)
                # the norm feeds a GEMM (no LN+GELU site); the up-projection has no bias (no epilogue kernel)
                g = F.gelu(F.linear(self.n2(h1), self.up.weight), approximate="tanh")
                return ops.linear_residual(g, self.down.weight, None, h1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(b, s, d)
            h1 = x + self.o(a)
            return h1 + self.down(F.gelu(self.up(self.n2(h1)), approximate="tanh"))

    return BertLayer, LlamaLikeLayer


def bench_e2e(args, budget) -> None:
    import torch
    import triton

    print("\n== end-to-end blocks (bf16, ms per forward; CUDA-graph-free) ==")
    BertLayer, LlamaLikeLayer = _blocks()
    dtype = torch.bfloat16
    setups = [("bert-base-like layer", BertLayer(), (8, 512, 768), True),
              ("llama-like layer (GQA 32/8)", LlamaLikeLayer(), (4, 1024, 4096) if not args.quick else (2, 1024, 4096),
               False)]
    for name, block, shape, has_mask in setups:
        if budget.left() < 40:
            print("  (budget low: remaining e2e blocks skipped)")
            return
        block = block.to("cuda", dtype).eval()
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        inputs_ = (x,)
        if has_mask:
            mask = torch.ones(shape[0], 1, 1, shape[1], dtype=torch.bool, device="cuda")
            mask[1::2, ..., int(shape[1] * 0.9):] = False
            inputs_ = (x, mask)
        with torch.no_grad():
            block.fused = False
            ref = block(*inputs_)
            t_e = triton.testing.do_bench(lambda: block(*inputs_), warmup=5, rep=args.rep)
            block.fused = True
            out = block(*inputs_)
            t_f = triton.testing.do_bench(lambda: block(*inputs_), warmup=5, rep=args.rep)
            block.fused = False
        err = (out.float() - ref.float()).abs().max().item()
        print(f"  {name:28s} eager {t_e:7.3f} ms  fused ops {t_f:7.3f} ms  x{t_e / t_f:4.2f}  max|diff| {err:.2e}",
              flush=True)
        record(section="e2e", case=name, eager_ms=t_e, fused_ms=t_f, err=err)
        try:
            import opfuse

            t0 = time.perf_counter()
            opt = opfuse.optimize(block, inputs_)
            t_o = triton.testing.do_bench(lambda: opt(*inputs_), warmup=5, rep=args.rep)
            print(f"  {'':28s} opfuse.optimize {t_o:7.3f} ms  x{t_e / t_o:4.2f}"
                  f"  (optimize took {time.perf_counter() - t0:.1f} s)")
            record(section="e2e", case=name + " optimize", eager_ms=t_e, fused_ms=t_o)
        except Exception as e:
            print(f"  {'':28s} opfuse.optimize failed on CUDA inputs: {type(e).__name__}: {str(e)[:200]}")
        del block
        torch.cuda.empty_cache()
    try:
        import transformers  # noqa: F401
    except Exception as e:
        print(f"  HF BertModel: skipped, transformers not importable ({type(e).__name__})")
        return
    if budget.left() < 40:
        print("  HF BertModel: skipped (budget)")
        return
    try:
        from transformers import BertConfig, BertModel

        import opfuse

        model = BertModel(BertConfig(num_hidden_layers=2, attn_implementation="sdpa")).to("cuda", dtype).eval()
        ids = torch.randint(0, 30000, (8, 512), device="cuda")
        with torch.no_grad():
            t_e = triton.testing.do_bench(lambda: model(ids), warmup=3, rep=args.rep)
            opt = opfuse.optimize(model, (ids,))
            t_o = triton.testing.do_bench(lambda: opt(ids), warmup=3, rep=args.rep)
        print(f"  HF BertModel (2 layers, [8, 512]) eager {t_e:7.3f} ms  opfuse.optimize {t_o:7.3f} ms  x{t_e / t_o:4.2f}")
        record(section="e2e", case="hf-bert-2l", eager_ms=t_e, fused_ms=t_o)
    except Exception as e:
        print(f"  HF BertModel: failed: {type(e).__name__}: {str(e)[:300]}")


# --- main ----------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="opfuse Triton kernels on a GPU: correctness, GB/s, TFLOP/s, e2e")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer cases")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="I/O dtypes (first one is timed)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--rep", type=int, default=50, help="do_bench repetition time per measurement (ms)")
    ap.add_argument("--out", default=None, help="directory for gpu_check.csv")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {SECTIONS}")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("float32", "float16", "bfloat16")]
    if bad:
        ap.error(f"unknown dtype(s) {bad}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print_plan(args)
        return 0
    budget = Budget(args.budget)
    try:
        import torch
    except ImportError as e:
        print(f"gpu_check: torch is not importable with {sys.executable} ({e}); set PYTHON=...")
        return 2

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to run (use --dry-run to see the plan)")
        return 2
    import triton

    from opfuse.kernels import ops

    print(f"gpu_check: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
          f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
    if ops.TRITON_UNAVAILABLE:
        print(f"gpu_check: Triton backend not registered: {ops.TRITON_UNAVAILABLE}")
        return 2
    print_plan(args)
    failures = 0
    try:
        if "correctness" in args.sections:
            failures += check_correctness(args, budget)
        copy_gbs = copy_bandwidth() if {"bandwidth", "kernels"} & set(args.sections) else float("nan")
        if "kernels" in args.sections:
            bench_kernels(args, budget, copy_gbs)
        if "e2e" in args.sections:
            bench_e2e(args, budget)
    except KeyboardInterrupt:
        print("\ngpu_check: interrupted by the time limit; partial results follow")
    finally:
        d = out_dir(args)
        os.makedirs(d, exist_ok=True)
        keys = sorted({k for r in ROWS for k in r})
        with open(os.path.join(d, "gpu_check.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(ROWS)
        print(f"\ngpu_check: {len(ROWS)} rows -> {os.path.join(d, 'gpu_check.csv')}; "
              f"{failures} correctness failure(s); {time.perf_counter() - budget.t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
