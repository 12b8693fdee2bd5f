"""ffn: out = gelu(x @ w1.T + b1) @ w2.T + b2, processed in row blocks.

    for each block of `block_rows` rows:
        x_blk ── GEMM1 (_gemm) ── h [block_rows, H] ── +b1, gelu (numba, in place)
                                                    └── GEMM2 + b2 (addmm / oneDNN) ──► out_blk

The [block_rows, H] intermediate lives in one reused buffer small enough for L2, so the
[M, H] hidden activation of eager never round-trips through memory. Traffic (float32):
read MK + MN' output write + weights once per block (HK + N'H, cache-resident for typical
sizes); eager additionally writes and reads [M, H] three times (addmm, gelu, addmm).
"""

from __future__ import annotations

import torch
from numba import njit, prange

from opfuse.kernels.cpu import _gemm, _math
from opfuse.kernels.checks import check_ffn
from opfuse.kernels.cpu._launch import f32, f32_vec, launch
from opfuse.kernels.registry import register

@njit(parallel=True, error_model="numpy", cache=True)
def _ffn_kernel(h, b1, use_tanh):
    # h: [rows, H] f32 block of GEMM1, overwritten by gelu(h + b1); b1: [H] f32
    for i in prange(h.shape[0]):
        _math.row_bias_gelu(h[i], b1, use_tanh)  # read H + H, write H (L2-resident)


@register("ffn", "cpu")
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
    k, hidden, n = check_ffn(x, w1, b1, w2, b2, approximate, block_rows, device_type="cpu")

    x2 = f32(x).reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    w1f = _gemm.operand(w1)  # [H, K]
    w2f = _gemm.operand(w2)  # [N, H]
    b1n = f32_vec(b1, hidden)  # [H]
    b2f = f32(b2)  # [N]
    rows = min(int(block_rows), max(m, 1))
    h_buf = torch.empty((rows, hidden), dtype=torch.float32)  # [block_rows, H], reused per block
    out = torch.empty((m, n), dtype=torch.float32)  # [M, N]
    use_tanh = approximate == "tanh"
    kernel = launch(_ffn_kernel, rows * hidden)
    for r0 in range(0, m, rows):
        r1 = min(r0 + rows, m)
        h = _gemm.linear(x2[r0:r1], w1f, out=h_buf[: r1 - r0])  # [rows, H]; read rows*K + HK, write rows*H
        kernel(h.numpy(), b1n, use_tanh)  # read rows*H, write rows*H (cache)
        _gemm.linear(h, w2f, b2f, out=out[r0:r1])  # C = b2, beta = 1: read rows*H + NH + N, write rows*N
    return out.view(*x.shape[:-1], n).to(x.dtype)
