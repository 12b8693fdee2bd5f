"""geglu: out = gelu(x @ W_gate.T) * (x @ W_up.T), w_gate_up = [W_gate; W_up] of shape [2H, K].

    x ── one GEMM (BLAS) ── h [M, 2H] = [g | u] ── gelu(g) * u (numba, one pass) ──► out [M, H]

The gated-GELU MLP (Shazeer 2020, "GLU Variants Improve Transformer": GEGLU) of T5 v1.1
(``gated-gelu``, tanh GELU), Gemma (``gelu_pytorch_tanh``) and ModernBERT (packed ``Wi`` +
``chunk(2, -1)``, erf GELU): the gate and up projections merged into one GEMM so x is read
once. ``approximate`` is the GELU form ("none": erf, "tanh"): two different functions, never
interchanged. Computed in float32, rounded once to x's dtype (eager rounds gate, up, gelu
and the product separately in float16/bfloat16).

FLOPs: 4MKH (GEMM). Traffic of the epilogue (float32): read 2MH, write MH. Eager: two GEMMs
(x read twice), then gelu (read MH, write MH) and mul (read 2MH, write MH) on fresh tensors.
"""

from __future__ import annotations

import torch
from numba import njit, prange

from opfuse.kernels.checks import check_geglu
from opfuse.kernels.cpu import _gemm, _math
from opfuse.kernels.cpu._launch import f32, launch
from opfuse.kernels.registry import register


@njit(parallel=True, error_model="numpy", cache=True)
def _geglu_kernel(h, out, use_tanh):
    # h: [M, 2H] f32 GEMM result, gate in [:, :H], up in [:, H:]; out: [M, H] f32
    hidden = out.shape[1]
    for i in prange(h.shape[0]):
        if use_tanh:  # the form is chosen per row, outside the inner loop
            for j in range(hidden):  # read 2H, write H
                out[i, j] = _math.gelu_tanh_f32(h[i, j]) * h[i, hidden + j]
        else:
            for j in range(hidden):
                out[i, j] = _math.gelu_erf_f32(h[i, j]) * h[i, hidden + j]


@register("geglu", "cpu")
def geglu(x: torch.Tensor, w_gate_up: torch.Tensor, hidden: int, approximate: str) -> torch.Tensor:
    """gelu(x @ W_gate.T, approximate) * (x @ W_up.T); x [..., K], w_gate_up [2*hidden, K]
    -> [..., hidden] in x's dtype. Raises ValueError (opfuse.kernels.checks) on bad input."""
    k, hidden = check_geglu(x, w_gate_up, hidden, approximate, device_type="cpu")

    x2 = f32(x).reshape(-1, k)  # [M, K]
    h = _gemm.few_rows(x2, w_gate_up)  # one to FEW_ROWS rows: opfuse's weight-stream GEMV, or None
    if h is None:
        h = _gemm.linear(x2, _gemm.operand(w_gate_up))  # [M, 2H] = [g | u]; read MK + 2HK, write 2MH
    out = torch.empty((x2.shape[0], hidden), dtype=torch.float32)  # [M, H]
    launch(_geglu_kernel, out.numel())(h.numpy(), out.numpy(), approximate == "tanh")
    return out.view(*x.shape[:-1], hidden).to(x.dtype)
