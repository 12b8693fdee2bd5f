"""torch custom ops ``torch.ops.opfuse.*``: the stable interface the rewriter emits.

Each op has a fake (meta) implementation for tracing/compile and dispatches at run time
through the kernel registry on ``x.device.type``. Importing this module registers every
op and imports the CPU kernels (which register themselves).

    opfuse::add_layernorm(Tensor x, Tensor residual, Tensor weight, Tensor? bias, float eps) -> Tensor
    opfuse::add_layernorm_sum(Tensor x, Tensor residual, Tensor weight, Tensor? bias, float eps) -> (Tensor, Tensor)
    opfuse::add_layernorm_bf16(Tensor x, Tensor residual, Tensor weight, Tensor? bias, float eps) -> (Tensor, Tensor)
    opfuse::add_layernorm_bf16_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, Tensor? bias, float eps) -> ()
    opfuse::layernorm_gelu(Tensor x, Tensor weight, Tensor? bias, float eps, str approximate) -> Tensor
    opfuse::linear_bias_gelu(Tensor x, Tensor weight, Tensor bias, str approximate) -> Tensor
    opfuse::linear_residual(Tensor x, Tensor weight, Tensor? bias, Tensor residual) -> Tensor
    opfuse::linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor
    opfuse::linear_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor
    opfuse::linear_blas(Tensor x, Tensor weight, Tensor? bias) -> Tensor
    opfuse::linear_add_layernorm(Tensor x, Tensor weight, Tensor? bias, Tensor residual, Tensor ln_weight, Tensor? ln_bias, float eps) -> Tensor
    opfuse::linear_add_layernorm_sum(Tensor x, Tensor weight, Tensor? bias, Tensor residual, Tensor ln_weight, Tensor? ln_bias, float eps) -> (Tensor, Tensor)
    opfuse::ffn(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2, str approximate, int block_rows) -> Tensor
    opfuse::attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal) -> Tensor
    opfuse::attention_bf16(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal, bool shift=True, bool aten=False, bool sample=False, bool tiles=False) -> Tensor
    opfuse::rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor
    opfuse::add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)
    opfuse::swiglu(Tensor x, Tensor w_gate_up, int hidden) -> Tensor
    opfuse::geglu(Tensor x, Tensor w_gate_up, int hidden, str approximate) -> Tensor
    opfuse::rope(Tensor x, Tensor cos, Tensor sin, str layout) -> Tensor
    opfuse::rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, str layout) -> (Tensor, Tensor)
    opfuse::rope_qk_cache(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, str layout, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor index) -> Tensor
"""

from __future__ import annotations

import torch
from torch import Tensor

from opfuse.kernels import cpu as _cpu  # noqa: F401  (registers the CPU kernels)
from opfuse.kernels._library import LibraryOp
from opfuse.kernels.registry import lookup


def _register_triton() -> str | None:
    """Import the Triton kernels (they register for device "cuda") when CUDA is available and
    triton imports; otherwise return why not. Never raises: importing ops must not fail."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e})"
    from opfuse.kernels import triton as _triton  # noqa: F401  (registers the CUDA kernels)

    return None


TRITON_UNAVAILABLE: str | None = _register_triton()  # None when the Triton backend is registered

SCHEMAS: dict[str, str] = {
    "add_layernorm": "(Tensor x, Tensor residual, Tensor weight, Tensor? bias, float eps) -> Tensor",
    "add_layernorm_sum": "(Tensor x, Tensor residual, Tensor weight, Tensor? bias, float eps) -> (Tensor, Tensor)",
    "add_layernorm_bf16": "(Tensor x, Tensor residual, Tensor weight, Tensor? bias, float eps) -> (Tensor, Tensor)",
    "add_layernorm_bf16_": "(Tensor(a!) x, Tensor(b!) residual, Tensor weight, Tensor? bias, float eps) -> ()",
    "layernorm_gelu": "(Tensor x, Tensor weight, Tensor? bias, float eps, str approximate) -> Tensor",
    "linear_bias_gelu": "(Tensor x, Tensor weight, Tensor bias, str approximate) -> Tensor",
    "linear_residual": "(Tensor x, Tensor weight, Tensor? bias, Tensor residual) -> Tensor",
    "linear_bf16": "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "linear_gemv": "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "linear_blas": "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "linear_add_layernorm": "(Tensor x, Tensor weight, Tensor? bias, Tensor residual, Tensor ln_weight, "
                            "Tensor? ln_bias, float eps) -> Tensor",
    "linear_add_layernorm_sum": "(Tensor x, Tensor weight, Tensor? bias, Tensor residual, Tensor ln_weight, "
                                "Tensor? ln_bias, float eps) -> (Tensor, Tensor)",
    "ffn": "(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2, str approximate, int block_rows) -> Tensor",
    "attention": "(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal) -> Tensor",
    "attention_bf16": "(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal, bool shift=True, bool aten=False, bool sample=False, "
                      "bool tiles=False) -> Tensor",
    "rmsnorm": "(Tensor x, Tensor weight, float eps) -> Tensor",
    "add_rmsnorm": "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    "swiglu": "(Tensor x, Tensor w_gate_up, int hidden) -> Tensor",
    "geglu": "(Tensor x, Tensor w_gate_up, int hidden, str approximate) -> Tensor",
    "rope": "(Tensor x, Tensor cos, Tensor sin, str layout) -> Tensor",
    "rope_qk": "(Tensor q, Tensor k, Tensor cos, Tensor sin, str layout) -> (Tensor, Tensor)",
    "rope_qk_cache": "(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, str layout, Tensor(a!) k_cache, "
                     "Tensor(b!) v_cache, Tensor index) -> Tensor",
}


def _op(name: str):
    """Define ``opfuse::name`` (a ``torch.library.Library`` op, not ``custom_op``: ~40 µs less
    per call; see :mod:`opfuse.kernels._library`)."""
    return LibraryOp.define(name, SCHEMAS[name])


# --- add_layernorm / add_layernorm_sum ------------------------------------------------


@_op("add_layernorm")
def add_layernorm(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    out, _ = lookup("add_layernorm", x.device.type)(x, residual, weight, bias, eps, False)
    return out


@add_layernorm.register_fake
def _(x, residual, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_op("add_layernorm_sum")
def add_layernorm_sum(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    return lookup("add_layernorm", x.device.type)(x, residual, weight, bias, eps, True)


@add_layernorm_sum.register_fake
def _(x, residual, weight, bias, eps):
    like = dict(memory_format=torch.contiguous_format)
    return torch.empty_like(x, **like), torch.empty_like(x, **like)


@_op("add_layernorm_bf16")  # precision="bf16": bf16 GEMM output + float32 residual (kernels/cpu/add_layernorm_bf16.py)
def add_layernorm_bf16(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    return lookup("add_layernorm_bf16", x.device.type)(x, residual, weight, bias, eps)


@add_layernorm_bf16.register_fake
def _(x, residual, weight, bias, eps):
    return x.new_empty(x.shape, dtype=torch.float32), x.new_empty(x.shape, dtype=torch.bfloat16)


@_op("add_layernorm_bf16_")  # the in-place form: results written into x (bf16) and residual (float32)
def add_layernorm_bf16_(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> None:
    lookup("add_layernorm_bf16_", x.device.type)(x, residual, weight, bias, eps)


@add_layernorm_bf16_.register_fake
def _(x, residual, weight, bias, eps):
    return None


# --- layernorm_gelu --------------------------------------------------------------------


@_op("layernorm_gelu")
def layernorm_gelu(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, approximate: str) -> Tensor:
    return lookup("layernorm_gelu", x.device.type)(x, weight, bias, eps, approximate)


@layernorm_gelu.register_fake
def _(x, weight, bias, eps, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --- linear_bias_gelu / linear_residual ------------------------------------------------


@_op("linear_bias_gelu")
def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor, approximate: str) -> Tensor:
    return lookup("linear_bias_gelu", x.device.type)(x, weight, bias, approximate)


@linear_bias_gelu.register_fake
def _(x, weight, bias, approximate):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_op("linear_residual")
def linear_residual(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    return lookup("linear_residual", x.device.type)(x, weight, bias, residual)


@linear_residual.register_fake
def _(x, weight, bias, residual):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# --- linear_bf16 (precision="bf16", decode-size GEMMs) --------------------------------


@_op("linear_bf16")
def linear_bf16(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return lookup("linear_bf16", x.device.type)(x, weight, bias)


@linear_bf16.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_op("linear_gemv")
def linear_gemv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return lookup("linear_gemv", x.device.type)(x, weight, bias)


@linear_gemv.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_op("linear_blas")
def linear_blas(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return lookup("linear_blas", x.device.type)(x, weight, bias)


@linear_blas.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# --- linear_add_layernorm / linear_add_layernorm_sum -----------------------------------
# LayerNorm(x @ weight.T + bias + residual); the _sum op also returns the residual sum.


@_op("linear_add_layernorm")
def linear_add_layernorm(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, ln_weight: Tensor, ln_bias: Tensor | None,
    eps: float,
) -> Tensor:
    out, _ = lookup("linear_add_layernorm", x.device.type)(x, weight, bias, residual, ln_weight, ln_bias, eps, False)
    return out


@linear_add_layernorm.register_fake
def _(x, weight, bias, residual, ln_weight, ln_bias, eps):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_op("linear_add_layernorm_sum")
def linear_add_layernorm_sum(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, ln_weight: Tensor, ln_bias: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor]:
    return lookup("linear_add_layernorm", x.device.type)(x, weight, bias, residual, ln_weight, ln_bias, eps, True)


@linear_add_layernorm_sum.register_fake
def _(x, weight, bias, residual, ln_weight, ln_bias, eps):
    shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


# --- ffn -------------------------------------------------------------------------------


@_op("ffn")
def ffn(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, approximate: str, block_rows: int) -> Tensor:
    return lookup("ffn", x.device.type)(x, w1, b1, w2, b2, approximate, block_rows)


@ffn.register_fake
def _(x, w1, b1, w2, b2, approximate, block_rows):
    return x.new_empty((*x.shape[:-1], w2.shape[0]))


# --- attention -------------------------------------------------------------------------


@_op("attention")
def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, is_causal: bool) -> Tensor:
    return lookup("attention", q.device.type)(q, k, v, mask, scale, is_causal)


@attention.register_fake
def _(q, k, v, mask, scale, is_causal):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@_op("attention_bf16")  # precision="bf16": bf16 GEMMs, float32 softmax (kernels/cpu/attention_bf16.py)
def attention_bf16(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, is_causal: bool,
                   shift: bool = True, aten: bool = False, sample: bool = False, tiles: bool = False) -> Tensor:
    return lookup("attention_bf16", q.device.type)(q, k, v, mask, scale, is_causal, shift, aten, sample, tiles)


@attention_bf16.register_fake
def _(q, k, v, mask, scale, is_causal, shift=True, aten=False, sample=False, tiles=False):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


# --- rmsnorm / add_rmsnorm (Llama) -----------------------------------------------------
# out has dtype promote(x, weight) (HF LlamaRMSNorm multiplies the weight after casting);
# add_rmsnorm returns (out, x + residual), the sum in x's dtype.


@_op("rmsnorm")
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return lookup("rmsnorm", x.device.type)(x, weight, eps)


@rmsnorm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype), memory_format=torch.contiguous_format)


@_op("add_rmsnorm")
def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return lookup("add_rmsnorm", x.device.type)(x, residual, weight, eps)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    like = dict(memory_format=torch.contiguous_format)
    return torch.empty_like(x, dtype=out_dtype, **like), torch.empty_like(x, **like)


# --- swiglu / rope (Llama) -------------------------------------------------------------


@_op("swiglu")
def swiglu(x: Tensor, w_gate_up: Tensor, hidden: int) -> Tensor:
    return lookup("swiglu", x.device.type)(x, w_gate_up, hidden)


@swiglu.register_fake
def _(x, w_gate_up, hidden):
    return x.new_empty((*x.shape[:-1], hidden))


@_op("geglu")
def geglu(x: Tensor, w_gate_up: Tensor, hidden: int, approximate: str) -> Tensor:
    return lookup("geglu", x.device.type)(x, w_gate_up, hidden, approximate)


@geglu.register_fake
def _(x, w_gate_up, hidden, approximate):
    return x.new_empty((*x.shape[:-1], hidden))


@_op("rope")
def rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str) -> Tensor:
    return lookup("rope", x.device.type)(x, cos, sin, layout)


@rope.register_fake
def _(x, cos, sin, layout):
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return x.new_empty(x.shape, dtype=dtype)


@_op("rope_qk")
def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    return lookup("rope_qk", q.device.type)(q, k, cos, sin, layout)


@rope_qk.register_fake
def _(q, k, cos, sin, layout):
    table = torch.promote_types(cos.dtype, sin.dtype)
    return (q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, table)),
            k.new_empty(k.shape, dtype=torch.promote_types(k.dtype, table)))


@_op("rope_qk_cache")
def rope_qk_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, layout: str, k_cache: Tensor,
                  v_cache: Tensor, index: Tensor) -> Tensor:
    """rope(q), with rope(k) and v written into the KV cache at ``index`` (dim 2) in place."""
    return lookup("rope_qk_cache", q.device.type)(q, k, v, cos, sin, layout, k_cache, v_cache, index)


@rope_qk_cache.register_fake
def _(q, k, v, cos, sin, layout, k_cache, v_cache, index):
    from opfuse.kernels.checks import check_rope_qk_cache
    # also called unchecked for an empty first input (LibraryOp): q [B, 0, S, D] would leave
    # k's rows unwritten, so the checks run here too
    check_rope_qk_cache(q, k, v, cos, sin, layout, k_cache, v_cache, index, device_type=q.device.type)
    return q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, torch.promote_types(cos.dtype, sin.dtype)))


# --- warm-up ---------------------------------------------------------------------------


def warm_up() -> None:
    """Call every CPU kernel once on tiny float32 inputs: compiles, or loads from numba's
    on-disk cache (~0.04 s per kernel), so the first real call is not a compile."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g)

    x, res, w, b = r(2, 8), r(2, 8), r(8), r(8)
    lookup("add_layernorm", "cpu")(x, res, w, b, 1e-5, True)
    lookup("add_layernorm", "cpu")(x, res, w, None, 1e-5, False)
    lookup("add_layernorm_bf16", "cpu")(x.to(torch.bfloat16), res, w, b, 1e-5)
    for approximate in ("none", "tanh"):
        lookup("layernorm_gelu", "cpu")(x, w, b, 1e-5, approximate)
        lookup("linear_bias_gelu", "cpu")(x, r(4, 8), r(4), approximate)
        lookup("ffn", "cpu")(x, r(16, 8), r(16), r(8, 16), r(8), approximate, 1)
    lookup("linear_residual", "cpu")(x, r(4, 8), r(4), r(2, 4))
    for rows in (1, 9):  # the GEMV and the oneDNN path
        lookup("linear_bf16", "cpu")(r(rows, 8), r(4, 8).to(torch.bfloat16), r(4))
        lookup("linear_gemv", "cpu")(r(rows, 8), r(4, 8), r(4))
        lookup("linear_blas", "cpu")(r(rows, 8), r(4, 8), r(4))
    for emit_sum in (True, False):
        lookup("linear_add_layernorm", "cpu")(x, r(4, 8), r(4), r(2, 4), r(4), r(4), 1e-5, emit_sum)
    lookup("attention", "cpu")(r(1, 2, 3, 4), r(1, 1, 5, 4), r(1, 1, 5, 4), None, 0.5, False)
    for mask in (None, r(1, 1, 3, 3) > 0):  # serial compilations of the bf16 softmax kernels
        lookup("attention_bf16", "cpu")(r(1, 2, 3, 4), r(1, 2, 3, 4), r(1, 2, 3, 4), mask, 0.5, False)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # one rounding path each
        lookup("rmsnorm", "cpu")(x.to(dtype), w, 1e-6)
        lookup("add_rmsnorm", "cpu")(x.to(dtype), res.to(dtype), w, 1e-6)
    lookup("swiglu", "cpu")(x, r(8, 8), 4)
    for approximate in ("none", "tanh"):
        lookup("geglu", "cpu")(x, r(8, 8), 4, approximate)
    q = r(1, 3, 2, 8)  # [B, S, H, D]
    for layout in ("rotate_half", "interleaved"):  # contiguous and transposed (strided) x
        lookup("rope", "cpu")(q, r(1, 1, 2, 8), r(1, 1, 2, 8), layout)
        lookup("rope", "cpu")(q.transpose(1, 2), r(1, 1, 3, 8), r(1, 1, 3, 8), layout)
        lookup("rope_qk", "cpu")(q.transpose(1, 2), q.transpose(1, 2)[:, :1], r(1, 1, 3, 8), r(1, 1, 3, 8), layout)
        for s in (1, 3):  # by address (one position) and strided
            qs = q[:, :s].transpose(1, 2)
            lookup("rope_qk_cache", "cpu")(qs, qs[:, :1], qs[:, :1], r(1, 1, s, 8), r(1, 1, s, 8), layout,
                                           r(1, 1, 4, 8), r(1, 1, 4, 8), torch.arange(s))
