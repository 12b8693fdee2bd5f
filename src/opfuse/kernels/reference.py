"""Eager float64 oracles for every fused kernel, written in plain torch.

Each oracle takes the same arguments as its kernel, up-casts every tensor to float64 and
returns float64, so a test compares ``kernel(...)`` against ``oracle(...)`` with the
tolerance of the kernel's input dtype from ``TOLERANCE``.
"""

from __future__ import annotations

import math

import torch

# assert_close kwargs per input dtype. float32: the kernels compute in float32 (error
# ~1e-6 relative); float16 / bfloat16: the float32 result is rounded to the output dtype
# (half an ulp = 2^-11 / 2^-8 relative) on top of inputs already rounded to that dtype.
TOLERANCE: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
}


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float64)


def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU in float64: erf form for "none", tanh form for "tanh" (two different functions)."""
    x = _d(x)
    if approximate == "none":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in float64 (two-pass, biased variance)."""
    x = _d(x)
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    out = (x - mean) / torch.sqrt(var + eps) * _d(weight)
    return out if bias is None else out + _d(bias)


def add_layernorm(x, residual, weight, bias, eps: float, emit_sum: bool):
    s = _d(x) + _d(residual)
    return layer_norm(s, weight, bias, eps), (s if emit_sum else None)


def add_layernorm_bf16(x, residual, weight, bias, eps: float):
    """The float64 SkipLayerNorm (both outputs: the bf16 one's tolerance covers its rounding)."""
    out = layer_norm(_d(x) + _d(residual), weight, bias, eps)
    return out, out


def layernorm_gelu(x, weight, bias, eps: float, approximate: str) -> torch.Tensor:
    return gelu(layer_norm(x, weight, bias, eps), approximate)


def linear(x, weight, bias) -> torch.Tensor:
    out = _d(x) @ _d(weight).T
    return out if bias is None else out + _d(bias)


def linear_bf16(x, weight, bias) -> torch.Tensor:
    """The float64 GEMM on the bf16 weight's exact values (only the weight is rounded)."""
    return linear(x, weight, bias)


def linear_gemv(x, weight, bias) -> torch.Tensor:
    return linear(x, weight, bias)


def linear_blas(x, weight, bias) -> torch.Tensor:
    return linear(x, weight, bias)


def linear_bias_gelu(x, weight, bias, approximate: str) -> torch.Tensor:
    return gelu(linear(x, weight, bias), approximate)


def linear_residual(x, weight, bias, residual) -> torch.Tensor:
    return linear(x, weight, bias) + _d(residual)


def linear_add_layernorm(x, weight, bias, residual, ln_weight, ln_bias, eps: float, emit_sum: bool):
    """(LayerNorm(x @ weight.T + bias + residual), the sum or None), the order of the op's outputs."""
    s = linear_residual(x, weight, bias, residual)
    return layer_norm(s, ln_weight, ln_bias, eps), (s if emit_sum else None)


def ffn(x, w1, b1, w2, b2, approximate: str, block_rows: int = 0) -> torch.Tensor:
    """Linear -> GELU -> Linear; block_rows is a schedule detail and does not change the value."""
    return linear(gelu(linear(x, w1, b1), approximate), w2, b2)


def attention(q, k, v, mask, scale: float, is_causal: bool) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with explicit scores; GQA by repeating kv heads.

    Bool mask: True = keep. Causal: keep key j <= query i (top-left aligned, as SDPA).
    A fully masked query row gives 0 (what ATen SDPA returns).
    """
    q, k, v = _d(q), _d(k), _d(v)
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    scores = q @ k.transpose(-1, -2) * scale  # [B, H, Sq, Sk]
    sq, sk = scores.shape[-2:]
    if is_causal:
        keep = torch.ones(sq, sk, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + _d(mask)
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)  # [B, H, Sq, 1]
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return probs @ v


# --- Llama family ----------------------------------------------------------------------


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float64: weight * x / sqrt(mean(x^2) + eps) (no mean subtracted)."""
    x = _d(x)
    return _d(weight) * (x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps))


def rmsnorm(x, weight, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


def add_rmsnorm(x, residual, weight, eps: float):
    """(rmsnorm(x + residual), x + residual), the order of the op's outputs."""
    s = _d(x) + _d(residual)
    return rms_norm(s, weight, eps), s


def silu(x) -> torch.Tensor:
    x = _d(x)
    return x * torch.sigmoid(x)


def swiglu(x, w_gate_up, hidden: int) -> torch.Tensor:
    """silu(x @ W_gate^T) * (x @ W_up^T) with w_gate_up = [W_gate; W_up] (gate rows first)."""
    h = linear(x, w_gate_up, None)
    return silu(h[..., :hidden]) * h[..., hidden:]


def geglu(x, w_gate_up, hidden: int, approximate: str) -> torch.Tensor:
    """gelu(x @ W_gate^T, approximate) * (x @ W_up^T), w_gate_up = [W_gate; W_up] (Shazeer
    2020, "GLU Variants Improve Transformer": GEGLU; erf or tanh GELU)."""
    h = linear(x, w_gate_up, None)
    return torch.nn.functional.gelu(h[..., :hidden], approximate=approximate) * h[..., hidden:]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX / HF Llama: (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """GPT-J: pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rope(x, cos, sin, layout: str) -> torch.Tensor:
    """x * cos + R(x) * sin in float64, element j using cos[j], sin[j] (full-width tables);
    R = rotate_half for "rotate_half", rotate_every_two for "interleaved"."""
    x = _d(x)
    rotations = {"rotate_half": rotate_half, "interleaved": rotate_every_two}
    if layout not in rotations:
        raise ValueError(f"layout must be one of {tuple(rotations)}, got {layout!r}")
    return x * _d(cos) + rotations[layout](x) * _d(sin)


def rope_qk(q, k, cos, sin, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(q), rope(k)) with the same tables, the order of the op's outputs."""
    return rope(q, cos, sin, layout), rope(k, cos, sin, layout)


def attention_bf16(q, k, v, mask, scale: float, is_causal: bool, shift: bool = True,
                   aten: bool = False, sample: bool = False, tiles: bool = False) -> torch.Tensor:
    """The float64 attention (the bf16 kernel's tolerance covers q, k, v, scores and P rounded;
    ``shift`` / ``aten`` / ``sample`` / ``tiles`` only change where the rounding happens)."""
    return attention(q, k, v, mask, scale, is_causal)


def rope_qk_cache(q, k, v, cos, sin, layout: str, k_cache, v_cache, index):
    """(rope(q), k_cache', v_cache') in float64, nothing written: the caches' float64 copies
    with rope(k) and v copied in at positions ``index`` along dim 2 (``index_copy``)."""
    qo, ko = rope_qk(q, k, cos, sin, layout)
    return qo, _d(k_cache).index_copy(2, index, ko), _d(v_cache).index_copy(2, index, _d(v))
