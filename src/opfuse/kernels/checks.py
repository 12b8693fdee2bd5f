"""Argument checks shared by the launchers of every backend.

Each op's launcher (CPU in ``kernels/cpu``, Triton in ``kernels/triton``) validates its
arguments with the one function here named after the op, so both backends raise the same
``ValueError``, with the same text, for the same bad input:

    launcher ── check_<op>(..., device_type=...) ── stage / launch the kernel
                  tensors: Tensor, device, dtype, ndim
                  shapes, dtype agreement, layout strings, optional bias

Only the device differs. ``device_type`` is the device type a launcher accepts, or a tuple
of them whose first is the one the error names: ``"cpu"`` for the numba kernels, ``"cuda"``
for Triton (``("cuda", "cpu")`` under TRITON_INTERPRET=1). Limits of one backend (Triton's
single-block rows, head dim, grid size) stay in its launcher.
"""

from __future__ import annotations

import torch

DeviceType = str | tuple[str, ...]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
APPROXIMATE = ("none", "tanh")  # GELU forms: erf ("none") and tanh
ROPE_LAYOUTS = ("rotate_half", "interleaved")  # RoPE pairings: (j, j + D/2) and (2i, 2i + 1)


# --- generic checks ---------------------------------------------------------------------


def check_tensor(op: str, name: str, t: object, ndim_min: int = 1, *, device_type: DeviceType) -> torch.Tensor:
    """Raise ValueError unless ``t`` is a tensor on an accepted device type, of a supported
    float dtype, with at least ``ndim_min`` dims."""
    accepted = (device_type,) if isinstance(device_type, str) else device_type
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"opfuse.{op}: {name} must be a Tensor, got {type(t).__name__}")
    if t.device.type not in accepted:
        raise ValueError(f"opfuse.{op}: {name} is on device {t.device}, expected {accepted[0]}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"opfuse.{op}: {name} has unsupported dtype {t.dtype} (expected float32, float16 or bfloat16)")
    if t.dim() < ndim_min:
        raise ValueError(f"opfuse.{op}: {name} must have at least {ndim_min} dims, got shape {tuple(t.shape)}")
    return t


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"opfuse.{op}: {name} shape {tuple(t.shape)} != expected {tuple(expected)}")


def check_same(op: str, **tensors: torch.Tensor | None) -> None:
    """Same dtype and same device for every non-None tensor; a oneDNN prepacked bf16 weight
    (``precision="bf16"``: :func:`opfuse.kernels.cpu._gemm.linear` runs the GEMM in bf16
    on a float32 ``x``) is exempt from the dtype rule."""
    present = {n: t for n, t in tensors.items() if t is not None}
    typed = [t for t in present.values() if not (t.is_mkldnn and t.dtype == torch.bfloat16)]
    if len({t.dtype for t in typed}) > 1:
        raise ValueError(f"opfuse.{op}: dtype mismatch { {n: t.dtype for n, t in present.items()} }")
    if len({t.device for t in present.values()}) > 1:
        raise ValueError(f"opfuse.{op}: device mismatch { {n: str(t.device) for n, t in present.items()} }")


def check_approximate(op: str, approximate: str) -> None:
    if approximate not in APPROXIMATE:
        raise ValueError(f"opfuse.{op}: approximate must be one of {APPROXIMATE}, got {approximate!r}")


def check_row_affine(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """A normalisation over x's last dim N with weight [N] and bias [N] or None; returns N."""
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"opfuse.{op}: normalised dim is empty (x shape {tuple(x.shape)})")
    check_shape(op, "weight", weight, (n,))
    if bias is not None:
        check_shape(op, "bias", bias, (n,))
    return n


def check_gemm_operands(op: str, x: object, weight: object, *, device_type: DeviceType) -> None:
    """x [..., K] and weight [N, K] of a GEMM are tensors (weight at least 2-D)."""
    check_tensor(op, "x", x, device_type=device_type)
    check_tensor(op, "weight", weight, ndim_min=2, device_type=device_type)


def check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int]:
    """x [..., K] @ weight.T with weight [N, K] and bias [N] or None; returns (K, N)."""
    k = x.shape[-1]
    n = weight.shape[0]
    check_shape(op, "weight", weight, (n, k))
    if bias is not None:
        check_shape(op, "bias", bias, (n,))
    return k, n


# --- one check per op -------------------------------------------------------------------


def _check_add_norm_tensors(op: str, x, residual, weight, bias, device_type: DeviceType) -> None:
    """x, residual, weight (and bias) of an add + normalisation are tensors on ``device_type``."""
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None or name != "bias":
            check_tensor(op, name, t, device_type=device_type)


def check_add_layernorm(
    x: torch.Tensor,  # [..., N]
    residual: torch.Tensor,  # [..., N]
    weight: torch.Tensor,  # [N]
    bias: torch.Tensor | None,  # [N]
    *,
    device_type: DeviceType,
) -> int:
    """Returns N."""
    op = "add_layernorm"
    _check_add_norm_tensors(op, x, residual, weight, bias, device_type)
    check_same(op, x=x, residual=residual)
    check_broadcast_rows(op, "residual", residual, x)
    return check_row_affine(op, x, weight, bias)


def check_add_layernorm_bf16(
    x: torch.Tensor,  # [..., N] bf16
    residual: torch.Tensor,  # [..., N] float32
    weight: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N] float32
    *,
    device_type: DeviceType,
) -> int:
    """The bf16 plan's SkipLayerNorm: x bf16 (a bf16 GEMM's output), residual float32 of
    x's shape, weight / bias float32 [N]. Returns N."""
    op = "add_layernorm_bf16"
    _check_add_norm_tensors(op, x, residual, weight, bias, device_type)
    if x.dtype != torch.bfloat16 or residual.dtype != torch.float32:
        raise ValueError(f"opfuse.{op}: x must be bfloat16 and residual float32, got {x.dtype} and {residual.dtype}")
    check_same(op, residual=residual, weight=weight, bias=bias)
    check_shape(op, "residual", residual, tuple(x.shape))
    return check_row_affine(op, x, weight, bias)


def check_add_layernorm_bf16_inplace(
    x: torch.Tensor,  # [..., N] bf16, contiguous (overwritten)
    residual: torch.Tensor,  # [..., N] float32, contiguous (overwritten)
    weight: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N] float32
    *,
    device_type: DeviceType,
) -> int:
    """:func:`check_add_layernorm_bf16`, and x and residual contiguous (the in-place form
    writes its results into them). Returns N."""
    n = check_add_layernorm_bf16(x, residual, weight, bias, device_type=device_type)
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("opfuse.add_layernorm_bf16_: x and residual must be contiguous (the results are written "
                         f"into them), got strides {tuple(x.stride())} and {tuple(residual.stride())}")
    return n


def check_broadcast_rows(op: str, name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """``t`` broadcasts to ``x``'s shape over the leading dims only (same last dim; e.g.
    position embeddings [1, S, E] added to [B, S, E]): the kernels expand it row-wise."""
    shape, full = tuple(t.shape), tuple(x.shape)
    ok = (len(shape) <= len(full) and shape[-1:] == full[-1:] and
          all(a in (1, b) for a, b in zip((1,) * (len(full) - len(shape)) + shape, full)))
    if not ok:
        raise ValueError(f"opfuse.{op}: {name} shape {shape} does not broadcast to x shape {full} over the leading "
                         "dims (the last dim must be equal)")


def check_layernorm_gelu(
    x: torch.Tensor,  # [..., N]
    weight: torch.Tensor,  # [N]
    bias: torch.Tensor | None,  # [N]
    approximate: str,
    *,
    device_type: DeviceType,
) -> int:
    """Returns N."""
    op = "layernorm_gelu"
    check_tensor(op, "x", x, device_type=device_type)
    check_tensor(op, "weight", weight, device_type=device_type)
    if bias is not None:
        check_tensor(op, "bias", bias, device_type=device_type)
    check_approximate(op, approximate)
    return check_row_affine(op, x, weight, bias)


def check_linear_bias_gelu(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor,  # [N]
    approximate: str,
    *,
    device_type: DeviceType,
) -> tuple[int, int]:
    """Returns (K, N)."""
    op = "linear_bias_gelu"
    check_gemm_operands(op, x, weight, device_type=device_type)
    check_tensor(op, "bias", bias, device_type=device_type)
    check_approximate(op, approximate)
    k, n = check_linear(op, x, weight, bias)
    check_same(op, x=x, weight=weight)
    return k, n


def check_linear_residual(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    residual: torch.Tensor,  # [..., N]
    *,
    device_type: DeviceType,
) -> tuple[int, int]:
    """Returns (K, N)."""
    op = "linear_residual"
    check_gemm_operands(op, x, weight, device_type=device_type)
    check_tensor(op, "residual", residual, device_type=device_type)
    if bias is not None:
        check_tensor(op, "bias", bias, device_type=device_type)
    k, n = check_linear(op, x, weight, bias)
    check_shape(op, "residual", residual, (*x.shape[:-1], n))
    check_same(op, x=x, weight=weight, residual=residual)
    return k, n


def check_linear_add_layernorm(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    residual: torch.Tensor,  # [..., N]
    ln_weight: torch.Tensor,  # [N]
    ln_bias: torch.Tensor | None,  # [N]
    *,
    device_type: DeviceType,
) -> tuple[int, int]:
    """LayerNorm(x @ weight.T + bias + residual) over N; returns (K, N)."""
    op = "linear_add_layernorm"
    check_gemm_operands(op, x, weight, device_type=device_type)
    check_tensor(op, "residual", residual, device_type=device_type)
    check_tensor(op, "ln_weight", ln_weight, device_type=device_type)
    for name, t in (("bias", bias), ("ln_bias", ln_bias)):
        if t is not None:
            check_tensor(op, name, t, device_type=device_type)
    k, n = check_linear(op, x, weight, bias)
    check_shape(op, "residual", residual, (*x.shape[:-1], n))
    check_same(op, x=x, weight=weight, residual=residual)
    if n == 0:
        raise ValueError(f"opfuse.{op}: normalised dim is empty (weight shape {tuple(weight.shape)})")
    check_shape(op, "ln_weight", ln_weight, (n,))
    if ln_bias is not None:
        check_shape(op, "ln_bias", ln_bias, (n,))
    return k, n


def check_ffn(
    x: torch.Tensor,  # [..., K]
    w1: torch.Tensor,  # [H, K]
    b1: torch.Tensor,  # [H]
    w2: torch.Tensor,  # [N, H]
    b2: torch.Tensor,  # [N]
    approximate: str,
    block_rows: int,
    *,
    device_type: DeviceType,
) -> tuple[int, int, int]:
    """Returns (K, H, N)."""
    op = "ffn"
    for name, t in (("x", x), ("b1", b1), ("b2", b2)):
        check_tensor(op, name, t, device_type=device_type)
    check_tensor(op, "w1", w1, ndim_min=2, device_type=device_type)
    check_tensor(op, "w2", w2, ndim_min=2, device_type=device_type)
    check_approximate(op, approximate)
    if int(block_rows) < 1:
        raise ValueError(f"opfuse.{op}: block_rows must be >= 1, got {block_rows}")
    k = x.shape[-1]
    hidden = w1.shape[0]
    n = w2.shape[0]
    check_shape(op, "w1", w1, (hidden, k))
    check_shape(op, "b1", b1, (hidden,))
    check_shape(op, "w2", w2, (n, hidden))
    check_shape(op, "b2", b2, (n,))
    check_same(op, x=x, w1=w1, w2=w2)
    return k, hidden, n


def check_attention(
    q: torch.Tensor,  # [B, H, Sq, D]
    k: torch.Tensor,  # [B, Hkv, Sk, D]
    v: torch.Tensor,  # [B, Hkv, Sk, Dv]
    *,
    device_type: DeviceType,
) -> tuple[int, int, int, int, int, int, int]:
    """q, k, v of grouped-query attention (Hkv divides H); returns (B, H, Hkv, Sq, Sk, D, Dv).
    The mask is checked by :func:`check_attention_mask`, after any backend limits."""
    op = "attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t, device_type=device_type)
        if t.dim() != 4:
            raise ValueError(f"opfuse.{op}: {name} must be 4-D [B, H, S, D], got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"opfuse.{op}: {name} is on {t.device}, q on {q.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"opfuse.{op}: dtype mismatch q={q.dtype} k={k.dtype} v={v.dtype}")
    b, h, sq, d = q.shape
    _, hkv, sk, _ = k.shape
    dv = v.shape[3]
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"opfuse.{op}: k shape {tuple(k.shape)} incompatible with q shape {tuple(q.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"opfuse.{op}: v shape {tuple(v.shape)} incompatible with k shape {tuple(k.shape)}")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"opfuse.{op}: kv heads {hkv} must divide query heads {h}")
    return b, h, hkv, sq, sk, d, dv


def check_attention_mask(
    mask: object,  # broadcastable to [B, H, Sq, Sk], bool (True = keep) or additive float
    q: torch.Tensor,  # [B, H, Sq, D]
    scores: tuple[int, int, int, int],  # (B, H, Sq, Sk)
    is_causal: bool,
    *,
    device_type: DeviceType,
) -> None:
    """A mask on q's device; with ``device_type`` "cpu" the error says "a CPU tensor"."""
    op = "attention"
    if not isinstance(mask, torch.Tensor) or mask.device != q.device:
        on_cpu = device_type == "cpu"
        raise ValueError(f"opfuse.{op}: mask must be {'a CPU tensor' if on_cpu else f'a tensor on {q.device}'}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise ValueError(f"opfuse.{op}: mask dtype {mask.dtype} must be bool or floating point")
    shape = mask.shape  # broadcastable to scores: each trailing dim 1 or equal (no
    # torch.broadcast_shapes: ~15 µs a call, a third of a decode step's attention)
    ok = len(shape) <= 4 and all(a in (1, b) for a, b in zip(reversed(shape), reversed(scores)))
    if not ok:
        raise ValueError(f"opfuse.{op}: mask shape {tuple(mask.shape)} not broadcastable to {scores}")
    if is_causal:
        raise ValueError(f"opfuse.{op}: mask and is_causal=True are mutually exclusive (as in SDPA)")


def check_rope_input(op: str, name: str, x: object, layout: str, *, device_type: DeviceType) -> tuple[int, int, int]:
    """x [B, H, S, D] with D even, layout one of ROPE_LAYOUTS; returns (B, S, D)."""
    check_tensor(op, name, x, device_type=device_type)
    if x.dim() != 4:
        raise ValueError(f"opfuse.{op}: {name} must be 4-D [B, H, S, D], got shape {tuple(x.shape)}")
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"opfuse.{op}: layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
    b, _, s, d = x.shape
    if d % 2 != 0:
        raise ValueError(f"opfuse.{op}: head dim D must be even to rotate pairs, got D = {d}")
    return b, s, d


def check_rope_table(
    op: str, name: str, t: object, b: int, s: int, d: int, *, device_type: DeviceType
) -> tuple[int, int, int, int]:
    """cos / sin broadcastable to [B, 1, S, D]; returns its shape padded to 4 dims."""
    check_tensor(op, name, t, device_type=device_type)
    target = (b, 1, s, d)
    shape = (1,) * (4 - t.dim()) + tuple(t.shape) if t.dim() <= 4 else tuple(t.shape)
    if len(shape) != 4 or any(n not in (1, want) for n, want in zip(shape, target)):
        raise ValueError(f"opfuse.{op}: {name} shape {tuple(t.shape)} is not broadcastable to [B, 1, S, D] = {target}")
    return shape


def check_rope_qk(
    q: torch.Tensor,  # [B, H, S, D]
    k: torch.Tensor,  # [B, Hkv, S, D]
    cos: torch.Tensor,  # broadcastable to [B, 1, S, D]
    sin: torch.Tensor,  # broadcastable to [B, 1, S, D]
    layout: str,
    *,
    device_type: DeviceType,
) -> tuple[tuple[int, int, int], tuple[int, ...], tuple[int, ...]]:
    """q and k rotated with the same tables; returns ((B, S, D), cos shape, sin shape) (4-D)."""
    op = "rope_qk"
    bsd = check_rope_input(op, "q", q, layout, device_type=device_type)
    if check_rope_input(op, "k", k, layout, device_type=device_type) != bsd:
        raise ValueError(f"opfuse.{op}: k shape {tuple(k.shape)} incompatible with q shape {tuple(q.shape)} "
                         "(same B, S, D needed: one cos / sin table)")
    if k.device != q.device:
        raise ValueError(f"opfuse.{op}: k is on {k.device}, q on {q.device}")
    return (bsd, check_rope_table(op, "cos", cos, *bsd, device_type=device_type),
            check_rope_table(op, "sin", sin, *bsd, device_type=device_type))


def check_rope_qk_cache(
    q: torch.Tensor,  # [B, H, S, D]
    k: torch.Tensor,  # [B, Hkv, S, D]
    v: torch.Tensor,  # [B, Hkv, S, D]
    cos: torch.Tensor,  # broadcastable to [B, 1, S, D]
    sin: torch.Tensor,
    layout: str,
    k_cache: torch.Tensor,  # [B, Hkv, L, D], written at positions ``index``
    v_cache: torch.Tensor,  # [B, Hkv, L, D]
    index: torch.Tensor,  # [S] int64, cache positions of the S new tokens
    *,
    device_type: DeviceType,
) -> tuple[tuple[int, int, int], tuple[int, ...], tuple[int, ...]]:
    """rope_qk's checks, then: v shaped like k; both caches [B, Hkv, L, D] of the dtype the
    rotated k and v have (``index_copy_`` copies without a cast); index a 1-D int64 tensor
    of S positions; H ≥ 1. Returns rope_qk's ((B, S, D), cos shape, sin shape). Positions
    outside [0, L) are checked by the kernel (IndexError, as ``index_copy_``)."""
    op = "rope_qk_cache"
    (b, s, d), cos_shape, sin_shape = check_rope_qk(q, k, cos, sin, layout, device_type=device_type)
    if q.shape[1] < 1:
        raise ValueError(f"opfuse.{op}: q has no heads (shape {tuple(q.shape)})")
    check_tensor(op, "v", v, 4, device_type=device_type)
    check_shape(op, "v", v, tuple(k.shape))
    k_dtype = torch.promote_types(torch.promote_types(k.dtype, cos.dtype), sin.dtype)
    for name, cache, src_dtype in (("k_cache", k_cache, k_dtype), ("v_cache", v_cache, v.dtype)):
        check_tensor(op, name, cache, 4, device_type=device_type)
        if cache.dim() != 4 or (cache.shape[0], cache.shape[1], cache.shape[3]) != (b, k.shape[1], d):
            raise ValueError(f"opfuse.{op}: {name} shape {tuple(cache.shape)} is not [B, Hkv, L, D] = "
                             f"[{b}, {k.shape[1]}, L, {d}]")
        if cache.dtype != src_dtype:
            raise ValueError(f"opfuse.{op}: {name} is {cache.dtype}, the rows written into it are {src_dtype}")
        if cache.device != q.device:
            raise ValueError(f"opfuse.{op}: {name} is on {cache.device}, q on {q.device}")
    if v_cache.shape[2] != k_cache.shape[2]:
        raise ValueError(f"opfuse.{op}: k_cache holds {k_cache.shape[2]} positions, v_cache {v_cache.shape[2]}")
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or index.dim() != 1 or index.numel() != s:
        raise ValueError(f"opfuse.{op}: index must be a 1-D int64 tensor of S = {s} cache positions, got "
                         + (f"{index.dtype} {tuple(index.shape)}" if isinstance(index, torch.Tensor)
                            else type(index).__name__))
    if index.device != q.device:
        raise ValueError(f"opfuse.{op}: index is on {index.device}, q on {q.device}")
    return (b, s, d), cos_shape, sin_shape


# --- ops without a backend-shared check above (their CPU launchers call these too) ------


def check_rmsnorm(x: object, weight: object, *, device_type: DeviceType, op: str = "rmsnorm") -> int:
    """x [..., N], weight [N] (its dtype may differ: HF multiplies it after the cast); returns N."""
    check_tensor(op, "x", x, device_type=device_type)
    check_tensor(op, "weight", weight, device_type=device_type)
    return check_row_affine(op, x, weight, None)


def check_add_rmsnorm(x: object, residual: object, weight: object, *, device_type: DeviceType) -> int:
    """x, residual [..., N] of one dtype, weight [N]; returns N."""
    op = "add_rmsnorm"
    n = check_rmsnorm(x, weight, device_type=device_type, op=op)
    check_tensor(op, "residual", residual, device_type=device_type)
    check_same(op, x=x, residual=residual)
    check_shape(op, "residual", residual, tuple(x.shape))
    return n


def check_swiglu(x: object, w_gate_up: object, hidden: int, *, device_type: DeviceType,
                 op: str = "swiglu") -> tuple[int, int]:
    """x [..., K], w_gate_up [2*hidden, K] of x's dtype; returns (K, hidden)."""
    check_tensor(op, "x", x, device_type=device_type)
    check_tensor(op, "w_gate_up", w_gate_up, ndim_min=2, device_type=device_type)
    if int(hidden) < 1:
        raise ValueError(f"opfuse.{op}: hidden must be >= 1, got {hidden}")
    k = x.shape[-1]
    check_shape(op, "w_gate_up", w_gate_up, (2 * int(hidden), k))
    check_same(op, x=x, w_gate_up=w_gate_up)
    return k, int(hidden)


def check_geglu(x: object, w_gate_up: object, hidden: int, approximate: str, *,
                device_type: DeviceType) -> tuple[int, int]:
    """As :func:`check_swiglu`, and ``approximate`` is ``"none"`` (erf) or ``"tanh"``."""
    check_approximate("geglu", approximate)
    return check_swiglu(x, w_gate_up, hidden, device_type=device_type, op="geglu")


def check_rope(x: object, cos: object, sin: object, layout: str, *, device_type: DeviceType):
    """x [B, H, S, D]; cos / sin broadcastable to [B, 1, S, D]; returns ((B, S, D), cos shape, sin shape)."""
    op = "rope"
    bsd = check_rope_input(op, "x", x, layout, device_type=device_type)
    return (bsd, check_rope_table(op, "cos", cos, *bsd, device_type=device_type),
            check_rope_table(op, "sin", sin, *bsd, device_type=device_type))


def _attention_call(q, k, v, mask, scale, is_causal, shift=True, aten=False, *, device_type):
    b, h, _, sq, sk, _, _ = check_attention(q, k, v, device_type=device_type)
    if mask is not None:
        check_attention_mask(mask, q, (b, h, sq, sk), is_causal, device_type=device_type)


#: ``torch.ops.opfuse.<name>`` argument list -> the check its launchers run; called by the
#: ops' fake implementations too, so legality (a fake run of each fused region) and
#: torch.export refuse what a kernel would refuse, before anything runs.
OP_CHECKS = {
    "add_layernorm": lambda x, r, w, b, eps, **d: check_add_layernorm(x, r, w, b, **d),
    "add_layernorm_sum": lambda x, r, w, b, eps, **d: check_add_layernorm(x, r, w, b, **d),
    "add_layernorm_bf16": lambda x, r, w, b, eps, **d: check_add_layernorm_bf16(x, r, w, b, **d),
    "add_layernorm_bf16_": lambda x, r, w, b, eps, **d: check_add_layernorm_bf16_inplace(x, r, w, b, **d),
    "layernorm_gelu": lambda x, w, b, eps, a, **d: check_layernorm_gelu(x, w, b, a, **d),
    "linear_bias_gelu": lambda x, w, b, a, **d: check_linear_bias_gelu(x, w, b, a, **d),
    "linear_residual": lambda x, w, b, r, **d: check_linear_residual(x, w, b, r, **d),
    "linear_bf16": lambda x, w, b, **d: check_linear_bf16(x, w, b, **d),
    "linear_gemv": lambda x, w, b, **d: check_linear_gemv(x, w, b, **d),
    "linear_blas": lambda x, w, b, **d: check_linear_blas(x, w, b, **d),
    "linear_add_layernorm": lambda x, w, b, r, lw, lb, eps, **d: check_linear_add_layernorm(x, w, b, r, lw, lb, **d),
    "linear_add_layernorm_sum": lambda x, w, b, r, lw, lb, eps, **d: check_linear_add_layernorm(x, w, b, r, lw, lb, **d),
    "ffn": lambda x, w1, b1, w2, b2, a, rows, **d: check_ffn(x, w1, b1, w2, b2, a, rows, **d),
    "attention": _attention_call,
    "attention_bf16": _attention_call,
    "rmsnorm": lambda x, w, eps, **d: check_rmsnorm(x, w, **d),
    "add_rmsnorm": lambda x, r, w, eps, **d: check_add_rmsnorm(x, r, w, **d),
    "swiglu": lambda x, w, hidden, **d: check_swiglu(x, w, hidden, **d),
    "geglu": lambda x, w, hidden, a, **d: check_geglu(x, w, hidden, a, **d),
    "rope": lambda x, cos, sin, layout, **d: check_rope(x, cos, sin, layout, **d),
    "rope_qk": lambda q, k, cos, sin, layout, **d: check_rope_qk(q, k, cos, sin, layout, **d),
    "rope_qk_cache": lambda *a, **d: check_rope_qk_cache(*a, **d),
}


def check_linear_bf16(x, weight, bias, *, device_type: DeviceType = "cpu") -> tuple[int, int]:
    """x [..., K] float32 CPU, weight [N, K] bfloat16 dense contiguous (precision="bf16"'s
    copy), bias [N] float32 or None; returns (K, N). Raises ValueError naming the problem."""
    return _check_float32_gemv("linear_bf16", x, weight, bias, torch.bfloat16, device_type)


def check_linear_gemv(x, weight, bias, *, device_type: DeviceType = "cpu") -> tuple[int, int]:
    """x [..., K] float32 CPU, weight [N, K] float32 dense contiguous, bias [N] float32 or
    None; returns (K, N). Raises ValueError naming the problem."""
    return _check_float32_gemv("linear_gemv", x, weight, bias, torch.float32, device_type)


def check_linear_blas(x, weight, bias, *, device_type: DeviceType = "cpu") -> tuple[int, int]:
    """x [..., K] float32 CPU, weight [N, K] float32 strided (any strides: BLAS reads a
    transposed or padded view as it is), bias [N] float32 or None; returns (K, N). Raises
    ValueError naming the problem."""
    return _check_float32_gemv("linear_blas", x, weight, bias, torch.float32, device_type, any_strides=True)


def _check_float32_gemv(op: str, x, weight, bias, weight_dtype: torch.dtype, device_type,
                        any_strides: bool = False) -> tuple[int, int]:
    check_tensor(op, "x", x, 1, device_type=device_type)
    check_tensor(op, "weight", weight, 2, device_type=device_type)
    if x.dtype != torch.float32:
        raise ValueError(f"opfuse.{op}: x must be float32, got {x.dtype}")
    if weight.dtype != weight_dtype or weight.layout != torch.strided or not (any_strides or weight.is_contiguous()):
        raise ValueError(f"opfuse.{op}: weight must be a dense contiguous {str(weight_dtype).replace('torch.', '')} "
                         f"[N, K] tensor, got {weight.dtype} {weight.layout} strides "
                         f"{tuple(weight.stride()) if weight.layout == torch.strided else ''}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"opfuse.{op}: x has {x.shape[-1]} features, weight expects {k}")
    if bias is not None:
        check_tensor(op, "bias", bias, 1, device_type=device_type)
        if bias.dtype != torch.float32:
            raise ValueError(f"opfuse.{op}: bias must be float32, got {bias.dtype}")
        check_shape(op, "bias", bias, (n,))
    return k, n
