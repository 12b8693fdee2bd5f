"""rope / rope_qk (Triton): out = x * cos + R(x) * sin, R fixed by the layout (see cpu/rope.py).

    x [B, H, S, D] (any strides, unit inner stride) ──┐
    cos, sin [B|1, 1, S, D] ──────────────────────────┴── one program per (b, h, s) row ──► out [B, H, S, D]

Element j pairs with p(j) and a sign: "rotate_half" p(j) = j ± D/2 (minus for j < D/2),
"interleaved" p(j) = j xor 1 (minus for even j); out[j] = x[j] cos[j] + sign(j) x[p(j)] sin[j],
in float32, stored in promote(x, cos, sin). The partner is a second (L1-hit) load of the
same row. rope_qk launches the same kernel on q and on k with one set of tables.

Traffic per row: read D·e (+2D·e tables, L2-resident across heads), write D·e. Eager:
2 slices, neg, cat, 2 muls, add: ~7 passes over [B, H, S, D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opfuse.kernels.checks import check_rope, check_rope_qk
from opfuse.kernels.registry import register
from opfuse.kernels.triton._common import DEVICE_TYPE, row_block, row_warps


@triton.jit
def _rope_fwd_kernel(
    X,  # [B, H, S, D] at (sxb, sxh, sxs, 1)
    C,  # [B, S, D] cos at (scb, scs, 1); scb = 0 when broadcast over batch
    Sn,  # [B, S, D] sin at (ssb, sss, 1)
    Out,  # [B, H, S, D] contiguous
    H,
    S,
    D,
    sxb,
    sxh,
    sxs,
    scb,
    scs,
    ssb,
    sss,
    INTERLEAVED: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (b, h, t) flattened
    t = row % S
    h = (row // S) % H
    b = row // (S * H)
    cols = tl.arange(0, BLOCK_D)
    valid = cols < D
    if INTERLEAVED:
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        half = D // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    x_row = X + b * sxb + h * sxh + t * sxs
    x = tl.load(x_row + cols, mask=valid, other=0.0).to(tl.float32)  # read D
    xp = tl.load(x_row + partner, mask=valid, other=0.0).to(tl.float32)  # same row again (L1)
    c = tl.load(C + b * scb + t * scs + cols, mask=valid, other=0.0).to(tl.float32)  # read D (L2)
    s = tl.load(Sn + b * ssb + t * sss + cols, mask=valid, other=0.0).to(tl.float32)  # read D (L2)
    out = x * c + sign * xp * s
    tl.store(Out + row * D + cols, out.to(Out.dtype.element_ty), mask=valid)  # write D


def config(d: int) -> dict:
    """Launch configuration for head dim d (also what aot.py compiles)."""
    block = row_block("rope", d)
    return dict(BLOCK_D=block, num_warps=row_warps(block))


def _table(t: torch.Tensor, shape: tuple[int, ...], b: int, s: int, d: int) -> torch.Tensor:
    """cos / sin of (checked) 4-D ``shape`` -> a [B, S, D] view (stride 0 where broadcast), unit inner stride."""
    t3 = t.reshape(shape).expand(shape[0], 1, s, d)[:, 0]
    if t3.stride(-1) != 1:
        t3 = t3.contiguous()
    return t3.expand(b, s, d)


def _rotate(x: torch.Tensor, c3: torch.Tensor, s3: torch.Tensor, layout: str, out_dtype: torch.dtype):
    """x [B, H, S, D] (checked) rotated with [B, S, D] tables."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    bsz, h, s, d = x.shape
    out = torch.empty((bsz, h, s, d), dtype=out_dtype, device=x.device)  # [B, H, S, D]
    rows = bsz * h * s
    if rows > 0:
        _rope_fwd_kernel[(rows,)](
            x, c3, s3, out, h, s, d, x.stride(0), x.stride(1), x.stride(2),
            c3.stride(0), c3.stride(1), s3.stride(0), s3.stride(1),
            INTERLEAVED=layout == "interleaved", **config(d),
        )
    return out


def _out_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


@register("rope", "cuda")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x * cos + R(x) * sin; x [B, H, S, D], cos / sin broadcastable to [B, 1, S, D]."""
    (b, s, d), cos_shape, sin_shape = check_rope(x, cos, sin, layout, device_type=DEVICE_TYPE)
    c3, s3 = _table(cos, cos_shape, b, s, d), _table(sin, sin_shape, b, s, d)
    return _rotate(x, c3, s3, layout, _out_dtype(x, cos, sin))


@register("rope_qk", "cuda")
def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(q), rope(k)) with the same tables; q [B, H, S, D], k [B, Hkv, S, D]."""
    (b, s, d), cos_shape, sin_shape = check_rope_qk(q, k, cos, sin, layout, device_type=DEVICE_TYPE)
    c3, s3 = _table(cos, cos_shape, b, s, d), _table(sin, sin_shape, b, s, d)
    return (_rotate(q, c3, s3, layout, _out_dtype(q, cos, sin)),
            _rotate(k, c3, s3, layout, _out_dtype(k, cos, sin)))
