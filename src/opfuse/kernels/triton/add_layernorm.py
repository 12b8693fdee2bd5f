"""add_layernorm (Triton): out = LayerNorm(x + residual) * weight + bias, optionally s = x + residual.

    x ─┐
       add ── s ──┬── (EMIT_SUM) ─────────────────────────────► sum
    r ─┘          └── shift ── mean/var (fp32) ── normalise ──► out

One program per row; the row (padded to BLOCK_N, masked tail) stays in registers.
Statistics are shifted: y = (x - x[0]) + (r - r[0]) in float32 (each difference exact for
rows far from zero), then two-pass mean / variance of y from registers.

Traffic per row (e = element size): read 2N·e (+2N·e weight/bias, L2-resident), write
N·e (+N·e with EMIT_SUM). Eager (add, then layer_norm): read 2N, write N, read N, write N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opfuse.kernels.checks import check_add_layernorm
from opfuse.kernels.registry import register
from opfuse.kernels.triton._common import DEVICE_TYPE, row_block, row_warps, row_stats, rstd_of


@triton.jit
def _add_layernorm_fwd_kernel(
    X,  # [M, N] rows at stride_x, unit inner stride
    R,  # [M, N] rows at stride_r
    W,  # [N]
    B,  # [N] (unused if not HAS_BIAS)
    Out,  # [M, N] contiguous
    S,  # [M, N] contiguous sum output (unused if not EMIT_SUM)
    stride_x,
    stride_r,
    N,
    eps,
    HAS_BIAS: tl.constexpr,
    EMIT_SUM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    valid = cols < N
    x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)  # read N
    r = tl.load(R + row * stride_r + cols, mask=valid, other=0.0).to(tl.float32)  # read N
    if EMIT_SUM:
        tl.store(S + row * N + cols, (x + r).to(S.dtype.element_ty), mask=valid)  # write N
    x0 = tl.load(X + row * stride_x).to(tl.float32)
    r0 = tl.load(R + row * stride_r).to(tl.float32)
    y = tl.where(valid, (x - x0) + (r - r0), 0.0)  # shifted sum, exact differences
    d, inv, var_scaled = row_stats(y, valid, N)  # overflow-safe statistics (_common.row_stats)
    rstd = rstd_of(inv, var_scaled, eps)
    w = tl.load(W + cols, mask=valid, other=0.0).to(tl.float32)  # read N (L2)
    out = d * rstd * w
    if HAS_BIAS:
        out += tl.load(B + cols, mask=valid, other=0.0).to(tl.float32)  # read N (L2)
    tl.store(Out + row * N + cols, out.to(Out.dtype.element_ty), mask=valid)  # write N


def config(n: int) -> dict:
    """Launch configuration for rows of n elements (also what aot.py compiles)."""
    block = row_block("add_layernorm", n)
    return dict(BLOCK_N=block, num_warps=row_warps(block))


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@register("add_layernorm", "cuda")
def add_layernorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    emit_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LayerNorm(x + residual) over the last dim; returns (out, x + residual or None)."""
    n = check_add_layernorm(x, residual, weight, bias, device_type=DEVICE_TYPE)

    x2, r2 = _rows(x, n), _rows(residual.expand(x.shape), n)  # [M, N] (a row-broadcast residual: one copy)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    s = torch.empty_like(out) if emit_sum else out  # [M, N]
    if m > 0:
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else w
        _add_layernorm_fwd_kernel[(m,)](
            x2, r2, w, b, out, s, x2.stride(0), r2.stride(0), n, float(eps),
            HAS_BIAS=bias is not None, EMIT_SUM=bool(emit_sum), **config(n),
        )
    return out.view(x.shape), (s.view(x.shape) if emit_sum else None)
