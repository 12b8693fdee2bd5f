"""rope_qk_cache: RoPE on q and k, the rotated k and v written into a KV cache in place.

    q [B, H, S, D] ──rope──────────────────────────────────────────► q_rot [B, H, S, D] (returned)
    k [B, Hkv, S, D] ──rope──► row t ──► k_cache[b, h, index[t]]     (written in place)
    v [B, Hkv, S, D] ─────────► row t ──► v_cache[b, h, index[t]]     (written in place)
    cos, sin [B|1, 1, S, D]; index [S] int64 (the new tokens' cache positions)

The decode-step form of HF's attention prologue: ``q, k = apply_rotary_pos_emb(q, k, cos,
sin)`` then ``StaticCache.update`` (``k_cache.index_copy_(2, cache_position, k)``, the same
for v). Unfused that is rope_qk (q_rot and k_rot written), then two ``index_copy_`` (k_rot
read again, v read, both written into the caches): 3 op calls and a k_rot buffer per layer;
here one call, k rotated straight into its cache row. The rotation is rope's
(:mod:`opfuse.kernels.cpu.rope`, the same row functions: the same float32 results, bit for
bit); the writes are ``index_copy_``'s (positions outside [0, L) raise IndexError; with a
repeated position one of the rows lands, as in ``index_copy_``).

Fast path (one serial call, every tensor float32, q / k / v / tables / caches contiguous,
the caches disjoint from q, k, v): one numba call by address. Otherwise rope_qk then ATen's
``index_copy_`` — the unfused ops themselves.

Traffic (float32): read BHSD + 2·BHkvSD + 2·Bt·SD + 8S, write BHSD + 2·BHkvSD bytes×4
(unfused: + BHkvSD written and read again for k_rot).
"""

from __future__ import annotations

import torch
from numba import carray, njit

from opfuse.kernels.checks import check_rope_qk_cache
from opfuse.kernels.cpu import _math
from opfuse.kernels.cpu._launch import by_address
from opfuse.kernels.cpu.rope import _rope_at, _rotate_row, _tables_at
from opfuse.kernels.registry import lookup, register


@njit(error_model="numpy", cache=True)
def _rope_cache_at(qp, kp, vp, cp, sp, qop, kcp, vcp, ip, b, h, hkv, s, d, length, bt, interleaved):
    # q, q_rot [B, H, S, D]; k, v [B, Hkv, S, D]; cos, sin [Bt, S, D]; k_cache, v_cache
    # [B, Hkv, L, D] (all float32 C-contiguous, by address); index [S] int64. Returns -1, or
    # the first t whose position is outside [0, L) (then nothing was written).
    idx = carray(_math.i64_at(ip), (s,))
    for t in range(s):
        if idx[t] < 0 or idx[t] >= length:
            return t
    _rope_at(qp, cp, sp, qop, b, h, s, d, bt, interleaved)  # q_rot: rope's own loop
    k, v = carray(_math.f32_at(kp), (b, hkv, s, d)), carray(_math.f32_at(vp), (b, hkv, s, d))
    kc, vc = carray(_math.f32_at(kcp), (b, hkv, length, d)), carray(_math.f32_at(vcp), (b, hkv, length, d))
    cos, sin = carray(_math.f32_at(cp), (bt, s, d)), carray(_math.f32_at(sp), (bt, s, d))
    for bb in range(b):
        c = bb if bt > 1 else 0
        for hh in range(hkv):
            for t in range(s):
                row = idx[t]
                _rotate_row(k[bb, hh, t], cos[c, t], sin[c, t], kc[bb, hh, row], interleaved)
                for j in range(d):
                    vc[bb, hh, row, j] = v[bb, hh, t, j]
    return -1


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _disjoint(caches: tuple, inputs: tuple) -> bool:
    """No cache's bytes overlap an input's (contiguous tensors: one span each)."""
    for c in caches:
        c0, c1 = _span(c)
        for x in inputs:
            x0, x1 = _span(x)
            if c0 < x1 and x0 < c1:
                return False
    return True


@register("rope_qk_cache", "cpu")
def rope_qk_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  layout: str, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """q [B, H, S, D] rotated -> [B, H, S, D] (contiguous, promote(q, cos, sin) dtype); rope(k)
    [B, Hkv, S, D] and v written into k_cache / v_cache [B, Hkv, L, D] at positions ``index``
    [S] int64 along dim 2, in place. Raises ValueError (named) for bad shapes, dtypes or
    devices; IndexError for a position outside [0, L)."""
    (b, s, d), cos_shape, sin_shape = check_rope_qk_cache(q, k, v, cos, sin, layout, k_cache, v_cache, index,
                                                          device_type="cpu")
    bt = _tables_at(cos, sin, cos_shape, sin_shape, s, d)
    if (bt and by_address(q, k, v, k_cache, v_cache) and index.is_contiguous()
            and _disjoint((k_cache, v_cache), (q, k, v, cos, sin, index))):
        qo = torch.empty(tuple(q.shape), dtype=torch.float32)
        bad = _rope_cache_at(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(), qo.data_ptr(),
                             k_cache.data_ptr(), v_cache.data_ptr(), index.data_ptr(), b, q.shape[1], k.shape[1],
                             s, d, k_cache.shape[2], bt, layout == "interleaved")
        if bad >= 0:
            raise IndexError(f"opfuse.rope_qk_cache: index[{bad}] = {int(index[bad])} is outside the cache's "
                             f"{k_cache.shape[2]} positions")
        return qo
    qo, ko = lookup("rope_qk", "cpu")(q, k, cos, sin, layout)
    k_cache.index_copy_(2, index, ko)
    v_cache.index_copy_(2, index, v)
    return qo
