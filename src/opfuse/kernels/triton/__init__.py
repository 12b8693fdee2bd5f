"""Triton kernels for CUDA tensors. Importing this package registers every kernel under
device type "cuda" (ops.py imports it only when triton imports and CUDA is available;
the CPU test tier imports it in a subprocess with TRITON_INTERPRET=1).

One kernel per file, same anatomy as cpu/: ``_<name>_fwd_kernel`` (@triton.jit) ->
``config(...)`` (the launch configuration, also compiled ahead of time by ``aot.py``) ->
launcher registered with ``register(key, "cuda")`` taking the CPU launcher's arguments.
"""

from opfuse.kernels.triton import (  # noqa: F401  (imported for their @register side effect)
    add_layernorm,
    attention,
    ffn,
    layernorm_gelu,
    linear_add_layernorm,
    linear_bias_gelu,
    linear_residual,
    rope,
)
