"""ffn (Triton): out = gelu(x @ w1.T + b1) @ w2.T + b2 as two GEMM-epilogue launches.

    x ── GEMM1 + b1 + gelu (epilogue) ── h [M, H] (x's dtype) ── GEMM2 + b2 (epilogue) ──► out

The hidden activation is written once and read once (eager writes it after addmm, reads
and writes it in gelu, then reads it again). ``block_rows`` is the CPU kernel's schedule
knob; on the GPU the tiles already bound the working set, so it is accepted and ignored.
Traffic: read MK + HK + NH (+H + N), write MH + MN, read MH (x e). FLOPs: 2MHK + 2MNH.
"""

from __future__ import annotations

import torch

from opfuse.kernels.checks import check_ffn
from opfuse.kernels.registry import register
from opfuse.kernels.triton._common import ACT_NONE, DEVICE_TYPE, act_of
from opfuse.kernels.triton._gemm import gemm_epilogue


@register("ffn", "cuda")
def ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    approximate: str,
    block_rows: int,
) -> torch.Tensor:
    """Linear(K->H) -> GELU -> Linear(H->N); x [..., K], w1 [H, K], b1 [H], w2 [N, H], b2 [N]."""
    k, hidden, n = check_ffn(x, w1, b1, w2, b2, approximate, block_rows, device_type=DEVICE_TYPE)
    act = act_of(approximate)

    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    h = torch.empty((m, hidden), dtype=x.dtype, device=x.device)  # [M, H]
    gemm_epilogue(x2, w1, b1, None, act, h)  # read MK + HK, write MH
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    gemm_epilogue(h, w2, b2, None, ACT_NONE, out)  # read MH + NH, write MN
    return out.view(*x.shape[:-1], n)
