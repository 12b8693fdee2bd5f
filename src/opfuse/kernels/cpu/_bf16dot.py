"""bf16 dot-product tiles for numba kernels: AVX512-BF16 ``vdpbf16ps`` through LLVM intrinsics.

numba has no vector or bf16 types, so these are numba ``@intrinsic``\\ s that emit the LLVM
IR of a whole register tile: ``llvm.x86.avx512bf16.dpbf16ps.512(acc <16 x float>, a <32 x
bfloat>, b <32 x bfloat>)`` adds, per float32 lane l, a[2l]·b[2l] + a[2l+1]·b[2l+1] to
acc[l] (Intel SDM, VDPBF16PS: products exact, float32 accumulation). With ``a`` one pair of
bf16 values broadcast to every lane and ``b`` 16 pairs (one per output column), one
instruction advances 16 dot products by two terms: the reduction dimension is stored in
pairs ("VNNI" layout), ``[K/2, N, 2]``.

    qk_tile:  S[r, j] = Σ_d q[r0 + r, d] · k[j, d]          R = ROWS rows × 32 keys a step,
              q [M, D] bf16 (row-major, any row stride), kp = k packed [D/2, N, 2], S f32
    pv_tile:  O[r, c] = inv[r] · Σ_j P[r, j] · v[j, c]       R rows × 32 columns (c0 … c0 + 31),
              P [R, N] bf16 (row-major: pairs along j as stored), vp = v packed [N/2, Dv, 2],
              O float32 or bf16 (rounded to nearest even by ``vcvtneps2bf16``)

Each tile holds ROWS × 2 accumulators of 16 lanes (16 of the 32 zmm registers) across the
whole reduction; every step loads two 64-byte ``b`` vectors and broadcasts one 32-bit pair
per row. FLOPs per step: ROWS · 2 · 16 · 4. Measured on Zen 4 (one thread, 96 heads of
128 × 128 × 32, hot): qk_tile 212 GFLOP/s into float32 scores.

Only for a CPU with avx512_bf16 (:data:`AVAILABLE`): elsewhere LLVM cannot select the
instruction, and callers must take another path. Bits travel as uint16 arrays (a bf16
tensor's ``.view(torch.int16)``), unit stride along the pairs: callers check it.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Rows of a tile (its accumulators: ROWS × 2 vectors of 16 float32 lanes).
ROWS = 8
#: Keys (qk_tile) / output columns (pv_tile) of a tile: two vectors of 16 lanes.
COLS = 32


def host_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with LLVM feature ``feature`` (e.g. ``"avx512bf16"``):
    the host's features, unless ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` name another target."""
    if numba.config.CPU_FEATURES:
        return f"+{feature}" in numba.config.CPU_FEATURES
    if numba.config.CPU_NAME and numba.config.CPU_NAME != "host":
        return False
    try:
        return bool(llvm.get_host_cpu_features().get(feature))
    except RuntimeError:
        return False


#: True where these tiles can run (avx512_bf16 on the CPU numba compiles for).
AVAILABLE = host_has("avx512bf16")


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no class for it)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16F = ir.VectorType(_F32, 16)
_V16I = ir.VectorType(_I32, 16)
_V16B = ir.VectorType(_BFloat(), 16)
_V32B = ir.VectorType(_BFloat(), 32)
_V16H = ir.VectorType(ir.IntType(16), 16)


def _dp(builder, acc, a, b):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F, _V32B, _V32B]),
                                        "llvm.x86.avx512bf16.dpbf16ps.512")
    return builder.call(fn, [acc, a, b])


def _array(context, builder, ty, value):
    """(base address as i64, row stride in bytes as i64) of a 2-D numba array."""
    a = cgutils.create_struct_proxy(ty)(context, builder, value=value)
    return builder.ptrtoint(a.data, _I64), builder.extract_value(a.strides, 0)


def _i64(builder, v):
    return builder.sext(v, _I64) if v.type.width < 64 else v


def _at(builder, base, *terms):
    """base + Σ a·b over (a, b) pairs (i64 byte offsets)."""
    addr = base
    for a, b in terms:
        addr = builder.add(addr, builder.mul(a, b))
    return addr


def _broadcast_pair(builder, addr):
    """One 32-bit bf16 pair at ``addr`` broadcast to all 16 lanes, as <32 x bfloat>."""
    v = builder.load(builder.inttoptr(addr, _I32.as_pointer()), align=4)
    v = builder.insert_element(ir.Constant(_V16I, None), v, _I32(0))
    return builder.bitcast(builder.shuffle_vector(v, v, ir.Constant(_V16I, [0] * 16)), _V32B)


def _steps(builder, n, step):
    """Emit ``step(i)`` for i < n (i64), unrolled by two (one pointer reload of the row
    addresses, which do not all fit in registers, serves two steps), a last odd step after."""
    with cgutils.for_range(builder, builder.udiv(n, _I64(2))) as loop:
        i = builder.mul(loop.index, _I64(2))
        step(i)
        step(builder.add(i, _I64(1)))
    odd = builder.icmp_unsigned("!=", builder.urem(n, _I64(2)), _I64(0))
    with builder.if_then(odd, likely=False):
        step(builder.sub(n, _I64(1)))


@intrinsic
def to_bf16(typingctx, x):
    """bf16 bits (uint16) of float32 ``x``, rounded to nearest even by LLVM's ``fptrunc`` to
    bfloat (NaN stays NaN; a loop of them vectorises to ``vcvtneps2bf16``)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], _BFloat()), ir.IntType(16))
    return types.uint16(x), codegen


def _tile_step(builder, accs, rows, t, at):
    """One reduction step of a ROWS × COLS tile: the two 64-byte ``b`` vectors at address
    ``at``, row r's bf16 pair t (at rows[r] + 4t) broadcast, accs[2r + c] += a · b[c]."""
    b = [builder.load(builder.inttoptr(builder.add(at, _I64(64 * c)), _V32B.as_pointer()), align=4)
         for c in range(2)]
    for r in range(ROWS):
        a = _broadcast_pair(builder, _at(builder, rows[r], (t, _I64(4))))
        for c in range(2):
            acc = accs[2 * r + c]
            builder.store(_dp(builder, builder.load(acc), a, b[c]), acc)


@intrinsic
def qk_tile(typingctx, q, r0, kp, s, npairs, nkeys):
    """S[r, j] = Σ_p q[r0 + r, 2p:2p+2] · kp[p, 2j:2j+2] for r < ROWS, j < nkeys (a multiple
    of COLS); q [M, 2·npairs] uint16 (bf16 bits, unit inner stride), kp [npairs, 2·nkeys]
    uint16 C-contiguous, s [ROWS, ≥ nkeys] float32 (unit inner stride) out."""
    sig = types.void(q, r0, kp, s, npairs, nkeys)

    def codegen(context, builder, signature, args):
        qv, r0v, kv, sv, npv, nkv = args
        qbase, qstride = _array(context, builder, signature.args[0], qv)
        kbase, _ = _array(context, builder, signature.args[2], kv)
        sbase, sstride = _array(context, builder, signature.args[3], sv)
        r0v, npv, nkv = _i64(builder, r0v), _i64(builder, npv), _i64(builder, nkv)
        rows = [_at(builder, qbase, (builder.add(r0v, _I64(r)), qstride)) for r in range(ROWS)]
        zero = ir.Constant(_V16F, [0.0] * 16)
        with cgutils.for_range_slice(builder, _I64(0), nkv, _I64(COLS)) as (jb, _):
            accs = [cgutils.alloca_once_value(builder, zero) for _ in range(2 * ROWS)]

            def step(p):  # kp[p, 2·jb]
                _tile_step(builder, accs, rows, p, _at(builder, kbase, (builder.add(builder.mul(p, nkv), jb), _I64(4))))
            _steps(builder, npv, step)
            for r in range(ROWS):
                for c in range(2):
                    addr = _at(builder, sbase, (_I64(r), sstride), (builder.add(jb, _I64(16 * c)), _I64(4)))
                    builder.store(builder.load(accs[2 * r + c]), builder.inttoptr(addr, _V16F.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def pv_tile(typingctx, p, vp, o, o_r0, c0, inv, npairs):
    """o[o_r0 + r, c0 + c] = inv[r] · Σ_t p[r, 2t:2t+2] · vp[t, 2(c0 + c):2(c0 + c)+2] for
    r < ROWS, c < COLS; p [ROWS, ≥ 2·npairs] uint16 (unit inner stride), vp [npairs, 2·Dv]
    uint16 C-contiguous, o [M, Dv] float32, or uint16 (bf16 bits, rounded to nearest even),
    unit inner stride; inv [ROWS] float32."""
    sig = types.void(p, vp, o, o_r0, c0, inv, npairs)
    out_bf16 = o.dtype == types.uint16

    def codegen(context, builder, signature, args):
        pv, vv, ov, r0v, c0v, iv, npv = args
        pbase, pstride = _array(context, builder, signature.args[0], pv)
        vbase, vstride = _array(context, builder, signature.args[1], vv)
        obase, ostride = _array(context, builder, signature.args[2], ov)
        ibase = builder.ptrtoint(cgutils.create_struct_proxy(signature.args[5])(context, builder, value=iv).data, _I64)
        r0v, c0v, npv = _i64(builder, r0v), _i64(builder, c0v), _i64(builder, npv)
        zero = ir.Constant(_V16F, [0.0] * 16)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(2 * ROWS)]
        rows = [_at(builder, pbase, (_I64(r), pstride)) for r in range(ROWS)]
        vcol = builder.add(vbase, builder.mul(c0v, _I64(4)))

        def step(t):  # vp[t, 2·c0]
            _tile_step(builder, accs, rows, t, _at(builder, vcol, (t, vstride)))
        _steps(builder, npv, step)
        esize = _I64(2 if out_bf16 else 4)
        for r in range(ROWS):
            scale = builder.load(builder.inttoptr(builder.add(ibase, _I64(4 * r)), _F32.as_pointer()))
            sv = builder.insert_element(ir.Constant(_V16F, None), scale, _I32(0))
            sv = builder.shuffle_vector(sv, sv, ir.Constant(_V16I, [0] * 16))
            for c in range(2):
                val = builder.fmul(builder.load(accs[2 * r + c]), sv)
                addr = _at(builder, obase, (builder.add(r0v, _I64(r)), ostride),
                           (builder.add(c0v, _I64(16 * c)), esize))
                if out_bf16:
                    val = builder.bitcast(builder.fptrunc(val, _V16B), _V16H)
                builder.store(val, builder.inttoptr(addr, val.type.as_pointer()), align=2)
        return context.get_dummy_value()
    return sig, codegen


def _hsum(builder, v):
    """The sum of a <16 x float>'s lanes: a tree of shuffles and adds (16 → 8 → 4 → 2 → 1)."""
    width = 16
    while width > 1:
        half = width // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, width))))
        v, width = builder.fadd(lo, hi), half
    return builder.extract_element(v, _I32(0))


def _gemv_rows(mr: int):
    """An intrinsic ``gemv_rows(x, r0, w, n, y, kblocks)``: y[r0 + r, n] = Σ_k x[r0 + r, k] ·
    w[n, k] for r < mr, over k < 32·kblocks; x [M, K], w [N, K] uint16 (bf16 bits, unit inner
    stride), y [M, N] float32 (unit inner stride). One weight row is loaded once, 64 bytes
    at a time, for all mr rows of x (16 lanes × 2 products per vdpbf16ps)."""
    @intrinsic
    def gemv_rows(typingctx, x, r0, w, n, y, kblocks):
        sig = types.void(x, r0, w, n, y, kblocks)

        def codegen(context, builder, signature, args):
            xv, r0v, wv, nv, yv, kbv = args
            xbase, xstride = _array(context, builder, signature.args[0], xv)
            wbase, wstride = _array(context, builder, signature.args[2], wv)
            ybase, ystride = _array(context, builder, signature.args[4], yv)
            r0v, nv, kbv = _i64(builder, r0v), _i64(builder, nv), _i64(builder, kbv)
            wrow = _at(builder, wbase, (nv, wstride))
            xrows = [_at(builder, xbase, (builder.add(r0v, _I64(r)), xstride)) for r in range(mr)]
            zero = ir.Constant(_V16F, [0.0] * 16)
            accs = [cgutils.alloca_once_value(builder, zero) for _ in range(mr)]

            def step(kb):
                off = builder.mul(kb, _I64(64))
                b = builder.load(builder.inttoptr(builder.add(wrow, off), _V32B.as_pointer()), align=2)
                for r in range(mr):
                    a = builder.load(builder.inttoptr(builder.add(xrows[r], off), _V32B.as_pointer()), align=2)
                    builder.store(_dp(builder, builder.load(accs[r]), a, b), accs[r])
            _steps(builder, kbv, step)
            for r in range(mr):
                addr = _at(builder, ybase, (builder.add(r0v, _I64(r)), ystride), (nv, _I64(4)))
                builder.store(_hsum(builder, builder.load(accs[r])), builder.inttoptr(addr, _F32.as_pointer()))
            return context.get_dummy_value()
        return sig, codegen
    return gemv_rows


#: gemv_rows for 1 … 4 rows of x (one weight row's 64-byte loads shared by them).
GEMV_1, GEMV_2, GEMV_3, GEMV_4 = (_gemv_rows(r) for r in range(1, 5))
