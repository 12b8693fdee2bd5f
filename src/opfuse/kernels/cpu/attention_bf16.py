"""attention_bf16: softmax(q @ k.T * scale + mask) @ v with bf16 GEMMs and float32 softmax.

    q [B, H, Sq, D] ─┐ → bf16 ─ S₁ = q·kᵀ (oneDNN bf16 batched GEMM, rounded to bf16) ─┐
    k [B, H, Sk, D] ─┤                                                                 │ _row_max: m = max over kept keys of S₁
                     │   S = [q | −m | 0]·[k | 1 | 0]ᵀ = q·kᵀ − m (K = D + 2: the shift ◄┘  (bf16-exact, so −m is exact)
                     │        enters oneDNN's f32 accumulator; one rounding to bf16 of the *shifted* score)
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

The heads go through in chunks whose bf16 scores fill ~1 MB (L2): S₁, S and P share one
buffer (S overwrites S₁ once its row max is taken, P overwrites S row by row), so the
scores never leave the core's cache between the GEMMs and the softmax.

``sample=True`` takes m from :data:`LANDMARKS` evenly spaced keys instead of all of them
(L = q·k_lᵀ, one GEMM an eighth of S₁'s at Sk = 128, then _landmark_max): S − m is then
small near the row's max wherever a landmark scores close to it. Any bf16 m keeps the
softmax exact (only where the rounding falls changes), so this is a question of error only,
which the precision pass measures per layer. Measured on all-MiniLM-L6-v2's six layers (real
weights; 8 sentences, and 8×128 random tokens), max|Δ|/max|ref| vs float64 of the emulated
forms: sampled 2.8e-3…6.1e-3 and 5.2e-3…1.3e-2, the full row max 3.6e-3…6.0e-3 and 5.1e-3…1.3e-2,
raw 2.8e-3…1.2e-2 and 7.3e-3…2.8e-2; on random q, k (no dominant key) sampled is between
(2.1e-2 against 4.5e-3 and 5.5e-2). Time, 8×12×128×32, Zen 4, one thread: 2.68 ms against
3.43 for the full row max and 2.40 unshifted.

``shift=False`` skips S₁ and the row max: S = q·kᵀ rounded as it is (the softmax then takes
the max off itself, as without the shift its scores can be large).

``aten=True`` runs ATen's own SDPA on q, k, v rounded to bf16 instead (its CPU flash kernel:
float32 scores, online softmax in float32, P rounded to bf16 for P·v; GQA through
``enable_gqa``). Where oneDNN/ATen have AMX tiles it is the faster form: measured on the
Intel Xeon with amx_bf16 (one thread, ms) 1.76 vs 2.81 float32 at 8×12×128×32 and 3.0 vs 7.9
at 1×12×512×64, while on Zen 5 (avx512_bf16, no AMX) it was slower than float32 (1.01 vs
0.84 at 1×12×128×64). Its non-finite and fully masked rows are ATen's, as the float32
kernel's. The precision pass times the forms and keeps the fastest.

``tiles=True`` (where :func:`tiles_supported`: avx512_bf16, D even, Dv a multiple of 32)
runs the whole attention as two numba kernels with AVX512-BF16 register tiles
(:mod:`opfuse.kernels.cpu._bf16dot`), no oneDNN call and no S × S tensor::

    _pack_heads   (row by row, every head of a row together: q, k, v stream in memory order)
      q [B,H,Sq,D]  → qs [B·H, Sqp, D/2]   bf16 pairs along D (rows padded to whole tiles)
      k [B,H,Sk,D]  → kp [B·H, D/2, Skp]   k transposed, pairs along D (keys padded to 32)
      v [B,H,Sk,Dv] → vp [B·H, Skp/2, Dv]  pairs along the keys
    _tiled_heads  (per head, ROWS = 8 query rows at a time; everything below in L1)
      S = q·kᵀ                  qk_tile: float32 scores, exact bf16 products (vdpbf16ps)
      x = (scale·S + mask)·log₂e, m = max x    (integer max of order keys)
      P = 2^(x − m) → bf16, Σ = Σ 2^(x − m)    (exp2_lo: degree-4 polynomial, rel. err 2.7e-6)
      O = P·v / Σ               pv_tile: float32 accumulation, rounded once to bf16 (or float32)

The scores are float32 (as ATen's bf16 SDPA: no shift is needed, and q, k, v and P are the
only bf16 roundings). NaN / ±inf raw scores make the call run the float32 kernel, a fully
masked row gives 0, NaN in v reaches the outputs eager's P·v reaches. Measured on Zen 4 (one
thread, ms per call, the inputs as views of one QKV GEMM result, caches evicted before each
call): 8×12×128×32 2.82 against 3.77 for the sampled shift and 3.12 unshifted; 1×12×128×64
0.76 vs 1.05 / 0.82; 1×12×384×64 3.69 vs 4.70 / 4.13. In all-MiniLM-L6-v2's bf16 plan
(8×128) the six attentions went 21.0 → 15.1 ms. Error vs float64 on random inputs
(8×12×128×32): 2–3e-3 against 3.3–4e-3 for the shifted form.

FLOPs: 6·B·H·Sq·Sk·D (three GEMMs; the first only for the shift; 4·… unshifted, (4 + 2/8)·… sampled at
Sk = 128); traffic: read q, k, v (+mask),
2 + 2 + 2 bytes per score (S₁, S, P; in L2), write out. ``tiles=True``: 4·B·H·Sq·Sk·D;
read q, k, v once (and write and read their packed copies), write out.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from functools import cache

import numpy as np
import torch
from numba import njit, prange

from opfuse.kernels.checks import check_attention, check_attention_mask
from opfuse.kernels.cpu import _bf16dot, _math
from opfuse.kernels.cpu._launch import launch
from opfuse.kernels.cpu.attention import attention as attention_f32
from opfuse.kernels.registry import register

#: In the precision pass's timing-cache key (opfuse.precision): a changed kernel is timed again.
VERSION = 9
_NEG_INF = np.float32(-np.inf)
_INF = np.float32(np.inf)
_KEEP = np.float32(-1e4)  # an additive mask entry above this counts as kept for the shift's max
_EXP_MIN = np.float32(-87.0)
_NO_SHIFT_MAX = np.float32(60.0)  # exp(x) without the max taken off: safe while max x ≤ 60 (Σ ≤ Sk·e⁶⁰ ≪ 3.4e38)
_NO_SHIFT_SUM = np.float32(1e-30)  # … and while Σ exp(x) stays far from underflow
_Z = np.float32(0.0)
_ONE = np.float32(1.0)
_EXPO = np.uint32(0x7F80)
_F32_EXPO = np.uint32(0x7F800000)
_LOG2E = np.float32(1.4426950408889634)
_EXP2_MIN = np.float32(-125.0)  # 2^x below this is taken as 0 (exp2_lo's range)
_BLOCK = 64  # rows per parallel task


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True)
def _max_key(s, r, mask, mr, has_mask, n):
    # row r of s [R, Sk] uint16 bf16 bits, row mr of mask [Rm, Sk] f32 additive (2-D
    # indexing: a sliced row per call cost 3x the loop); the largest order key (an integer
    # max vectorises without fast-math; 32-bit intrinsics keep it at 16 lanes) over the
    # first n keys that the mask keeps; 0 when none is kept.
    best = np.uint32(0)
    for j in range(n):
        key = _math.order_key(_math.bf16_to_f32(s[r, j]))
        if has_mask and not mask[mr, j] > _KEEP:
            key = np.uint32(0)
        best = _math.umax32(best, key)
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
        mx = _math.from_order_key(key)  # a bf16 value: its negation is exact in bf16
        m[r] = _math.f32_to_bf16(-mx) if key != 0 and np.isfinite(mx) else 0


@njit(error_model="numpy", cache=True, parallel=True)
def _landmark_max(s, ml, mrow, causal, step, m):
    # s: [R, L] uint16 (bf16 bits of q·k_lᵀ for the landmark keys l·step, l < L); ml: [Rm, L]
    # f32, 0 where the mask keeps landmark l, −inf where not; m: [R] uint16 out (may be a
    # strided column: the augmented q's shift column), the bf16 bits of −(max over the kept
    # landmarks), 0 when none is kept or it is not finite. Written as order keys of
    # (score + ml): one 16-lane vector a row at L = 16.
    R, L = s.shape
    for r in prange(R):
        n = L * step
        if causal:
            n = r % causal + 1
        mr = mrow[r]
        best = np.uint32(0)
        for t in range(L):
            v = _math.bf16_to_f32(s[r, t]) + ml[mr, t]
            v = v if t * step < n else _NEG_INF
            best = _math.umax32(best, _math.order_key(v))
        mx = _math.from_order_key(best)
        m[r] = _math.f32_to_bf16(-mx) if np.isfinite(mx) else 0


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True)
def _row_exp(s, r, mask, mr, has_mask, n, scale, mx, e):
    # e[j] = exp(x_j − mx), x_j = scale·s[r, j] + mask[mr, j] (−inf from key n on), 0 below
    # e^-87 (a select: vectorises); returns the sum. The softmax's second pass, for rows whose
    # scores are large (raw scores) or masked by finite values.
    acc = _Z
    for j in range(s.shape[1]):
        v = _math.bf16_to_f32(s[r, j]) * scale
        if has_mask:
            v = v + mask[mr, j]
        d = v - mx if j < n else _NEG_INF
        w = _math.exp_f32(d)
        w = w if d > _EXP_MIN else _Z
        e[j] = w
        acc += w
    return acc


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True, parallel=True)
def _softmax_rows(s, mask, mrow, has_mask, causal, scale, p, bad):
    # s: [R, Sk] uint16 (bf16 bits of the shifted scores); p: [R, Sk] uint16 out (bf16
    # bits of the probabilities); bad: [R] uint8 out, 1 where a row held NaN/±inf scores
    # (the caller then runs the float32 kernel), 0 elsewhere. causal: Sq (key j ≤ query i) or 0. The
    # mask holds no NaN / +inf (the caller checks it once): with finite scores (the bf16
    # exponent field looked at) x is then never NaN, so the loop tracks no NaN.
    # The row loop is written out here, not called: as helpers it ran 0.63 ns a score
    # against 0.48 inline (Zen 5, one thread); and twice, causal or not: the key limit's
    # select costs 20% of the loop where nothing is cut (347 vs 291 µs a 32-head chunk at
    # 128×128, Zen 4), and a loop cut at n (no select) runs its remainder scalar.
    R, Sk = s.shape
    blocks = (R + _BLOCK - 1) // _BLOCK
    for blk in prange(blocks):
        e = np.empty(Sk, np.float32)  # scratch row per block (an allocation per row cost 2x the kernel)
        for r in range(blk * _BLOCK, min(R, (blk + 1) * _BLOCK)):
            n = Sk
            if causal:
                n = min(Sk, r % causal + 1)
            mr = mrow[r]
            bad[r] = 0  # bad is a reused buffer (the workspace's): every row written
            # e = exp(x), x = scale·s + mask (−inf beyond n), with no max taken off (shifted
            # scores: x ≤ ~0 where the mask is ≤ 0; raw scores or a positive mask fail the
            # check below and take the max off in a second pass). The max is an integer max of
            # 32-bit keys (a float max reduction did not vectorise: 0.43 ms per 1.6M scores
            # against 0.11).
            best = np.uint32(0)
            expo = np.uint32(0)
            total = _Z
            if causal:
                for j in range(Sk):
                    u = s[r, j]
                    expo = _math.umax32(expo, _math.bf16_exponent(u))
                    v = _math.bf16_to_f32(u) * scale
                    if has_mask:
                        v = v + mask[mr, j]
                    v = v if j < n else _NEG_INF
                    best = _math.umax32(best, _math.order_key(v))
                    w = _math.exp_f32(v)
                    w = w if v > _EXP_MIN else _Z
                    e[j] = w
                    total += w
            else:
                for j in range(Sk):
                    u = s[r, j]
                    expo = _math.umax32(expo, _math.bf16_exponent(u))
                    v = _math.bf16_to_f32(u) * scale
                    if has_mask:
                        v = v + mask[mr, j]
                    best = _math.umax32(best, _math.order_key(v))
                    w = _math.exp_f32(v)
                    w = w if v > _EXP_MIN else _Z
                    e[j] = w
                    total += w
            mx = _math.from_order_key(best)
            if expo == _EXPO or not mx < _INF:  # a NaN / ±inf score (an overflowed scale·s)
                bad[r] = 1
                continue
            if mx == _NEG_INF:  # fully masked row: 0, as ATen SDPA
                p[r, :] = 0
                continue
            if not (mx <= _NO_SHIFT_MAX and total >= _NO_SHIFT_SUM):
                total = _row_exp(s, r, mask, mr, has_mask, n, scale, mx, e)  # exp(x − max x)
            inv = _ONE / total
            for j in range(Sk):
                p[r, j] = _math.f32_to_bf16(e[j] * inv)


@njit(error_model="numpy", cache=True, parallel=True)
def _pack_heads(q, k, v, qs, kp, vp):
    # q [B, H, Sq, D/2], k [B, H, Sk, D/2]: uint32 bf16 pairs along D, any strides; v
    # [B, H, Sk, Dv] uint16 bf16 bits (unit inner stride) -> the tiles' layouts, in place:
    # qs [B·H, Sqp, D/2] (q's rows), kp [B·H, D/2, Skp] (k transposed), vp [B·H, Skp/2, Dv]
    # (v in pairs along the keys), all uint32; their padding (rows Sq…Sqp, keys Sk…Skp) is
    # never written (the caller's buffers hold zeros there). Walked row by row, every head of
    # a row together: q, k, v as a GEMM leaves them ([B, S, H·D] behind the views) stream in
    # order (head by head, each row's slice starts a new page: the prefetchers lose it).
    # Read and write (Sq·D + Sk·D + Sk·Dv)·2 bytes per (b, h).
    nb, nh, sq, dpairs = q.shape
    sk, dv = k.shape[2], v.shape[3]
    for bi in prange(nb):
        for i in range(sq):
            for h in range(nh):
                for t in range(dpairs):
                    qs[bi * nh + h, i, t] = q[bi, h, i, t]
        for j in range(sk):
            for h in range(nh):
                for t in range(dpairs):
                    kp[bi * nh + h, t, j] = k[bi, h, j, t]
        for t in range(sk // 2):
            for h in range(nh):
                for c in range(dv):
                    vp[bi * nh + h, t, c] = np.uint32(v[bi, h, 2 * t, c]) | (np.uint32(v[bi, h, 2 * t + 1, c]) << 16)
        if sk % 2:
            for h in range(nh):
                for c in range(dv):
                    vp[bi * nh + h, sk // 2, c] = v[bi, h, sk - 1, c]


@njit(error_model="numpy", cache=True, parallel=True)
def _pack_heads_f32(q, k, v, qs, kp, vp):
    # _pack_heads on float32 q [B, H, Sq, D], k [B, H, Sk, D], v [B, H, Sk, Dv] (any strides:
    # the views of a QKV GEMM's output), each value rounded to bf16 (nearest even, NaN
    # stays NaN: _bf16dot.to_bf16) as it is packed, so no bf16 copy of q, k, v is made
    # first (three strided converting copies cost more than this whole pass: 0.45–1.5 vs
    # 0.35 ms at 8×12×128×32, Zen 4). Read (Sq·D + Sk·D + Sk·Dv)·4, write ·2 bytes per (b, h).
    nb, nh, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    dpairs = d // 2
    for bi in prange(nb):
        for i in range(sq):
            for h in range(nh):
                for t in range(dpairs):
                    qs[bi * nh + h, i, t] = (np.uint32(_bf16dot.to_bf16(q[bi, h, i, 2 * t]))
                                             | (np.uint32(_bf16dot.to_bf16(q[bi, h, i, 2 * t + 1])) << 16))
        for j in range(sk):
            for h in range(nh):
                for t in range(dpairs):
                    kp[bi * nh + h, t, j] = (np.uint32(_bf16dot.to_bf16(k[bi, h, j, 2 * t]))
                                             | (np.uint32(_bf16dot.to_bf16(k[bi, h, j, 2 * t + 1])) << 16))
        for t in range(sk // 2):
            for h in range(nh):
                for c in range(dv):
                    vp[bi * nh + h, t, c] = (np.uint32(_bf16dot.to_bf16(v[bi, h, 2 * t, c]))
                                             | (np.uint32(_bf16dot.to_bf16(v[bi, h, 2 * t + 1, c])) << 16))
        if sk % 2:
            for h in range(nh):
                for c in range(dv):
                    vp[bi * nh + h, sk // 2, c] = np.uint32(_bf16dot.to_bf16(v[bi, h, sk - 1, c]))


@njit(fastmath=_math._REDUCE, error_model="numpy", cache=True, parallel=True)
def _tiled_heads(qs, kp, vp, out, mask, mrow, has_mask, causal, scale, sq, sk, bad):
    # qs [B·H, Sqp, D/2], kp [B·H, D/2, Skp], vp [B·H, Skp/2, Dv] uint32 (_pack_heads: bf16
    # pairs; rows Sq…Sqp and keys Sk…Skp zero); out: [B·H, Sq, Dv] float32 or uint16 (bf16
    # bits) out; mask [Rm, Sk] f32 additive, row r = hh·Sq + i uses mask[mrow[r]]; causal: Sq
    # (key j ≤ query i) or 0; bad: [B·H·Sq] uint8 out, 1 where a row's raw scores hold NaN /
    # ±inf. Per head, ROWS query rows at a time: S = q·kᵀ in float32 (qk_tile) → P =
    # exp(x − max) in bf16 and 1/Σ (x = scale·S + mask) → O = P·v / Σ (pv_tile). A head's
    # packed q, k, v (8 KB each at 128 × 32) and a tile's scores (ROWS × Skp float32, 4 KB)
    # stay in L1/L2: read q, k, v once, write out.
    dpairs, skp, dv = kp.shape[1], kp.shape[2], vp.shape[2]
    rows = _bf16dot.ROWS
    scale2 = scale * _LOG2E
    for hh in prange(kp.shape[0]):
        qh, kh, vh, oh = qs[hh], kp[hh], vp[hh], out[hh]
        s = np.empty((rows, skp), np.float32)
        p = np.zeros((rows, skp), np.uint16)
        inv = np.zeros(rows, np.float32)
        ot = np.empty((rows, dv), out.dtype)
        for r0 in range(0, sq, rows):
            nr = min(rows, sq - r0)
            _bf16dot.qk_tile(qh, r0, kh, s, dpairs, skp)
            last = sk if not causal else min(sk, r0 + nr)  # keys any row of the tile keeps
            npk = (last + 1) // 2
            for i in range(nr):
                r = hh * sq + r0 + i
                n = sk if not causal else min(sk, r0 + i + 1)
                mr = mrow[r]
                best = np.uint32(0)
                expo = np.uint32(0)
                for j in range(n):  # x = (scale·S + mask)·log2 e; the max as an integer max of order keys
                    x = s[i, j]
                    expo = _math.umax32(expo, _math.f32_bits(x) & _F32_EXPO)
                    x = x * scale2
                    if has_mask:
                        x = x + mask[mr, j] * _LOG2E
                    s[i, j] = x
                    best = _math.umax32(best, _math.order_key(x))
                mx = _math.from_order_key(best)
                bad[r] = 0
                total = _Z
                if expo == _F32_EXPO or not mx < _INF:  # a NaN / ±inf raw score: the caller re-runs
                    bad[r] = 1
                elif mx > _NEG_INF:  # else fully masked: P = 0, out 0 (as ATen SDPA)
                    for j in range(n):  # P = 2^(x − max) = e^(scale·S + mask − max), rounded to bf16
                        e = s[i, j] - mx
                        w = _math.exp2_lo(e)
                        w = w if e > _EXP2_MIN else _Z
                        total += w
                        p[i, j] = _bf16dot.to_bf16(w)
                for j in range(n if total > _Z else 0, 2 * npk):
                    p[i, j] = 0
                inv[i] = _ONE / total if total > _Z else _Z
            for c0 in range(0, dv, _bf16dot.COLS):
                if nr == rows:
                    _bf16dot.pv_tile(p, vh, oh, r0, c0, inv, npk)
                else:
                    _bf16dot.pv_tile(p, vh, ot, 0, c0, inv, npk)
            if nr < rows:
                oh[r0:r0 + nr] = ot[:nr]


def tiles_supported(d: int, dv: int) -> bool:
    """Whether :func:`attention_bf16`'s ``tiles=True`` form runs for head sizes D, Dv here:
    avx512_bf16 (:data:`opfuse.kernels.cpu._bf16dot.AVAILABLE`), D even, Dv a multiple of
    :data:`~opfuse.kernels.cpu._bf16dot.COLS` (32)."""
    return _bf16dot.AVAILABLE and d % 2 == 0 and dv % _bf16dot.COLS == 0


def _operand(t: torch.Tensor) -> np.ndarray:
    """q / k / v as the tiled kernel reads it: bf16 (a converting copy unless it already is,
    one copy if its inner stride is not 1), as numpy uint16 bits, in place otherwise."""
    t = t.detach()
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16, memory_format=torch.contiguous_format)
    if t.stride(-1) != 1 or t.storage_offset() % 2 or any(st % 2 for st in t.stride()[:-1]):
        t = t.contiguous()
    return _bits(t)


def _tiled(q, k, v, maskf, mrow, has_mask, causal: int, scale: float, ws: dict) -> torch.Tensor | None:
    """The ``tiles=True`` form on q [B,H,Sq,D], k [B,H,Sk,D], v [B,H,Sk,Dv] (D even) ->
    [B,H,Sq,Dv] (bf16 where q is bf16, else float32), or None where a raw score is NaN / ±inf
    (the caller then runs the float32 kernel). q and k are read as 32-bit bf16 pairs along D
    (their strides even, so every pair is 4-byte aligned); the packed layouts live in the
    workspace ``ws`` (zeros where nothing is packed)."""
    b, h, sq, d = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    if "qs" not in ws:
        rows, cols = _bf16dot.ROWS, _bf16dot.COLS
        sqp, skp = -(-sq // rows) * rows, -(-sk // cols) * cols
        ws["qs"] = np.zeros((b * h, sqp, d // 2), np.uint32)
        ws["kp"] = np.zeros((b * h, d // 2, skp), np.uint32)
        ws["vp"] = np.zeros((b * h, skp // 2, dv), np.uint32)
    work = b * h * sq * sk
    if all(t.dtype == torch.float32 for t in (q, k, v)):  # rounded to bf16 as they are packed
        launch(_pack_heads_f32, work)(*(t.detach().numpy() for t in (q, k, v)), ws["qs"], ws["kp"], ws["vp"])
    else:
        qb, kb, vb = (_operand(t) for t in (q, k, v))
        launch(_pack_heads, work)(qb.view(np.uint32), kb.view(np.uint32), vb, ws["qs"], ws["kp"], ws["vp"])
    out = torch.empty((b * h, sq, dv), dtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)
    o = _bits(out) if out.dtype == torch.bfloat16 else out.numpy()
    bad = ws["bad"]
    launch(_tiled_heads, work)(ws["qs"], ws["kp"], ws["vp"], o, maskf, mrow, has_mask, causal, np.float32(scale),
                               sq, sk, bad)
    if bad.any():
        return None
    return out.view(b, h, sq, dv)


_CHUNK_BYTES = 1 << 20  # one chunk's bf16 scores: ~L2 (1 MB a core on Zen 4/5); measured 4.0 vs 5.0 ms a call
                        # at 8×12×128×32 against the whole score tensor at once (7.7 vs 8.3 at 1×12×512×64)
LANDMARKS = 16  # keys sampled for the row shift of ``sample=True`` (evenly spaced, the first included)
_WORKSPACES = 4  # shapes kept per thread (a dynamic plan meets many; each holds ~3 score buffers)
_local = threading.local()


def _landmark_step(sk: int) -> int:
    """Every how many keys one is a landmark of the sampled shift (:data:`LANDMARKS` of them)."""
    return max(1, -(-sk // LANDMARKS))


def _heads_per_chunk(sq: int, sk: int) -> int:
    """Heads per chunk: the chunk's bf16 scores fill ~:data:`_CHUNK_BYTES`."""
    return max(1, _CHUNK_BYTES // (2 * sq * sk))


def _workspace(bh: int, sq: int, sk: int, d: int, dv: int) -> dict[str, torch.Tensor]:
    """This thread's scratch buffers for one shape (bf16 q, k, v; one chunk's scores, which
    become its probabilities in place; its row shifts), reused across calls, least recently
    used dropped beyond :data:`_WORKSPACES` shapes. Allocating them per call made glibc
    return the freed top of the heap to the OS and fault it back in: 1 388 page faults and
    3.3 ms of system time per call at 8×12×128×32 (10.6 ms a call against 4.5 with the
    buffers kept; Zen 5 VM, one thread). Per thread, so concurrent callers never share one.
    Nothing here escapes a call: the output is a fresh tensor."""
    cache = getattr(_local, "ws", None)
    if cache is None:
        cache = _local.ws = OrderedDict()
    key = (bh, sq, sk, d, dv)
    ws = cache.get(key)
    if ws is None:
        bf = torch.bfloat16
        g = min(bh, _heads_per_chunk(sq, sk))
        nl = -(-sk // _landmark_step(sk))
        ws = cache[key] = {"q": torch.empty((bh, sq, d), dtype=bf), "k": torch.empty((bh, sk, d), dtype=bf),
                           "v": torch.empty((bh, sk, dv), dtype=bf), "s": torch.empty((g, sq, sk), dtype=bf),
                           # the shifted forms' augmented q [q | −m | 0] and k [k | 1 | 0] (K = D + 2: even,
                           # for the bf16 pairs), and the landmark keys [k_l | 0 | 0]
                           "qa": torch.zeros((bh, sq, d + 2), dtype=bf), "ka": torch.zeros((bh, sk, d + 2), dtype=bf),
                           "kl": torch.zeros((bh, nl, d + 2), dtype=bf), "l": torch.empty((g, sq, nl), dtype=bf)}
        ws["ka"][..., d] = 1.0
        ws["sbits"] = _bits(ws["s"]).reshape(-1, sk)  # numpy views and flags made once (a call's Python
        ws["bad"] = np.empty(bh * sq, np.uint8)        # costs ~10x its timed-alone cost between GEMMs)
        while len(cache) > _WORKSPACES:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return ws


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _mask_rows(mask: torch.Tensor | None, b: int, h: int, sq: int, sk: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(additive float32 mask rows [Rm, Sk], row index [B·H·Sq] int64 into them, has_mask),
    the index built in numpy (a dozen small torch ops cost ~0.2 ms a call here). A NaN or
    +inf entry is not looked for here: :func:`attention_bf16` looks once per call and runs
    the float32 kernel, which gives eager's NaNs."""
    rows = b * h * sq
    if mask is None:
        return np.zeros((1, sk), np.float32), np.zeros(rows, np.int64), False
    m = mask.detach()
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, float("-inf"))
    elif m.dtype != torch.float32:
        m = m.float()
    while m.dim() < 4:
        m = m.unsqueeze(0)
    mb, mh, mq = m.shape[:3]
    m = m.expand(mb, mh, mq, sk).contiguous().view(mb * mh * mq, sk)
    ib = np.arange(b).reshape(b, 1, 1) if mb > 1 else 0
    ih = np.arange(h).reshape(1, h, 1) if mh > 1 else 0
    iq = np.arange(sq).reshape(1, 1, sq) if mq > 1 else 0
    idx = np.broadcast_to((ib * mh + ih) * mq + iq, (b, h, sq)).reshape(rows).astype(np.int64)
    return m.numpy(), idx, True


def _mask_memo(mask: torch.Tensor | None, b: int, h: int, sq: int, sk: int) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    """:func:`_mask_rows` and whether every mask entry is below +inf (no NaN / +inf), kept
    for the last mask tensor seen on this thread: a plan passes one mask to every layer, and
    in a forward, between GEMMs that evict the caches, building the rows and checking them
    cost ~0.2 ms a layer (BERT-base 1×128, Zen 4, one thread; ~20 µs when timed alone). Reused
    only while that same tensor object is alive (a weak reference: a new tensor at the freed
    address is another object) and its version counter, data pointer, shape, strides and
    dtype are unchanged (an in-place write bumps the version), for the same B, H, Sq, Sk; an
    inference tensor (no version counter) is never kept."""
    if mask is None or mask.is_inference():  # an inference tensor has no version counter: not kept
        maskf, mrow, has_mask = _mask_rows(mask, b, h, sq, sk)
        return maskf, mrow, has_mask, not has_mask or bool((maskf < _INF).all())
    key = (mask._version, mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.dtype, b, h, sq, sk)
    memo = getattr(_local, "mask", None)
    if memo is not None and memo[0]() is mask and memo[1] == key:
        return memo[2]
    maskf, mrow, has_mask = _mask_rows(mask, b, h, sq, sk)
    value = (maskf, mrow, has_mask, bool((maskf < _INF).all()))
    _local.mask = (weakref.ref(mask), key, value)
    return value


def _aten_sdpa_bf16(q, k, v, mask, scale: float, is_causal: bool) -> torch.Tensor:
    # q [B,H,Sq,D], k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv] -> bf16 [B,H,Sq,Dv]; an additive mask
    # stays float32 (added to the float32 scores), a bool mask as it is
    bf = torch.bfloat16
    qb, kb, vb = (t.detach() if t.dtype == bf else t.detach().to(bf) for t in (q, k, v))
    m = None if mask is None else mask.detach() if mask.dtype in (torch.bool, torch.float32) else mask.detach().float()
    return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=m, is_causal=is_causal, scale=scale,
                                                            enable_gqa=kb.shape[1] != qb.shape[1])


@cache
def aten_form_keeps_nonfinite() -> bool:
    """Whether ATen's SDPA on bf16 q, k, v (the ``aten=True`` form) gives this CPU's float32
    SDPA's NaN and ±inf positions on non-finite inputs (probed once per process on 1×4×8×16:
    a NaN query element, a +inf and a −inf key element, a NaN mask element). On the AVX2-only
    Zen 2 machines (torch 2.13) the bf16 flash kernel returned finite rows where float32 gives
    NaN for a +inf key, so there the precision pass never chooses the ATen form."""
    f = torch.nn.functional.scaled_dot_product_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 16, generator=g) for _ in range(3))
    for where, value in (("q", float("nan")), ("k", float("inf")), ("k", float("-inf")), ("mask", float("nan"))):
        qq, kk, mask = q.clone(), k.clone(), torch.zeros(1, 1, 8, 8)
        {"q": qq, "k": kk, "mask": mask}[where].view(-1)[5] = value
        ref = f(qq, kk, v, attn_mask=mask, scale=0.25)
        out = _aten_sdpa_bf16(qq, kk, v, mask, 0.25, False).float()
        if not (torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())):
            return False
    return True


@register("attention_bf16", "cpu")
def attention_bf16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    shift: bool = True,
    aten: bool = False,
    sample: bool = False,
    tiles: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention with bf16 GEMMs (module docstring); q [B,H,Sq,D],
    k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv] float32 (or bf16), mask None or broadcastable to
    [B,H,Sq,Sk] (bool, True = keep, or additive float) -> [B,H,Sq,Dv] in q's dtype.
    ``shift=False`` rounds the raw scores q·kᵀ (one GEMM fewer, no row-max pass; error
    |s|·2⁻⁹ per score instead of |s − max|·2⁻⁹): the precision pass picks it per layer
    where its measured error is within budget. ``aten=True``: ATen's SDPA on bf16 q, k, v
    (module docstring; ``shift`` unused). ``tiles=True``: one kernel per head with float32
    scores kept in L1 (module docstring; ``shift`` and ``sample`` unused), where
    :func:`tiles_supported` (else as ``tiles=False``). Raises ValueError (named) as
    :func:`opfuse.kernels.cpu.attention.attention`."""
    b, h, hkv, sq, sk, d, dv = check_attention(q, k, v, device_type="cpu")
    if mask is not None:
        check_attention_mask(mask, q, (b, h, sq, sk), is_causal, device_type="cpu")
    if aten:
        return _aten_sdpa_bf16(q, k, v, mask, scale, is_causal).to(q.dtype)
    if hkv != h or (is_causal and sq != sk) or not (b * h * sq * sk):
        return attention_f32(q, k, v, mask, scale, is_causal)
    maskf, mrow, has_mask, finite = _mask_memo(mask, b, h, sq, sk)
    if has_mask and not finite:  # a NaN / +inf mask entry: eager's NaNs from the float32 kernel
        return attention_f32(q, k, v, mask, scale, is_causal)
    ws = _workspace(b * h, sq, sk, d, dv)
    causal = sq if is_causal else 0
    if tiles and tiles_supported(d, dv):
        out = _tiled(q, k, v, maskf, mrow, has_mask, causal, scale, ws)
        return attention_f32(q, k, v, mask, scale, is_causal) if out is None else out.to(q.dtype)
    buf = ws["s"]
    g = buf.shape[0]
    if shift:  # q·kᵀ − m as one GEMM over K = D + 2: [q | −m | 0]·[k | 1 | 0]ᵀ, the shift in the f32 accumulator
        qa, ka = ws["qa"], ws["ka"]
        qa.view(b, h, sq, d + 2)[..., :d].copy_(q.detach())
        ka.view(b, h, sk, d + 2)[..., :d].copy_(k.detach())
        qs, ks = qa, ka.transpose(1, 2)
        mbits = _bits(qa).reshape(b * h * sq, d + 2)[:, d]  # the shift column, written by the row max
        if sample:
            step = _landmark_step(sk)
            kl = ws["kl"]
            kl[..., :d].copy_(ka[:, ::step, :d])
            kl = kl.transpose(1, 2)
            lbits = _bits(ws["l"]).reshape(g * sq, -1)
            landmark_max = launch(_landmark_max, g * sq * kl.shape[-1])
            keep = maskf[:, ::step] > _KEEP if has_mask else np.ones((1, kl.shape[-1]), np.bool_)
            ml = np.where(keep, np.float32(0), _NEG_INF).astype(np.float32)
        else:
            row_max = launch(_row_max, g * sq * sk)
    else:
        qs = ws["q"]
        qs.view(b, h, sq, d).copy_(q.detach())
        ks = ws["k"]
        ks.view(b, h, sk, d).copy_(k.detach())
        ks = ks.transpose(1, 2)
    vb = ws["v"]
    vb.view(b, h, sk, dv).copy_(v.detach())
    out = torch.empty((b * h, sq, dv), dtype=torch.bfloat16)
    bad, sbits = ws["bad"], ws["sbits"]
    softmax = launch(_softmax_rows, g * sq * sk)
    for i in range(0, b * h, g):  # a chunk of heads at a time: its scores stay in L2 (module docstring)
        j = min(b * h, i + g)
        n, rows_ij = j - i, slice(i * sq, j * sq)
        s = buf[:n]
        if shift and sample:  # m from the landmark keys' scores: one small GEMM
            torch.bmm(qs[i:j], kl[i:j], out=ws["l"][:n])
            landmark_max(lbits[: n * sq], ml, mrow[rows_ij], causal, step, mbits[rows_ij])
        elif shift:  # m from S₁ = q·kᵀ (the shift column zero first)
            qa[i:j, :, d] = 0
            torch.bmm(qs[i:j], ks[i:j], out=s)
            row_max(sbits[: n * sq], maskf, mrow[rows_ij], has_mask, causal, mbits[rows_ij])
        torch.bmm(qs[i:j], ks[i:j], out=s)  # S [n, Sq, Sk] bf16: shifted, or the raw scores rounded
        softmax(sbits[: n * sq], maskf, mrow[rows_ij], has_mask, causal, np.float32(scale), sbits[: n * sq],
                bad[rows_ij])  # P in place of S: a row is read whole before it is written
        if bad[rows_ij].any():
            return attention_f32(q, k, v, mask, scale, is_causal)
        torch.bmm(s, vb[i:j], out=out[i:j])
    return out.view(b, h, sq, dv).to(q.dtype)
