"""CPU kernels (numba + BLAS + ATen). Importing this package registers every CPU kernel."""

from opfuse.kernels.cpu import (  # noqa: F401  (imported for their @register side effect)
    add_layernorm,
    add_layernorm_bf16,
    add_rmsnorm,
    attention,
    attention_bf16,
    ffn,
    geglu,
    layernorm_gelu,
    linear_add_layernorm,
    linear_bf16,
    linear_bias_gelu,
    linear_blas,
    linear_gemv,
    linear_residual,
    rmsnorm,
    rope,
    rope_cache,
    swiglu,
)
