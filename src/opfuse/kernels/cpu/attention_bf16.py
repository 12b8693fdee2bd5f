"""attention_bf16: softmax(q @ k.T * scale + mask) @ v with bf16 GEMMs and float32 softmax.

    q [B, H, Sq, D] ─┐ → bf16 ─ S₁ = q·kᵀ (oneDNN bf16 batched GEMM, rounded to bf16) ─┐
    k [B, H, Sk, D] ─┤                                                                 │ _row_max: m = max over kept keys of S₁
                     │   S = q·kᵀ − m  (baddbmm: the shift enters oneDNN's f32 accumulator, ◄┘  (bf16-exact, so −m is exact)
                     │        one rounding to bf16 of the *shifted* score)
                     │   _softmax_rows: P = softmax(scale·S + mask) in float32 → bf16
    v [B, H, Sk, Dv] ┴── O = P·v (oneDNN bf16 batched GEMM, float32 accumulation) ──► [B, H, Sq, Dv] float32

Why the shift: a bf16 GEMM writes bf16, and rounding a raw score s to bf16 costs |s|·2⁻⁹ in
the exponent (scores reach |s|·scale = 80 in MiniLM's first layer: a 15% error in a
probability). softmax is shift-invariant, so subtracting the row's max before the single
rounding makes the error |s − m|·2⁻⁹, small exactly where the probabilities are large
(near-max entries measured 0.0078 vs 0.25–0.49 unshifted). Measured on all-MiniLM-L6-v2's
six layers (8×128, real weights), max|Δ|/max|ref| of the attention output vs float64: this
kernel 5.5e-3 … 1.3e-2, the same as ATen's bf16 SDPA (float32 scores; 4.8e-3 … 1.3e-2),
where the unshifted bf16 scores gave 7.4e-3 … 2.8e-2. The error budget of
``precision="bf16"`` (:mod:`opfuse.precision`) decides per layer whether this is used.

Non-finite input: a row whose scores hold NaN/±inf (from q or k) makes the whole call run the
float32 kernel (:mod:`opfuse.kernels.cpu.attention`), so NaN positions are eager's. A fully
masked row gives 0, as ATen SDPA. GQA (Hkv < H) and causal with Sq ≠ Sk run the float32
kernel (not measured faster here).

FLOPs: 6·B·H·Sq·Sk·D (three GEMMs; the first only for the shift); traffic: read q, k, v (+mask),
2 + 2 + 2 bytes per score (S₁, S, P), write out.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from opfuse.kernels.checks import check_attention, check_attention_mask
from opfuse.kernels.cpu import _math
from opfuse.kernels.cpu._launch import launch
from opfuse.kernels.cpu.attention import attention as attention_f32
from opfuse.kernels.registry import register

_SHIFT = np.uint32(16)
_NEG_INF = np.float32(-np.inf)
_KEEP = np.float32(-1e4)  # an additive mask entry above this counts as kept for the shift's max
_EXP_MIN = np.float32(-87.0)
_Z = np.float32(0.0)
_ONE = np.float32(1.0)
_ROUND = np.uint32(0x7FFF)
_ONE_U = np.uint32(1)
_U16 = np.uint32(0xFFFF)
_SIGN = np.uint32(0x8000)
_EXPO = np.uint32(0x7F80)
_SIGN32 = np.uint32(0x80000000)
_ALL = np.uint32(0xFFFFFFFF)
_BLOCK = 64  # rows per parallel task


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True)
def _max_key(s, r, mask, mr, has_mask, n):
    # row r of s [R, Sk] uint16 bf16 bits, row mr of mask [Rm, Sk] f32 additive (2-D
    # indexing: a sliced row per call cost 3x the loop); the largest order key (bf16 bits
    # mapped to an unsigned order: integer max vectorises without fast-math) over the
    # first n keys that the mask keeps; 0 when none is kept.
    best = np.uint32(0)
    for j in range(n):
        u = np.uint32(s[r, j])
        key = (u ^ _U16) if u & _SIGN else (u | _SIGN)
        if has_mask and not mask[mr, j] > _KEEP:
            key = np.uint32(0)
        best = max(best, key)
    return best


@njit(error_model="numpy", cache=True, parallel=True)
def _row_max(s, mask, mrow, has_mask, causal, m):
    # s: [R, Sk] uint16 (bf16 bits of q·kᵀ, R = B·H·Sq rows, row r = (b·H + h)·Sq + i);
    # mask: [Rm, Sk] f32 additive, row r uses mask[mrow[r]]; m: [R] uint16 out, the bf16
    # bits of −(max over kept keys), 0 when none is kept or the max is not finite (any
    # shift is exact: it only has to be a bf16 value).
    R, Sk = s.shape
    for r in prange(R):
        n = Sk
        if causal:
            n = min(Sk, r % causal + 1)
        key = _max_key(s, r, mask, mrow[r], has_mask, n)
        u = (key ^ _SIGN) if key & _SIGN else (key ^ _U16)
        if key == 0 or (u & _EXPO) == _EXPO:
            m[r] = 0
        else:
            m[r] = u ^ _SIGN  # the negated max


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_scores(s, r, mask, mr, has_mask, n, scale, x):
    # x[j] = scale · s[r, j] + mask[mr, j] for j < n, −inf beyond (causal); returns (max x, all s
    # finite). Both reductions are integer maxima (a float max reduction did not vectorise:
    # 0.43 ms per 1.6M scores against 0.11 for the integer one): the largest exponent
    # field of s, and the largest order key of x's bits (x holds no NaN here).
    best = np.uint32(0)
    expo = np.uint32(0)
    for j in range(s.shape[1]):
        u = np.uint32(s[r, j])
        expo = max(expo, u & _EXPO)
        v = _math.f32_from_bits(u << _SHIFT) * scale
        if has_mask:
            v = v + mask[mr, j]
        v = v if j < n else _NEG_INF
        x[j] = v
        b = _math.f32_bits(v)
        best = max(best, (b ^ _ALL) if b & _SIGN32 else (b | _SIGN32))
    b = (best ^ _SIGN32) if best & _SIGN32 else (best ^ _ALL)
    return _math.f32_from_bits(b), expo != _EXPO


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True)
def _row_exp(x, mx, e):  # e[j] = exp(x[j] − mx) (0 below e^-87, a select: vectorises); returns the sum
    acc = _Z
    for j in range(x.shape[0]):
        d = x[j] - mx
        v = _math.exp_f32(d)
        v = v if d > _EXP_MIN else _Z
        e[j] = v
        acc += v
    return acc


@njit(fastmath=_math._APPLY, error_model="numpy", cache=True)
def _row_round(e, inv, p, r):  # p[r, j] = bf16 bits of e[j] · inv, round to nearest even
    for j in range(e.shape[0]):
        u = _math.f32_bits(e[j] * inv)
        p[r, j] = ((u + _ROUND + ((u >> _SHIFT) & _ONE_U)) >> _SHIFT) & _U16


@njit(error_model="numpy", cache=True, parallel=True)
def _softmax_rows(s, mask, mrow, has_mask, causal, scale, p, bad):
    # s: [R, Sk] uint16 (bf16 bits of the shifted scores); p: [R, Sk] uint16 out (bf16
    # bits of the probabilities); bad: [R] uint8 out, 1 where a row held NaN/±inf scores
    # (the caller then runs the float32 kernel). causal: Sq (key j ≤ query i) or 0.
    R, Sk = s.shape
    blocks = (R + _BLOCK - 1) // _BLOCK
    for blk in prange(blocks):
        x = np.empty(Sk, np.float32)  # scratch rows per block (an allocation per row cost 2x the kernel);
        e = np.empty(Sk, np.float32)  # e apart from x: exp in place (aliased) did not vectorise, 10x slower
        for r in range(blk * _BLOCK, min(R, (blk + 1) * _BLOCK)):
            n = Sk
            if causal:
                n = min(Sk, r % causal + 1)
            mx, finite = _row_scores(s, r, mask, mrow[r], has_mask, n, scale, x)
            if not finite:
                bad[r] = 1
            elif mx == _NEG_INF:  # fully masked row: 0, as ATen SDPA
                p[r, :] = 0
            else:
                _row_round(e, _ONE / _row_exp(x, mx, e), p, r)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _mask_rows(mask: torch.Tensor | None, b: int, h: int, sq: int, sk: int) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """(additive float32 mask rows [Rm, Sk], row index [B·H·Sq] int64 into them, has_mask);
    None when the mask holds NaN or +inf (the float32 kernel then gives eager's NaNs)."""
    rows = b * h * sq
    if mask is None:
        return np.zeros((1, sk), np.float32), np.zeros(rows, np.int64), False
    m = mask.detach()
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, float("-inf"))
    else:
        m = m.float()
        if bool(torch.isnan(m).any()) or bool((m == float("inf")).any()):
            return None
    while m.dim() < 4:
        m = m.unsqueeze(0)
    mb, mh, mq = m.shape[:3]
    m = m.expand(mb, mh, mq, sk).contiguous().view(mb * mh * mq, sk)
    ib = torch.arange(b).view(b, 1, 1) if mb > 1 else torch.zeros(1, 1, 1, dtype=torch.long)
    ih = torch.arange(h).view(1, h, 1) if mh > 1 else torch.zeros(1, 1, 1, dtype=torch.long)
    iq = torch.arange(sq).view(1, 1, sq) if mq > 1 else torch.zeros(1, 1, 1, dtype=torch.long)
    idx = ((ib * mh + ih) * mq + iq).expand(b, h, sq).reshape(rows)
    return m.numpy(), idx.numpy(), True


@register("attention_bf16", "cpu")
def attention_bf16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
) -> torch.Tensor:
    """Scaled dot-product attention with bf16 GEMMs (module docstring); q [B,H,Sq,D],
    k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv] float32 (or bf16), mask None or broadcastable to
    [B,H,Sq,Sk] (bool, True = keep, or additive float) -> [B,H,Sq,Dv] in q's dtype.
    Raises ValueError (named) as :func:`opfuse.kernels.cpu.attention.attention`."""
    b, h, hkv, sq, sk, d, dv = check_attention(q, k, v, device_type="cpu")
    if mask is not None:
        check_attention_mask(mask, q, (b, h, sq, sk), is_causal, device_type="cpu")
    if hkv != h or (is_causal and sq != sk) or not (b * h * sq * sk):
        return attention_f32(q, k, v, mask, scale, is_causal)
    rows = _mask_rows(mask, b, h, sq, sk)
    if rows is None:
        return attention_f32(q, k, v, mask, scale, is_causal)
    bf = torch.bfloat16
    qb = q.detach().to(bf).reshape(b * h, sq, d)
    kt = k.detach().to(bf).reshape(b * h, sk, d).transpose(1, 2)
    vb = v.detach().to(bf).reshape(b * h, sk, dv)
    maskf, mrow, has_mask = rows
    causal = sq if is_causal else 0
    work = b * h * sq * sk
    s1 = torch.bmm(qb, kt)  # [BH, Sq, Sk] bf16
    shift = torch.empty(b * h * sq, dtype=bf)
    launch(_row_max, work)(_bits(s1).reshape(-1, sk), maskf, mrow, has_mask, causal, _bits(shift))
    s = torch.baddbmm(shift.view(b * h, sq, 1).expand(b * h, sq, sk), qb, kt)  # q·kᵀ − m, one rounding
    p = torch.empty((b * h, sq, sk), dtype=bf)
    bad = np.zeros(b * h * sq, np.uint8)
    launch(_softmax_rows, work)(_bits(s).reshape(-1, sk), maskf, mrow, has_mask, causal, np.float32(scale),
                                _bits(p).reshape(-1, sk), bad)
    if bad.any():
        return attention_f32(q, k, v, mask, scale, is_causal)
    out = torch.bmm(p, vb).view(b, h, sq, dv)
    return out.to(q.dtype)
