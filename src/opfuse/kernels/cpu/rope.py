"""rope: rotary position embedding out = x * cos + R(x) * sin, R fixed by ``layout``.

    x [B, H, S, D] (any strides) ──┐
    cos, sin [B|1, 1, S, D] ───────┴── per (b, h, s) row: rotate pairs ──► out [B, H, S, D]

Both layouts take full-width cos / sin (D values per position) and are different functions:

  * "rotate_half" (GPT-NeoX, HF Llama ``rotate_half``; cos = cat(c, c)): pairs (j, j + D/2)
        out[j]       = x[j] * cos[j]             - x[j + D/2] * sin[j]
        out[j + D/2] = x[j + D/2] * cos[j + D/2] + x[j] * sin[j + D/2]       j < D/2
  * "interleaved" (GPT-J ``rotate_every_two``, Mesh-TF; cos = repeat_interleave(c, 2)):
    pairs (2i, 2i + 1)
        out[2i]     = x[2i] * cos[2i]         - x[2i + 1] * sin[2i]
        out[2i + 1] = x[2i + 1] * cos[2i + 1] + x[2i] * sin[2i + 1]          i < D/2

i.e. element j always uses cos[j] and sin[j] (the HF convention: x * cos + R(x) * sin with
the table already expanded to D); reference.rope is the same formula in float64.

x comes as q / k transposed views ([B, S, H, D] -> [B, H, S, D]): it is read through its
strides (a float16/bfloat16 x is converted once, keeping its strides); only a tensor whose
last dim is not unit-stride is copied. cos / sin are broadcast over heads, and over batch
when their first dim is 1. Result: contiguous [B, H, S, D] of promote(x, cos, sin) dtype.

Traffic (float32): read BHSD + 2 Bc SD (tables cache-resident across heads), write BHSD.
Eager: 2 slices, neg, cat, 2 muls, add = ~7 passes over BHSD.
"""

from __future__ import annotations

import torch
from numba import njit, prange

from opfuse.kernels.cpu import _math
from opfuse.kernels.cpu._launch import check_tensor, f32, launch
from opfuse.kernels.registry import register

LAYOUTS = ("rotate_half", "interleaved")


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_rotate_half(x, c, s, y):  # x, c, s: [D] f32 in; y: [D] f32 out; read 3D, write D
    half = y.shape[0] // 2
    for j in range(half):
        a = x[j]
        b = x[j + half]
        y[j] = a * c[j] - b * s[j]
        y[j + half] = b * c[j + half] + a * s[j + half]


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_interleaved(x, c, s, y):  # x, c, s: [D] f32 in; y: [D] f32 out; read 3D, write D
    for i in range(y.shape[0] // 2):
        a = x[2 * i]
        b = x[2 * i + 1]
        y[2 * i] = a * c[2 * i] - b * s[2 * i]
        y[2 * i + 1] = b * c[2 * i + 1] + a * s[2 * i + 1]


@njit(parallel=True, error_model="numpy", cache=True)
def _rope_kernel(x, cos, sin, out, interleaved):
    # x: [B, H, S, D] f32 (any strides); cos: [Bc, S, D], sin: [Bs, S, D] f32, Bc, Bs in {1, B};
    # out: [B, H, S, D] f32 C-contiguous
    n_heads = x.shape[1]
    for bh in prange(x.shape[0] * n_heads):
        b = bh // n_heads
        h = bh % n_heads
        bc = b if cos.shape[0] > 1 else 0
        bs = b if sin.shape[0] > 1 else 0
        for t in range(x.shape[2]):
            if interleaved:
                _row_interleaved(x[b, h, t], cos[bc, t], sin[bs, t], out[b, h, t])
            else:
                _row_rotate_half(x[b, h, t], cos[bc, t], sin[bs, t], out[b, h, t])


def _table(op: str, name: str, t: torch.Tensor, b: int, s: int, d: int) -> torch.Tensor:
    """cos / sin broadcastable to [B, 1, S, D] -> float32 [Bc, S, D], Bc in {1, B}."""
    check_tensor(op, name, t)
    target = (b, 1, s, d)
    shape = (1,) * (4 - t.dim()) + tuple(t.shape) if t.dim() <= 4 else tuple(t.shape)
    if len(shape) != 4 or any(n not in (1, want) for n, want in zip(shape, target)):
        raise ValueError(f"opfuse.{op}: {name} shape {tuple(t.shape)} is not broadcastable to [B, 1, S, D] = {target}")
    bt = shape[0]
    return f32(t.reshape(shape).expand(bt, 1, s, d)).reshape(bt, s, d)


@register("rope", "cpu")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x * cos + R(x) * sin; x [B, H, S, D], cos / sin broadcastable to [B, 1, S, D]."""
    op = "rope"
    check_tensor(op, "x", x)
    if x.dim() != 4:
        raise ValueError(f"opfuse.{op}: x must be 4-D [B, H, S, D], got shape {tuple(x.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"opfuse.{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    b, _, s, d = x.shape
    if d % 2 != 0:
        raise ValueError(f"opfuse.{op}: head dim D must be even to rotate pairs, got D = {d}")
    cos3 = _table(op, "cos", cos, b, s, d)  # [Bc, S, D]
    sin3 = _table(op, "sin", sin, b, s, d)  # [Bs, S, D]

    xf = x.detach().to(torch.float32)  # keeps x's strides (a transposed view stays one)
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    out = torch.empty(tuple(x.shape), dtype=torch.float32)  # [B, H, S, D]
    launch(_rope_kernel, out.numel())(xf.numpy(), cos3.numpy(), sin3.numpy(), out.numpy(), layout == "interleaved")
    return out.to(torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype))
