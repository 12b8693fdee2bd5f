"""layernorm_gelu (Triton): out = gelu(LayerNorm(x) * weight + bias), one pass over x.

    x ── shift ── mean/var (fp32) ── normalise·w+b ── gelu ──► out
                                    (erf form for "none", tanh form for "tanh")

One program per row, the row (padded to BLOCK_N, masked tail) in registers. Shifted
statistics: y = x - x[0] (exact) before the two-pass mean / variance, in float32.

Traffic per row: read N·e (+2N·e weight/bias, L2-resident), write N·e. Eager: layer_norm
reads N, writes N, then gelu reads N, writes N: fusion halves the DRAM traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opfuse.kernels.checks import check_layernorm_gelu
from opfuse.kernels.registry import register
from opfuse.kernels.triton._common import DEVICE_TYPE, act_of, gelu, row_block, row_warps, row_stats, rstd_of


@triton.jit
def _layernorm_gelu_fwd_kernel(
    X,  # [M, N] rows at stride_x, unit inner stride
    W,  # [N]
    B,  # [N] (unused if not HAS_BIAS)
    Out,  # [M, N] contiguous
    stride_x,
    N,
    eps,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # 1 erf-GELU, 2 tanh-GELU; 0 none (plain LayerNorm: linear_add_layernorm)
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    valid = cols < N
    x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)  # read N
    x0 = tl.load(X + row * stride_x).to(tl.float32)
    y = tl.where(valid, x - x0, 0.0)  # shifted row, exact
    d, inv, var_scaled = row_stats(y, valid, N)  # overflow-safe statistics (_common.row_stats)
    rstd = rstd_of(inv, var_scaled, eps)
    z = d * rstd * tl.load(W + cols, mask=valid, other=0.0).to(tl.float32)  # read N (L2)
    if HAS_BIAS:
        z += tl.load(B + cols, mask=valid, other=0.0).to(tl.float32)  # read N (L2)
    tl.store(Out + row * N + cols, gelu(z, ACT).to(Out.dtype.element_ty), mask=valid)  # write N


def config(n: int) -> dict:
    """Launch configuration for rows of n elements (also what aot.py compiles)."""
    block = row_block("layernorm_gelu", n)
    return dict(BLOCK_N=block, num_warps=row_warps(block))


@register("layernorm_gelu", "cuda")
def layernorm_gelu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    approximate: str,
) -> torch.Tensor:
    """gelu(LayerNorm(x)) over the last dim; approximate in {"none", "tanh"}."""
    n = check_layernorm_gelu(x, weight, bias, approximate, device_type=DEVICE_TYPE)
    act = act_of(approximate)

    x2 = x.reshape(-1, n)  # [M, N]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m > 0:
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else w
        _layernorm_gelu_fwd_kernel[(m,)](
            x2, w, b, out, x2.stride(0), n, float(eps), HAS_BIAS=bias is not None, ACT=act, **config(n)
        )
    return out.view(x.shape)
