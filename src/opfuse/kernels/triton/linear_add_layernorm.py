"""linear_add_layernorm (Triton): out = LayerNorm(x @ weight.T + bias + residual) * ln_weight + ln_bias,
optionally also s = x @ weight.T + bias + residual. Two launches of existing kernels:

    x ── tl.dot tiles (fp32 acc) ── +bias ── +residual ──► s [M, N]     (_gemm.gemm_epilogue, as linear_residual)
    s ── shift ── mean/var (fp32) ── normalise·w+b ──────► out [M, N]   (layernorm_gelu's kernel, ACT_NONE)

s is written once in x's dtype and read once by the norm (eager: addmm writes y, add reads
y + r and writes s, layer_norm reads s). s rounds to the I/O dtype before the statistics,
as eager's add does; the CPU kernel keeps it in float32 (and shifted) instead.

Traffic: read MK + NK (+N) + MN, write MN (GEMM); read MN (+2N), write MN (norm) (x e).
With emit_sum, s is the second output (no extra pass). FLOPs: 2MNK + ~8MN.
"""

from __future__ import annotations

import torch

from opfuse.kernels.checks import check_linear_add_layernorm
from opfuse.kernels.registry import register
from opfuse.kernels.triton import layernorm_gelu as _ln
from opfuse.kernels.triton._common import ACT_NONE, DEVICE_TYPE
from opfuse.kernels.triton._gemm import gemm_epilogue


def config(n: int) -> dict:
    """Launch configuration of the norm pass for rows of n elements (aot.py compiles it)."""
    return _ln.config(n)


@register("linear_add_layernorm", "cuda")
def linear_add_layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor | None,
    eps: float,
    emit_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LayerNorm(x @ weight.T + bias + residual) over N; returns (out, the sum or None)."""
    k, n = check_linear_add_layernorm(x, weight, bias, residual, ln_weight, ln_bias, device_type=DEVICE_TYPE)

    x2 = x.reshape(-1, k)  # [M, K]
    r2 = residual.reshape(-1, n)  # [M, N], any strides
    m = x2.shape[0]
    s = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N] residual sum
    gemm_epilogue(x2, weight, bias, r2, ACT_NONE, s)  # read MK + NK + MN, write MN
    out = torch.empty_like(s)  # [M, N]
    if m > 0:
        w = ln_weight.contiguous()
        b = ln_bias.contiguous() if ln_bias is not None else w
        _ln._layernorm_gelu_fwd_kernel[(m,)](  # read MN, write MN
            s, w, b, out, s.stride(0), n, float(eps), HAS_BIAS=ln_bias is not None, ACT=ACT_NONE, **config(n)
        )
    shape = (*x.shape[:-1], n)
    return out.view(shape), (s.view(shape) if emit_sum else None)
