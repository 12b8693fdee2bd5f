"""Shared numba helpers for the CPU kernels: float32 GELU / exp / silu math and LayerNorm row passes.

Everything here works on float32 scalars / float32 1-D rows and must stay float32:
Python float literals are float64 in numba and would silently promote a loop, so every
constant is a module-level ``np.float32`` (numba freezes globals as typed constants).

Fast-math policy (see shared/design/KERNELS.md):
  * ``_REDUCE`` = ``reassoc`` (+ ``nsz``, ``contract``), only on loops that *sum*
    (reassociation lets LLVM keep 8-wide partial sums in vector registers).
  * ``_APPLY`` = ``nsz`` + ``contract`` only: elementwise loops vectorise without more,
    and reassociation would fold ``(x - shift) - mean`` into ``x - (shift + mean)``,
    undoing the exact shift of the LayerNorm statistics. Without ``arcp``: p / q stays a
    true division.
  * Never ``nnan`` / ``ninf`` / ``afn``: they let LLVM assume no NaN/Inf and approximate
    1/sqrt, and then NaN/±inf inputs and overflowing statistics gave other NaN positions
    than eager (a whole NaN row where eager is finite). Every kernel's NaN/Inf positions
    must equal eager's (tests/cpu/test_properties.py draws non-finite and huge values).
Flags are per instruction, so they survive LLVM inlining one helper into another.

erf:  rational minimax approximation p(x)/q(x), x clamped to [-4, 4] (erf(4) = 1 - 1.5e-8
      rounds to 1 in float32); max abs error ~3e-7. Coefficients from Eigen
      ``generic_fast_erf_float`` (also XLA ``EmitErfF32`` / TVM ``fast_erf``).
tanh: 13/6-degree rational interpolant, x clamped to [-7.905, 7.905] (beyond that tanh
      rounds to +-1); a few ulp. Coefficients from Eigen ``generic_fast_tanh_float``
      (also ONNX Runtime MLAS ``tanh.cpp``). No exp, no libm call: both vectorise to
      vfmadd/vdivps on AVX2 without SVML.
exp:  Cephes ``expf`` (x = n ln2 + r, |r| <= ln2/2, degree-5 polynomial, ln2 split in two
      for an exact reduction), 2^n built in the exponent bits (``f32_from_bits``); x
      clamped to [-87, 88] so 2^n stays normal; max relative error ~1e-7 (measured
      8.3e-8 vs float64). Vectorises (8 lanes); ``math.exp`` is a scalar libm call, 4x
      slower in the SwiGLU epilogue. silu(z) = z / (1 + exp(-z)) on top of it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_REDUCE = {"reassoc", "nsz", "contract"}
_APPLY = {"nsz", "contract"}  # no reassoc; no arcp: vdivps beats rcp+Newton here
_JIT = dict(error_model="numpy", cache=True)

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_INF = np.float32(np.inf)
_HALF = np.float32(0.5)

# erf(x) ~= x * P(x^2) / Q(x^2) on [-4, 4]  (Eigen generic_fast_erf_float)
_ERF_CLAMP = np.float32(4.0)
_ERF_A1 = np.float32(-1.60960333262415e-02)
_ERF_A3 = np.float32(-2.95459980854025e-03)
_ERF_A5 = np.float32(-7.34990630326855e-04)
_ERF_A7 = np.float32(-5.69250639462346e-05)
_ERF_A9 = np.float32(-2.10102402082508e-06)
_ERF_A11 = np.float32(2.77068142495902e-08)
_ERF_A13 = np.float32(-2.72614225801306e-10)
_ERF_B0 = np.float32(-1.42647390514189e-02)
_ERF_B2 = np.float32(-7.37332916720468e-03)
_ERF_B4 = np.float32(-1.68282697438203e-03)
_ERF_B6 = np.float32(-2.13374055278905e-04)
_ERF_B8 = np.float32(-1.45660718464996e-05)

# tanh(x) ~= x * P(x^2) / Q(x^2) on [-7.905, 7.905]  (Eigen generic_fast_tanh_float)
_TANH_CLAMP = np.float32(7.90531110763549805)
_TANH_A1 = np.float32(4.89352455891786e-03)
_TANH_A3 = np.float32(6.37261928875436e-04)
_TANH_A5 = np.float32(1.48572235717979e-05)
_TANH_A7 = np.float32(5.12229709037114e-08)
_TANH_A9 = np.float32(-8.60467152213735e-11)
_TANH_A11 = np.float32(2.00018790482477e-13)
_TANH_A13 = np.float32(-2.76076847742355e-16)
_TANH_B0 = np.float32(4.89352518554385e-03)
_TANH_B2 = np.float32(2.26843463243900e-03)
_TANH_B4 = np.float32(1.18534705686654e-04)
_TANH_B6 = np.float32(1.19825839466702e-06)

_INV_SQRT2 = np.float32(0.7071067811865476)  # erf-GELU:  0.5 x (1 + erf(x / sqrt 2))
_SQRT_2_OVER_PI = np.float32(0.7978845608028654)  # tanh-GELU: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
_GELU_CUBIC = np.float32(0.044715)


@njit(fastmath=_APPLY, **_JIT)
def erf_f32(x):
    """erf(x) for a float32 scalar, |error| <= ~3e-7 (rational minimax, see module doc)."""
    x = min(max(x, -_ERF_CLAMP), _ERF_CLAMP)
    x2 = x * x
    p = x2 * _ERF_A13 + _ERF_A11
    p = x2 * p + _ERF_A9
    p = x2 * p + _ERF_A7
    p = x2 * p + _ERF_A5
    p = x2 * p + _ERF_A3
    p = x2 * p + _ERF_A1
    q = x2 * _ERF_B8 + _ERF_B6
    q = x2 * q + _ERF_B4
    q = x2 * q + _ERF_B2
    q = x2 * q + _ERF_B0
    return x * p / q


@njit(fastmath=_APPLY, **_JIT)
def tanh_f32(x):
    """tanh(x) for a float32 scalar, a few ulp (rational interpolant, see module doc);
    exactly ±1 beyond the clamp, as float32 tanh is (so tanh-GELU(-inf) = -inf * 0 = NaN,
    as eager's, not -inf)."""
    if abs(x) >= _TANH_CLAMP:
        return np.copysign(_F1, x)
    x2 = x * x
    p = x2 * _TANH_A13 + _TANH_A11
    p = x2 * p + _TANH_A9
    p = x2 * p + _TANH_A7
    p = x2 * p + _TANH_A5
    p = x2 * p + _TANH_A3
    p = x2 * p + _TANH_A1
    q = x2 * _TANH_B6 + _TANH_B4
    q = x2 * q + _TANH_B2
    q = x2 * q + _TANH_B0
    return x * p / q


@njit(fastmath=_APPLY, **_JIT)
def gelu_erf_f32(x):
    """Exact-form GELU (approximate="none"): 0.5 x (1 + erf(x / sqrt 2))."""
    return _HALF * x * (_F1 + erf_f32(x * _INV_SQRT2))


@njit(fastmath=_APPLY, **_JIT)
def gelu_tanh_f32(x):
    """Tanh-form GELU (approximate="tanh"); a different function from gelu_erf_f32."""
    return _HALF * x * (_F1 + tanh_f32(_SQRT_2_OVER_PI * (x + _GELU_CUBIC * x * x * x)))


# --- float32 bit casts, exp, silu ------------------------------------------------------


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE-754 bits of a float32 scalar as uint32 (an LLVM bitcast: free, vectorises)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def f32_from_bits(typingctx, u):
    """The float32 whose bits are the low 32 bits of integer ``u`` (numba widens uint32
    arithmetic to 64 bits; the truncation undoes that)."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif v.type.width < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen


# 32-bit integer helpers. numba widens uint32 / int32 arithmetic to 64 bits, so a loop of
# bit tricks ran on 8 lanes of 64 bits (vpmaxuq, vpmovzxwq) instead of 16 of 32; these emit
# 32-bit IR and keep a vectorised loop at 16 lanes (AVX-512).

_I32 = ir.IntType(32)


def _u32(builder, v):
    return builder.trunc(v, _I32) if v.type.width > 32 else builder.zext(v, _I32) if v.type.width < 32 else v


@intrinsic
def pow2_f32(typingctx, n):
    """2ⁿ for an integral float32 ``n`` in [-126, 127] (the exponent field built in 32 bits)."""
    if n != types.float32:
        return None

    def codegen(context, builder, signature, args):
        e = builder.add(builder.fptosi(args[0], _I32), ir.Constant(_I32, 127))
        return builder.bitcast(builder.shl(e, ir.Constant(_I32, 23)), ir.FloatType())

    return types.float32(n), codegen


@intrinsic
def bf16_to_f32(typingctx, u):
    """The float32 value of bf16 bits ``u`` (an integer; its low 16 bits): exact."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = builder.and_(_u32(builder, args[0]), ir.Constant(_I32, 0xFFFF))
        return builder.bitcast(builder.shl(v, ir.Constant(_I32, 16)), ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def f32_to_bf16(typingctx, x):
    """bf16 bits (uint16) of float32 ``x``, rounded to nearest even; for finite ``x`` (a NaN
    may come out as ±inf: callers keep NaN away)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        u = builder.bitcast(args[0], _I32)
        odd = builder.and_(builder.lshr(u, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
        r = builder.add(builder.add(u, ir.Constant(_I32, 0x7FFF)), odd)
        return builder.trunc(builder.lshr(r, ir.Constant(_I32, 16)), ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def order_key(typingctx, x):
    """A uint32 whose unsigned order is float32 ``x``'s order (−0 just below +0; NaN above
    +inf when positive): bits ^ 0x80000000 for x ≥ 0, ~bits below; branchless. An integer
    max of keys vectorises where a float max reduction needs fast-math."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        u = builder.bitcast(args[0], _I32)
        flip = builder.or_(builder.ashr(u, ir.Constant(_I32, 31)), ir.Constant(_I32, 0x80000000))
        return builder.xor(u, flip)

    return types.uint32(x), codegen


@intrinsic
def from_order_key(typingctx, k):
    """The float32 of an :func:`order_key` (its inverse)."""
    if not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        u = _u32(builder, args[0])
        neg = builder.icmp_unsigned("<", u, ir.Constant(_I32, 0x80000000))
        flip = builder.select(neg, ir.Constant(_I32, 0xFFFFFFFF), ir.Constant(_I32, 0x80000000))
        return builder.bitcast(builder.xor(u, flip), ir.FloatType())

    return types.float32(k), codegen


@intrinsic
def umax32(typingctx, a, b):
    """max of two unsigned 32-bit integers, in 32 bits (vpmaxud)."""
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        x, y = _u32(builder, args[0]), _u32(builder, args[1])
        return builder.select(builder.icmp_unsigned(">", x, y), x, y)

    return types.uint32(a, b), codegen


@intrinsic
def bf16_exponent(typingctx, u):
    """The exponent field of bf16 bits ``u`` (u & 0x7F80, as uint32): 0x7F80 for ±inf / NaN."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.and_(_u32(builder, args[0]), ir.Constant(_I32, 0x7F80))

    return types.uint32(u), codegen


# exp(x) = 2^n * e^r, n = round(x log2 e), r = x - n ln2  (Cephes expf)
_EXP_LO = np.float32(-87.0)
_EXP_HI = np.float32(88.0)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # exact in 9 bits: n * _LN2_HI is exact for |n| <= 2^15
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_P0 = np.float32(1.9875691500e-4)
_EXP_P1 = np.float32(1.3981999507e-3)
_EXP_P2 = np.float32(8.3334519073e-3)
_EXP_P3 = np.float32(4.1665795894e-2)
_EXP_P4 = np.float32(1.6666665459e-1)
_EXP_P5 = np.float32(5.0000001201e-1)


@njit(fastmath=_APPLY, **_JIT)
def exp_f32(x):
    """e^x for a float32 scalar, relative error ~1e-7; x clamped to [-87, 88]."""
    x = min(max(x, _EXP_LO), _EXP_HI)
    n = np.floor(x * _LOG2E + _HALF)
    r = x - n * _LN2_HI - n * _LN2_LO
    p = _EXP_P0 * r + _EXP_P1
    p = p * r + _EXP_P2
    p = p * r + _EXP_P3
    p = p * r + _EXP_P4
    p = p * r + _EXP_P5
    y = p * (r * r) + r + _F1
    return y * pow2_f32(n)  # y * 2^n


# 2^f on [-1/2, 1/2], degree 4: near-minimax in relative error (Lawson-weighted least
# squares on Chebyshev nodes, fitted for opfuse), max relative error 2.7e-6 in float32
_EXP2_C0 = np.float32(0.9999992847442627)
_EXP2_C1 = np.float32(0.6931217908859253)
_EXP2_C2 = np.float32(0.240247443318367)
_EXP2_C3 = np.float32(0.05591786280274391)
_EXP2_C4 = np.float32(0.009570101276040077)


@njit(fastmath=_APPLY, **_JIT)
def exp2_lo(x):
    """2^x for a float32 scalar x in [-125, 127], relative error 2.7e-6: enough for a value
    rounded to bf16 next (2⁻⁹ = 2e-3), and 4 FMAs against exp_f32's 7 (x = n + f, n =
    round(x), 2^f by the degree-4 polynomial above, 2^n in the exponent bits). Below -125 the
    caller must select 0 itself (2^n would leave the normal range)."""
    n = np.floor(x + _HALF)
    f = x - n
    p = _EXP2_C4 * f + _EXP2_C3
    p = p * f + _EXP2_C2
    p = p * f + _EXP2_C1
    p = p * f + _EXP2_C0
    return p * pow2_f32(n)


@njit(fastmath=_APPLY, **_JIT)
def silu_f32(z):
    """silu(z) = z * sigmoid(z) = z / (1 + e^-z); -> z for large z, -> -0 for very negative z,
    NaN at z = -inf (-inf / inf, as eager: e^-z is taken as inf beyond exp's clamp)."""
    e = exp_f32(-z) if z > -_EXP_HI else _INF
    return z / (_F1 + e)


@njit(fastmath=_APPLY, **_JIT)
def row_silu_mul(g, u, y):  # g, u: [H] f32 gate / up in; y: [H] f32 out; read 2H, write H
    for j in range(y.shape[0]):
        y[j] = silu_f32(g[j]) * u[j]


# --- LayerNorm row passes --------------------------------------------------------------
# Statistics are "shifted two-pass": y_j = v_j - v_0 is stored first (exact when v_j and
# v_0 are within a factor of 2, which is the mean-1e4 case that breaks naive float32),
# then mean and variance are two fastmath reductions over the stored y, then the apply
# pass normalises y. Storing y is what keeps reassociation from undoing the shift.


@njit(fastmath=_REDUCE, **_JIT)
def row_sum(y):  # y: [N] f32; read N
    acc = _F0
    for j in range(y.shape[0]):
        acc += y[j]
    return acc


@njit(fastmath=_REDUCE, **_JIT)
def row_sum_scaled(y, c):  # y: [N] f32; sum of (c * y_j); read N
    acc = _F0
    for j in range(y.shape[0]):
        acc += c * y[j]
    return acc


@njit(fastmath=_REDUCE, **_JIT)
def row_sq_dev(y, mean, c):  # y: [N] f32; sum of (c * (y_j - mean))^2; read N
    acc = _F0
    for j in range(y.shape[0]):
        d = c * (y[j] - mean)
        acc += d * d
    return acc


@njit(fastmath=_APPLY, **_JIT)
def row_max_abs_dev(y, mean):  # y: [N] f32; max |y_j - mean| (NaN-free rows only); read N
    m = _F0
    for j in range(y.shape[0]):
        m = max(m, abs(y[j] - mean))
    return m


@njit(**_JIT)
def row_mean(y):  # y: [N] f32 shifted row; read N (twice if the sum overflows)
    n = np.float32(y.shape[0])
    acc = row_sum(y)
    if abs(acc) == _INF:  # huge finite values: sum y_j / N instead (no overflow)
        return row_sum_scaled(y, _F1 / n)
    return acc / n


@njit(**_JIT)
def row_rstd(y, mean, eps):  # y: [N] f32 shifted row; read N (twice if the squares overflow)
    # 1 / sqrt(var + eps). A finite row with |y_j - mean| >= ~1.8e19 overflows the float32
    # squares: then the deviations are scaled by 1/m (m = max |y_j - mean|) before squaring,
    # var = m^2 * mean((d/m)^2), 1/sqrt(var + eps) = (1/m) / sqrt(mean((d/m)^2) + eps/m^2),
    # as eager's LayerNorm gives finite values there. No fast-math here: 1/sqrt(inf) is 0.
    n = np.float32(y.shape[0])
    acc = row_sq_dev(y, mean, _F1)
    if acc == _INF and abs(mean) < _INF:
        m = row_max_abs_dev(y, mean)
        if m < _INF:
            inv = _F1 / m
            return inv / np.sqrt(row_sq_dev(y, mean, inv) / n + eps * inv * inv)
    return _F1 / np.sqrt(acc / n + eps)


@njit(fastmath=_APPLY, **_JIT)
def row_shift(x, y):  # x: [N] f32 in, y: [N] f32 out; read N, write N
    c = x[0]
    for j in range(x.shape[0]):
        y[j] = x[j] - c


@njit(fastmath=_APPLY, **_JIT)
def row_normalize(y, mean, rstd, w, b):  # y: [N] f32 in place, w, b: [N]; read 3N, write N
    for j in range(y.shape[0]):
        y[j] = (y[j] - mean) * rstd * w[j] + b[j]


@njit(fastmath=_APPLY, **_JIT)
def row_normalize_gelu(y, mean, rstd, w, b, use_tanh):  # y: [N] f32 in place; read 3N, write N
    if use_tanh:
        for j in range(y.shape[0]):
            y[j] = gelu_tanh_f32((y[j] - mean) * rstd * w[j] + b[j])
    else:
        for j in range(y.shape[0]):
            y[j] = gelu_erf_f32((y[j] - mean) * rstd * w[j] + b[j])


@njit(fastmath=_APPLY, **_JIT)
def row_bias_gelu(y, b, use_tanh):  # y: [N] f32 in place, b: [N]; read 2N, write N
    if use_tanh:
        for j in range(y.shape[0]):
            y[j] = gelu_tanh_f32(y[j] + b[j])
    else:
        for j in range(y.shape[0]):
            y[j] = gelu_erf_f32(y[j] + b[j])


# --- tensors by address (the launchers' one-row fast path) ------------------------------


def _pointer_to(dtype):
    def typer(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(dtype)))

        return types.CPointer(dtype)(addr), codegen
    return typer


#: ``f32_at(t.data_ptr())``: a float32 pointer for ``numba.carray`` (the tensor's memory
#: as an array without torch's ``.numpy()``: ~0.2 µs against ~2.4 µs for detach + numpy).
f32_at = intrinsic(_pointer_to(types.float32))
#: The same for bf16 bits (a bfloat16 tensor's memory read as uint16).
u16_at = intrinsic(_pointer_to(types.uint16))
#: The same for a bool tensor's bytes (uint8, nonzero = True).
u8_at = intrinsic(_pointer_to(types.uint8))
#: The same for an int64 tensor (cache positions).
i64_at = intrinsic(_pointer_to(types.int64))
