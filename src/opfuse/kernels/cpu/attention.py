"""attention: softmax(q @ k.T * scale + mask) @ v via ATen scaled_dot_product_attention.

    q [B, H, Sq, D] ──┐
    k [B, Hkv, Sk, D] ├── ATen SDPA (flash / math kernel; never an S x S tensor here) ──► [B, H, Sq, Dv]
    v [B, Hkv, Sk, Dv]┘   mask: None | broadcastable to [B, H, Sq, Sk], additive float or bool (True = keep)

Grouped-query attention (Hkv divides H) goes through `enable_gqa=True`. Compute is float32
(inputs up-cast once), the result is cast back to q's dtype. Fully masked rows give what
ATen SDPA gives on the same inputs (the eager model's result).
FLOPs: 4 * B * H * Sq * Sk * D (two GEMMs), traffic: read q, k, v (+mask), write out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opfuse.kernels.cpu._launch import check_tensor, f32
from opfuse.kernels.registry import register


def _attention_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, is_causal: bool
) -> torch.Tensor:
    # q: [B, H, Sq, D] f32; k: [B, Hkv, Sk, D] f32; v: [B, Hkv, Sk, Dv] f32; mask: [.., Sq, Sk] f32/bool
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


@register("attention", "cpu")
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
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t)
        if t.dim() != 4:
            raise ValueError(f"opfuse.{op}: {name} must be 4-D [B, H, S, D], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"opfuse.{op}: dtype mismatch q={q.dtype} k={k.dtype} v={v.dtype}")
    b, h, sq, d = q.shape
    _, hkv, sk, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"opfuse.{op}: k shape {tuple(k.shape)} incompatible with q shape {tuple(q.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"opfuse.{op}: v shape {tuple(v.shape)} incompatible with k shape {tuple(k.shape)}")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"opfuse.{op}: kv heads {hkv} must divide query heads {h}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.device.type != "cpu":
            raise ValueError(f"opfuse.{op}: mask must be a CPU tensor")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise ValueError(f"opfuse.{op}: mask dtype {mask.dtype} must be bool or floating point")
        try:
            ok = mask.dim() <= 4 and torch.broadcast_shapes(tuple(mask.shape), (b, h, sq, sk)) == (b, h, sq, sk)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"opfuse.{op}: mask shape {tuple(mask.shape)} not broadcastable to {(b, h, sq, sk)}")
        if is_causal:
            raise ValueError(f"opfuse.{op}: mask and is_causal=True are mutually exclusive (as in SDPA)")

    maskf = None if mask is None else (mask.detach() if mask.dtype == torch.bool else f32(mask))
    out = _attention_kernel(f32(q), f32(k), f32(v), maskf, float(scale), bool(is_causal))  # [B, H, Sq, Dv]
    return out.to(q.dtype)
