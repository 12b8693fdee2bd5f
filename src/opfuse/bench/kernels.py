"""Each CPU fused kernel (``torch.ops.opfuse.*``) vs its unfused eager ATen ops, on sizes
in cache and out of cache, one thread.

Figures per case: median time of each side (interleaved), speed-up, effective GB/s
(the kernel's inputs read once + outputs written once, divided by time — the traffic of a
perfectly fused kernel, so both sides are measured against the same bytes), the fraction
of the machine's copy bandwidth (a large ``Tensor.copy_``, read + write), and GFLOP/s for
the cases with a GEMM. Eager uses ``out=`` buffers where ATen has them (add, addmm, mm,
mul); the fused ops allocate their output (their schema has no ``out=``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .timing import interleaved


@dataclass
class Case:
    kernel: str
    shape: str
    fused: Callable[[], object]
    eager: Callable[[], object]
    nbytes: int        # inputs read once + outputs written once
    flops: int = 0


def _b(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def copy_bandwidth(mib: int = 64) -> float:
    """Bytes/s of a large ``copy_`` (read + write), best of 5 after a warm call."""
    from .timing import median_s
    src = torch.ones(mib * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / median_s(lambda: dst.copy_(src), repeat=7, warmup=2)


def _rows(sizes: str) -> list[tuple[int, int]]:
    # (rows, hidden): [128,384] ≈ 0.2 MB (L2), [2048,768] ≈ 6 MB (L3), [8192,1024] = 32 MB (DRAM)
    return {"tiny": [(16, 64), (8, 32)], "quick": [(128, 384), (2048, 768)],
            "full": [(128, 384), (2048, 768), (8192, 1024)]}[sizes]


def cases(sizes: str = "full") -> list[Case]:
    ops = torch.ops.opfuse
    r = torch.randn
    out: list[Case] = []
    for m, n in _rows(sizes):
        shape = f"[{m},{n}]"
        x, res, w, b = r(m, n), r(m, n), r(n), r(n)
        s_buf, y_buf = torch.empty(m, n), torch.empty(m, n)
        eps = 1e-12
        out.append(Case(
            "add_layernorm", shape, lambda x=x, res=res, w=w, b=b: ops.add_layernorm(x, res, w, b, eps),
            lambda x=x, res=res, w=w, b=b, s=s_buf: F.layer_norm(torch.add(x, res, out=s), (x.shape[-1],), w, b, eps),
            _b(x, res, w, b, x)))
        out.append(Case(
            "layernorm_gelu", shape, lambda x=x, w=w, b=b: ops.layernorm_gelu(x, w, b, eps, "none"),
            lambda x=x, w=w, b=b: F.gelu(F.layer_norm(x, (x.shape[-1],), w, b, eps)), _b(x, w, b, x)))
        out.append(Case(
            "rmsnorm", shape, lambda x=x, w=w: ops.rmsnorm(x, w, 1e-6),
            lambda x=x, w=w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), _b(x, w, x)))
        out.append(Case(
            "add_rmsnorm", shape, lambda x=x, res=res, w=w: ops.add_rmsnorm(x, res, w, 1e-6),
            lambda x=x, res=res, w=w, s=s_buf: w * (torch.add(x, res, out=s) *
                                                   torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)),
            _b(x, res, w, x, x)))
        if m > 2048:  # GEMM cases: compute-bound already at 2048 rows; 8192 rows take ~10 s a call here
            continue
        # GEMM epilogues: hidden n -> 4n (BERT's FFN up-projection) and n -> n
        k4 = 4 * n
        w1, b1 = r(k4, n) / math.sqrt(n), r(k4)
        h_buf = torch.empty(m, k4)
        out.append(Case(
            "linear_bias_gelu", f"[{m},{n}]x[{n},{k4}]", lambda x=x, w1=w1, b1=b1: ops.linear_bias_gelu(x, w1, b1, "none"),
            lambda x=x, w1=w1, b1=b1, h=h_buf: F.gelu(torch.addmm(b1, x, w1.t(), out=h)),
            _b(x, w1, b1, h_buf), 2 * m * n * k4))
        wo, bo = r(n, n) / math.sqrt(n), r(n)
        out.append(Case(
            "linear_residual", f"[{m},{n}]x[{n},{n}]", lambda x=x, wo=wo, bo=bo, res=res: ops.linear_residual(x, wo, bo, res),
            lambda x=x, wo=wo, bo=bo, res=res, y=y_buf: torch.add(torch.addmm(bo, x, wo.t(), out=y), res, out=y),
            _b(x, wo, bo, res, x), 2 * m * n * n))
        lw, lb = r(n), r(n)
        out.append(Case(
            "linear_add_layernorm", f"[{m},{n}]x[{n},{n}]",
            lambda x=x, wo=wo, bo=bo, res=res, lw=lw, lb=lb: ops.linear_add_layernorm(x, wo, bo, res, lw, lb, eps),
            lambda x=x, wo=wo, bo=bo, res=res, lw=lw, lb=lb, y=y_buf:
                F.layer_norm(torch.add(torch.addmm(bo, x, wo.t(), out=y), res, out=y), lw.shape, lw, lb, eps),
            _b(x, wo, bo, res, lw, lb, x), 2 * m * n * n))
        w2, b2 = r(n, k4) / math.sqrt(k4), r(n)
        block = max(1, min(m, (256 * 1024) // (4 * k4)))
        out.append(Case(
            "ffn", f"[{m},{n}]→{k4}→{n}",
            lambda x=x, w1=w1, b1=b1, w2=w2, b2=b2: ops.ffn(x, w1, b1, w2, b2, "none", block),
            lambda x=x, w1=w1, b1=b1, w2=w2, b2=b2, h=h_buf, y=y_buf:
                torch.addmm(b2, F.gelu(torch.addmm(b1, x, w1.t(), out=h)), w2.t(), out=y),
            _b(x, w1, b1, w2, b2, x), 4 * m * n * k4))
        wgu = r(2 * k4 // 2, n) / math.sqrt(n)   # [2H, K], H = 2n (Llama-like 8/3·n rounded)
        hid = wgu.shape[0] // 2
        g_buf, u_buf = torch.empty(m, hid), torch.empty(m, hid)
        out.append(Case(
            "swiglu", f"[{m},{n}]→2x{hid}", lambda x=x, wgu=wgu, hid=hid: ops.swiglu(x, wgu, hid),
            lambda x=x, wgu=wgu, hid=hid, g=g_buf, u=u_buf:
                F.silu(torch.mm(x, wgu[:hid].t(), out=g)) * torch.mm(x, wgu[hid:].t(), out=u),
            _b(x, wgu, g_buf), 4 * m * n * hid))
        out.append(Case(
            "geglu", f"[{m},{n}]→2x{hid}", lambda x=x, wgu=wgu, hid=hid: ops.geglu(x, wgu, hid, "tanh"),
            lambda x=x, wgu=wgu, hid=hid, g=g_buf, u=u_buf:
                F.gelu(torch.mm(x, wgu[:hid].t(), out=g), approximate="tanh") * torch.mm(x, wgu[hid:].t(), out=u),
            _b(x, wgu, g_buf), 4 * m * n * hid))
    # attention: [B, H, S, D] with an additive padding mask [B, 1, 1, S] (BERT's spelling)
    att_shapes = {"tiny": [(1, 2, 16, 8)], "quick": [(1, 12, 128, 64), (8, 12, 128, 32)],
                  "full": [(1, 12, 128, 64), (8, 12, 128, 32), (1, 12, 512, 64)]}[sizes]
    for bsz, h, s, d in att_shapes:
        q, k, v = r(bsz, h, s, d), r(bsz, h, s, d), r(bsz, h, s, d)
        mask = torch.zeros(bsz, 1, 1, s)
        mask[-1, ..., s * 3 // 4:] = torch.finfo(torch.float32).min
        scale = 1 / math.sqrt(d)
        out.append(Case(
            "attention", f"[{bsz},{h},{s},{d}]", lambda q=q, k=k, v=v, mask=mask, scale=scale:
                ops.attention(q, k, v, mask, scale, False),
            lambda q=q, k=k, v=v, mask=mask, scale=scale:
                torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale + mask, dim=-1) @ v,
            _b(q, k, v, mask, q), 4 * bsz * h * s * s * d))
        # rope on the same q ([B, H, S, D], rotate_half)
        cos, sin = r(1, 1, s, d), r(1, 1, s, d)
        half = d // 2
        out.append(Case(
            "rope", f"[{bsz},{h},{s},{d}]", lambda q=q, cos=cos, sin=sin: ops.rope(q, cos, sin, "rotate_half"),
            lambda q=q, cos=cos, sin=sin, half=half: q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin,
            _b(q, cos, sin, q)))
    return out


def run(sizes: str = "full", repeat: int = 15, log=lambda s: None) -> dict:
    """Measure every case; returns ``{"copy_gbs", "rows": [...]}``."""
    from opfuse.kernels import ops as kops
    kops.warm_up()
    copy = copy_bandwidth()
    rows = []
    with torch.inference_mode():
        for c in cases(sizes):
            log(f"{c.kernel} {c.shape}")
            t = interleaved({"fused": c.fused, "eager": c.eager}, repeat=repeat, warmup=1, budget_s=5.0)
            tf, te = t["fused"]["median_s"], t["eager"]["median_s"]
            rows.append({
                "kernel": c.kernel, "shape": c.shape, "mb": c.nbytes / 1e6,
                "fused_ms": 1e3 * tf, "eager_ms": 1e3 * te, "speedup": te / tf,
                "fused_gbs": c.nbytes / tf / 1e9, "eager_gbs": c.nbytes / te / 1e9,
                "fused_frac_copy": c.nbytes / tf / copy, "eager_frac_copy": c.nbytes / te / copy,
                "fused_gflops": c.flops / tf / 1e9 if c.flops else None,
                "eager_gflops": c.flops / te / 1e9 if c.flops else None, "n": t["fused"]["n"],
            })
    return {"copy_gbs": copy / 1e9, "rows": rows}


def kernels_table(result: dict):
    from rich.table import Table
    table = Table(title=(f"CPU fused kernels vs unfused eager ops, {torch.get_num_threads()} thread(s); "
                         f"copy bandwidth {result['copy_gbs']:.1f} GB/s (read+write); GB/s = bytes of one fused pass / time"))
    for col in ("kernel", "shape", "MB", "fused ms", "eager ms", "speed-up", "fused GB/s", "eager GB/s",
                "fused % copy", "fused GFLOP/s", "eager GFLOP/s"):
        table.add_column(col, justify="left" if col in ("kernel", "shape") else "right",
                         no_wrap=col in ("kernel", "shape"))
    for r in result["rows"]:
        colour = "green" if r["speedup"] >= 1.05 else "red" if r["speedup"] < 0.95 else ""
        table.add_row(r["kernel"], r["shape"], f"{r['mb']:.2f}", f"{r['fused_ms']:.3f}", f"{r['eager_ms']:.3f}",
                      f"[{colour}]{r['speedup']:.2f}x[/]" if colour else f"{r['speedup']:.2f}x",
                      f"{r['fused_gbs']:.1f}", f"{r['eager_gbs']:.1f}", f"{100 * r['fused_frac_copy']:.0f}%",
                      f"{r['fused_gflops']:.1f}" if r["fused_gflops"] else "",
                      f"{r['eager_gflops']:.1f}" if r["eager_gflops"] else "")
    return table
