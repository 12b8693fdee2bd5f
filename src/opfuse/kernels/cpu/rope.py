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

rope_qk rotates q [B, H, S, D] and k [B, Hkv, S, D] with the same tables in one op call:
cos / sin are checked and staged to float32 once, then the same kernel runs over q and k
(read BHSD + BHkvSD + 2 Bc SD, write BHSD + BHkvSD).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, prange

from opfuse.kernels.checks import ROPE_LAYOUTS as LAYOUTS  # noqa: F401  (re-exported)
from opfuse.kernels.checks import check_rope, check_rope_qk
from opfuse.kernels.cpu import _math
from opfuse.kernels.cpu._launch import by_address, f32, launch, to_torch
from opfuse.kernels.registry import register


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


@njit(error_model="numpy", cache=True)
def _rotate_row(x, c, s, y, interleaved):  # one row of either layout (every row loop's one call)
    if interleaved:
        _row_interleaved(x, c, s, y)
    else:
        _row_rotate_half(x, c, s, y)


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
            _rotate_row(x[b, h, t], cos[bc, t], sin[bs, t], out[b, h, t], interleaved)


@njit(error_model="numpy", cache=True)
def _rope_at(xp, cp, sp, outp, b, h, s, d, bt, interleaved):
    # _rope_kernel on float32 contiguous tensors given by address: x, out [B, H, S, D];
    # cos, sin [Bt, S, D] (Bt in {1, B}), serial
    x, out = carray(_math.f32_at(xp), (b, h, s, d)), carray(_math.f32_at(outp), (b, h, s, d))
    cos, sin = carray(_math.f32_at(cp), (bt, s, d)), carray(_math.f32_at(sp), (bt, s, d))
    for bb in range(b):
        c = bb if bt > 1 else 0
        for hh in range(h):
            for t in range(s):
                _rotate_row(x[bb, hh, t], cos[c, t], sin[c, t], out[bb, hh, t], interleaved)


def _tables_at(cos: torch.Tensor, sin: torch.Tensor, cos_shape: tuple, sin_shape: tuple, s: int, d: int) -> int:
    """Bt when cos and sin are float32 contiguous full tables [Bt, 1, S, D] of one shape
    (HF's ``unsqueeze(1)`` of [B, S, D]) — what :func:`_rope_at` reads by address — else 0."""
    bt = cos_shape[0]
    if cos_shape != sin_shape or tuple(cos_shape[1:]) != (1, s, d):
        return 0
    return bt if by_address(cos, sin) else 0


def _table(t: torch.Tensor, shape: tuple[int, ...], s: int, d: int) -> np.ndarray:
    """cos / sin of (checked) 4-D ``shape`` [Bt, 1, S|1, D|1] -> float32 [Bt, S, D] (numpy)."""
    bt = shape[0]
    if tuple(t.shape) == (bt, 1, s, d) and t.dtype is torch.float32 and t.is_contiguous():
        return t.detach().numpy().reshape(bt, s, d)  # HF's cos/sin: no torch view ops (~10 µs a table)
    return f32(t.reshape(shape).expand(bt, 1, s, d)).numpy().reshape(bt, s, d)


def _rotate(x: torch.Tensor, cos3: np.ndarray, sin3: np.ndarray, layout: str, out_dtype: torch.dtype):
    """x [B, H, S, D] (checked) rotated with float32 tables [Bc, S, D] -> [B, H, S, D] of out_dtype."""
    xf = x.detach() if x.dtype is torch.float32 else x.detach().to(torch.float32)  # keeps x's strides
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    out = np.empty(tuple(x.shape), dtype=np.float32)  # [B, H, S, D]
    launch(_rope_kernel, out.size)(xf.numpy(), cos3, sin3, out, layout == "interleaved")
    return to_torch(out, tuple(x.shape), out_dtype)


def _out_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


@register("rope", "cpu")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x * cos + R(x) * sin; x [B, H, S, D], cos / sin broadcastable to [B, 1, S, D]."""
    (b, s, d), cos_shape, sin_shape = check_rope(x, cos, sin, layout, device_type="cpu")
    cos3, sin3 = _table(cos, cos_shape, s, d), _table(sin, sin_shape, s, d)  # [Bc, S, D], [Bs, S, D]
    return _rotate(x, cos3, sin3, layout, _out_dtype(x, cos, sin))


@register("rope_qk", "cpu")
def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(q), rope(k)) with the same tables; q [B, H, S, D], k [B, Hkv, S, D]."""
    (b, s, d), cos_shape, sin_shape = check_rope_qk(q, k, cos, sin, layout, device_type="cpu")
    bt = _tables_at(cos, sin, cos_shape, sin_shape, s, d)
    if bt and by_address(q, k):  # a decode step's one-row q and k: by address, no numpy views
        dense = torch.contiguous_format  # float32 like q and k, never torch's default dtype
        qo, ko = torch.empty_like(q, memory_format=dense), torch.empty_like(k, memory_format=dense)
        inter = layout == "interleaved"
        _rope_at(q.data_ptr(), cos.data_ptr(), sin.data_ptr(), qo.data_ptr(), b, q.shape[1], s, d, bt, inter)
        _rope_at(k.data_ptr(), cos.data_ptr(), sin.data_ptr(), ko.data_ptr(), b, k.shape[1], s, d, bt, inter)
        return qo, ko
    cos3, sin3 = _table(cos, cos_shape, s, d), _table(sin, sin_shape, s, d)  # staged once: [Bc, S, D]
    return (_rotate(q, cos3, sin3, layout, _out_dtype(q, cos, sin)),  # read BHSD, write BHSD
            _rotate(k, cos3, sin3, layout, _out_dtype(k, cos, sin)))  # read BHkvSD, write BHkvSD
