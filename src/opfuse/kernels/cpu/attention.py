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

from opfuse.kernels.checks import check_attention, check_attention_mask
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
    b, h, _, sq, sk, _, _ = check_attention(q, k, v, device_type="cpu")
    if mask is not None:
        check_attention_mask(mask, q, (b, h, sq, sk), is_causal, device_type="cpu")

    # float32 compute, but keep the strides: ATen SDPA reads strided Q/K/V (the usual
    # [B,S,H,D]->[B,H,S,D] transposed views), so no contiguous copy is made here
    def as_f32(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if t.dtype == torch.float32 else t.detach().float()

    maskf = None if mask is None else (mask.detach() if mask.dtype == torch.bool else as_f32(mask))
    out = _attention_kernel(as_f32(q), as_f32(k), as_f32(v), maskf, float(scale), bool(is_causal))  # [B, H, Sq, Dv]
    return out if q.dtype is torch.float32 else out.to(q.dtype)
