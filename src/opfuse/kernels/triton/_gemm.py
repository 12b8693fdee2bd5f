"""GEMM with a fused epilogue (Triton), shared by linear_bias_gelu, linear_residual and ffn.

    out[M, N] = act(x[M, K] @ w[N, K]^T + bias[N]) + residual[M, N]
                      └── fp32 accumulator tile in registers ──┘ (no extra pass over out)

Each program owns a BLOCK_M x BLOCK_N tile (grouped launch order: GROUP_M row-tiles share
weight tiles in L2), loops over K in BLOCK_K steps with ``tl.dot`` (fp32 accumulate), then
applies bias, activation and residual to the accumulator before one store.

Traffic: read MK·e·ceil(N/BN) + NK·e·ceil(M/BM) (mostly L2 hits), read N·e bias, MN·e
residual, write MN·e. Eager: addmm writes MN, then gelu/add reads MN (+MN residual) and
writes MN again: the epilogue saves 2MN·e (+MN·e) of DRAM traffic per GEMM.
FLOPs: 2MNK.

Configs: a small list autotuned on the GPU (keyed on N, K and M rounded to a power of 2),
one fixed config under the interpreter. float32 dots are full precision ("ieee") unless
``torch.backends.cuda.matmul.allow_tf32`` is set, as eager's cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opfuse.kernels.triton._common import INTERPRET, dot_f32, gelu, ieee_fp32


@triton.jit
def _gemm_epilogue_fwd_kernel(
    X,  # [M, K] at (stride_xm, stride_xk)
    W,  # [N, K] at (stride_wn, stride_wk): a Linear's weight, read transposed
    Bias,  # [N] (unused if not HAS_BIAS)
    Res,  # [M, N] at (stride_rm, stride_rn) (unused if not HAS_RESIDUAL)
    Out,  # [M, N] contiguous
    M,
    N,
    K,
    M_BUCKET,  # next_power_of_2(M): autotune key only
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_rm,
    stride_rn,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # 0 none, 1 erf-GELU, 2 tanh-GELU
    HAS_RESIDUAL: tl.constexpr,
    IEEE: tl.constexpr,  # full-precision fp32 dot
    DOT_F32: tl.constexpr,  # interpreter + bf16 only (see _common.dot_f32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :] * stride_xk  # [BM, BK]
    w_ptrs = W + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk  # [BK, BN] = w^T tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (rk + k0) < K
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # read BM·BK
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # read BK·BN
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # epilogue on the fp32 accumulator: + bias, activation, + residual, one store
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]  # read BN
    acc = gelu(acc, ACT)
    tile_ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RESIDUAL:
        r_ptrs = Res + rm.to(tl.int64)[:, None] * stride_rm + rn[None, :] * stride_rn
        acc += tl.load(r_ptrs, mask=tile_ok, other=0.0).to(tl.float32)  # read BM·BN
    o_ptrs = Out + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=tile_ok)  # write BM·BN


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


# Shared memory per config = stages * (BM + BN) * BK * e: all fit sm_80's 164 KiB.
CONFIGS_16BIT = [
    _cfg(128, 128, 64, 8, 3),  # 96 KiB
    _cfg(128, 64, 64, 4, 4),  # 96 KiB
    _cfg(64, 128, 64, 4, 4),  # 96 KiB
    _cfg(64, 64, 64, 4, 4),  # 64 KiB, small M (decode, short sequences)
]
CONFIGS_FP32 = [
    _cfg(128, 128, 32, 8, 3),  # 96 KiB
    _cfg(128, 64, 32, 4, 4),  # 96 KiB
    _cfg(64, 64, 32, 4, 4),  # 64 KiB
]
INTERPRET_CONFIG = _cfg(32, 32, 32, 4, 1)  # interpreter: few programs, K >= 16 for tl.dot


def configs(dtype: torch.dtype) -> list[dict]:
    """The configs the GPU launcher autotunes over for this I/O dtype (aot.py compiles each)."""
    return CONFIGS_FP32 if dtype == torch.float32 else CONFIGS_16BIT


def _triton_configs(cfgs: list[dict]) -> list[triton.Config]:
    out = []
    for c in cfgs:
        meta = {k: v for k, v in c.items() if k not in ("num_warps", "num_stages")}
        out.append(triton.Config(meta, num_warps=c["num_warps"], num_stages=c["num_stages"]))
    return out


_TUNED = {
    name: triton.autotune(configs=_triton_configs(cfgs), key=["M_BUCKET", "N", "K"])(_gemm_epilogue_fwd_kernel)
    for name, cfgs in (("16bit", CONFIGS_16BIT), ("fp32", CONFIGS_FP32))
}


def gemm_epilogue(
    x2: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    residual2: torch.Tensor | None,  # [M, N]
    act: int,
    out: torch.Tensor,  # [M, N] contiguous, x's dtype
) -> torch.Tensor:
    """out = act(x2 @ weight.T + bias) + residual2 (arguments already validated)."""
    m, k = x2.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:  # empty reduction: run one zero step so the epilogue still applies
        x2 = torch.zeros((m, 1), dtype=x2.dtype, device=x2.device)
        weight = torch.zeros((n, 1), dtype=weight.dtype, device=weight.device)
        k = 1
    b = bias if bias is not None else out
    r = residual2 if residual2 is not None else out
    args = (
        x2, weight, b, r, out, m, n, k, triton.next_power_of_2(m),
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), r.stride(0), r.stride(1),
    )
    flags = dict(HAS_BIAS=bias is not None, ACT=act, HAS_RESIDUAL=residual2 is not None, IEEE=ieee_fp32(x2.dtype),
                 DOT_F32=dot_f32(x2.dtype))
    if INTERPRET:
        c = INTERPRET_CONFIG
        grid = (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)
        _gemm_epilogue_fwd_kernel[grid](*args, **flags, **c)
    else:
        kernel = _TUNED["fp32" if x2.dtype == torch.float32 else "16bit"]

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        kernel[grid](*args, **flags)
    return out
