"""attention (Triton): flash-style forward, softmax(q @ k.T * scale + mask) @ v, never S x S.

    q tile [BM, D] ── for each KV block [BN]:  s = q k^T · scale (+ mask | causal | tails)
                                               m' = max(m, rowmax s);  p = exp(s - m')
                                               l = l·e^(m-m') + Σp;  acc = acc·e^(m-m') + p v
                   ── out = acc / l ──► [BM, Dv]

Online softmax in float32 whatever the I/O dtype; natural ``exp`` (not exp2) so that an
additive mask of finfo.min is never multiplied by log2(e) into -inf. Masks: additive
float or bool (True = keep), broadcast to [B, H, Sq, Sk] through zero strides (no copy);
causal keeps key j <= query i (top-left, as SDPA). GQA: query head h reads kv head
h // (H / Hkv), no repeat. Head dims are padded to a power of 2 >= 16 with masked loads;
any sequence length (masked tails).

Fully masked rows (every key -inf or False): the running max stays -inf, it is replaced by
0 before exponentiating so p = 0 (no NaN), l = 0, and the row is written as 0, which is
what ATen SDPA returns for -inf / bool masks. A finfo.min additive mask is finite: the row
is the uniform average of v, again as SDPA (see tests).

Traffic per (b, h): read Sq·D + (Sk·D + Sk·Dv)·ceil(Sq/BM) (L2 serves most re-reads)
(+ Sq·Sk mask), write Sq·Dv. FLOPs: 4·B·H·Sq·Sk·D (halved with causal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opfuse.kernels.checks import check_attention, check_attention_mask
from opfuse.kernels.registry import register
from opfuse.kernels.triton._common import DEVICE_TYPE, INTERPRET, dot_f32, ieee_fp32

MASK_NONE, MASK_ADD, MASK_KEEP = 0, 1, 2


@triton.jit
def _attention_fwd_kernel(
    Q,  # [B, H, Sq, D] at (sqb, sqh, sqm, sqd)
    K,  # [B, Hkv, Sk, D] at (skb, skh, skn, skd)
    V,  # [B, Hkv, Sk, Dv] at (svb, svh, svn, svd)
    Mask,  # [B, H, Sq, Sk] view (0 strides where broadcast): float additive or uint8 keep
    Out,  # [B, H, Sq, Dv] contiguous
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smm, smn,
    H,
    GROUP,  # H // Hkv
    Sq,
    Sk,
    D,
    Dv,
    scale,
    MASK_KIND: tl.constexpr,  # 0 none, 1 additive float, 2 bool keep
    IS_CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_F32: tl.constexpr,  # interpreter + bf16 only (see _common.dot_f32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP  # GQA: kv head of this query head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = tl.arange(0, BLOCK_N)  # [BN]
    offs_d = tl.arange(0, BLOCK_D)  # [BD]
    offs_dv = tl.arange(0, BLOCK_DV)  # [BDV]
    m_ok = offs_m < Sq
    d_ok = offs_d < D
    dv_ok = offs_dv < Dv

    q_ptrs = Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # read BM·D
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    mask_base = Mask + b * smb + h * smh

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)

    hi = Sk
    if IS_CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BLOCK_M)  # blocks right of the diagonal are all masked
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n  # [BN]
        n_ok = cols < Sk
        k = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd,
                    mask=d_ok[:, None] & n_ok[None, :], other=0.0)  # [BD, BN]; read BN·D
        if DOT_F32:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale  # [BM, BN] fp32
        keep = m_ok[:, None] & n_ok[None, :]
        if IS_CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        if MASK_KIND == 1:
            s += tl.load(mask_base + offs_m[:, None] * smm + cols[None, :] * smn,
                         mask=keep, other=0.0).to(tl.float32)  # read BM·BN
        if MASK_KIND == 2:
            keep = keep & (tl.load(mask_base + offs_m[:, None] * smm + cols[None, :] * smn,
                                   mask=keep, other=0) != 0)  # read BM·BN bytes
        s = tl.where(keep, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BM]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: no NaN
        p = tl.exp(s - m_safe[:, None])  # [BM, BN], 0 where masked
        alpha = tl.exp(m_i - m_safe)  # [BM]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * svn + offs_dv[None, :] * svd,
                    mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # [BN, BDV]; read BN·Dv
        p_in = p.to(V.dtype.element_ty)  # the P·V dot runs in the I/O dtype, as flash kernels do
        if DOT_F32:
            p_in = p_in.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p_in, v)
        m_i = m_new

    out = tl.where(l_i[:, None] > 0.0, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], 0.0)  # dead rows: 0
    o_ptrs = Out + bh.to(tl.int64) * Sq * Dv + offs_m[:, None] * Dv + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])  # write BM·Dv


def head_block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot needs >= 16


def config(dtype: torch.dtype, d: int, dv: int, masked: bool = False) -> dict:
    """Launch configuration (also what aot.py compiles). A mask tile [BM, BN] costs as many
    registers as the score tile, so masked launches use 8 warps / narrower KV blocks
    (4 warps x 64-wide blocks spilled 1.4 KiB per thread at D=32 in the sm_90 AOT report)."""
    bd, bdv = head_block(d), head_block(dv)
    if INTERPRET:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_D=bd, BLOCK_DV=bdv, num_warps=4, num_stages=1)
    wide = max(bd, bdv)
    if dtype == torch.float32:
        # fp32 q/k/v tiles are twice as wide in registers: 4 warps spilled 64-80 B at D=64
        return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=bd, BLOCK_DV=bdv, num_warps=8, num_stages=2)
    if wide <= 64:
        return dict(BLOCK_M=128, BLOCK_N=32 if masked else 64, BLOCK_D=bd, BLOCK_DV=bdv,
                    num_warps=8 if masked else 4, num_stages=3)
    if wide <= 128:
        return dict(BLOCK_M=128, BLOCK_N=32 if masked else 64, BLOCK_D=bd, BLOCK_DV=bdv, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=bd, BLOCK_DV=bdv, num_warps=8, num_stages=2)


MAX_HEAD_DIM = 256


@register("attention", "cuda")
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
) -> torch.Tensor:
    """Scaled dot-product attention; q [B,H,Sq,D], k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv] -> [B,H,Sq,Dv]."""
    op = "attention"
    b, h, hkv, sq, sk, d, dv = check_attention(q, k, v, device_type=DEVICE_TYPE)
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"opfuse.{op}: head dim {max(d, dv)} > {MAX_HEAD_DIM} not supported")
    if b * h > 65535:
        raise ValueError(f"opfuse.{op}: batch x heads {b * h} exceeds the grid limit 65535")
    mask_kind = MASK_NONE
    mask4 = q  # placeholder pointer when there is no mask
    if mask is not None:
        check_attention_mask(mask, q, (b, h, sq, sk), is_causal, device_type=DEVICE_TYPE)
        if mask.dtype == torch.bool:
            mask_kind, mask4 = MASK_KEEP, mask.view(torch.uint8).expand(b, h, sq, sk)
        else:
            mask_kind, mask4 = MASK_ADD, mask.expand(b, h, sq, sk)

    out = torch.empty((b, h, sq, dv), dtype=q.dtype, device=q.device)  # [B, H, Sq, Dv]
    if out.numel() == 0:
        return out
    cfg = config(q.dtype, d, dv, masked=mask is not None)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]), b * h)
    sm = mask4.stride() if mask is not None else (0, 0, 0, 0)
    _attention_fwd_kernel[grid](
        q, k, v, mask4, out,
        *q.stride(), *k.stride(), *v.stride(), *sm,
        h, h // hkv, sq, sk, d, dv, float(scale),
        MASK_KIND=mask_kind, IS_CAUSAL=bool(is_causal), IEEE=ieee_fp32(q.dtype), DOT_F32=dot_f32(q.dtype), **cfg,
    )
    return out
