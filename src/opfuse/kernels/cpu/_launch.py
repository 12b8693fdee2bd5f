"""Launcher plumbing shared by the CPU kernels: float32 staging, threads (argument checks:
``opfuse.kernels.checks``).

A launcher turns torch tensors into float32 C-contiguous numpy views (zero-copy when the
input already is one, else exactly one conversion pass), so every numba kernel sees one
type signature and compiles once.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from opfuse.kernels import checks

# numba's default "omp" threading layer shares libgomp with torch: launching a parallel
# kernel resets the OpenMP thread count that torch.set_num_threads chose (measured: torch
# went from 1 back to 2 threads after the first opfuse kernel, and a 1-thread isfinite on
# [128, 768] from 0.42 ms to 3.8 ms on a loaded 2-core machine). numba's own "workqueue"
# pool leaves torch's OpenMP state alone. Must be set before the first parallel launch.
if numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "workqueue"


def check_tensor(op: str, name: str, t: object, ndim_min: int = 1) -> torch.Tensor:
    """Raise ValueError unless ``t`` is a CPU tensor of a supported float dtype."""
    return checks.check_tensor(op, name, t, ndim_min, device_type="cpu")


def f32(t: torch.Tensor) -> torch.Tensor:
    """Detached float32 C-contiguous tensor; no copy when ``t`` already is one.

    ``Tensor.to(dtype, memory_format=...)`` returns ``t`` itself when the dtype already
    matches, strides and all, so a strided float32 input is made contiguous explicitly: its
    numpy view would otherwise reach numba as a non-contiguous array, whose loops compile
    unvectorised (measured: the prefill LM head of a Llama at batch 4, ``x[:, -1, :]`` into
    :func:`opfuse.kernels.cpu.linear_gemv.linear_gemv`, 63.8 ms against 3.6 ms contiguous;
    Zen 4, one thread)."""
    if t.dtype is torch.float32:
        return t.detach() if t.is_contiguous() else t.detach().contiguous()  # the common case: no dispatch (~1 µs)
    return t.detach().to(dtype=torch.float32, memory_format=torch.contiguous_format)  # one converting copy


def f32_rows(t: torch.Tensor, n: int) -> np.ndarray:
    """[..., n] tensor -> [M, n] float32 C-contiguous numpy view (reshaped in numpy:
    ~2 µs less per call than torch's reshape)."""
    return f32(t).numpy().reshape(-1, n)


def f32_vec(t: torch.Tensor | None, n: int) -> np.ndarray:
    """[n] tensor -> [n] float32 numpy; None -> zeros (a bias that adds nothing)."""
    if t is None:
        return np.zeros(n, dtype=np.float32)
    return f32(t).numpy()


def to_torch(a: np.ndarray, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A float32 kernel output as a tensor of ``shape`` and ``dtype``, without a copy when
    ``dtype`` is float32 (reshaped in numpy first: torch's ``view`` costs ~4 µs a call)."""
    out = torch.from_numpy(a.reshape(shape))
    return out if dtype is torch.float32 else out.to(dtype)


def by_address(*tensors: torch.Tensor) -> bool:
    """Every tensor is float32 and contiguous, and this call runs serially (torch on one
    thread, or fewer than :data:`PARALLEL_MIN_WORK` elements in ``tensors[0]``): a
    launcher may then hand the kernel their addresses (``data_ptr``, read in numba with
    :func:`opfuse.kernels.cpu._math.f32_at`) and allocate its outputs with ``torch.empty``
    — no ``.numpy()`` views, no reshape, no wrap back (a one-row add+RMSNorm launcher: 35
    → 24 µs around a 1.7 µs kernel). The tensors must stay referenced until the kernel
    returns (the launcher's locals are)."""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_contiguous():
            return False
    return torch.get_num_threads() == 1 or tensors[0].numel() < PARALLEL_MIN_WORK


PARALLEL_MIN_WORK = 1 << 16  # elements; below this a parallel launch costs more than it saves
_SERIAL: dict = {}


def launch(kernel, work: int):
    """The ``prange`` kernel to run for ``work`` elements: its serial compilation (same
    Python source and fast-math flags, ``parallel=False``) when torch runs on one thread or the work is small
    — a parallel launch costs ~50–70 µs here, more than a small row-wise kernel — else the
    parallel one with numba's thread count synced to torch's."""
    if torch.get_num_threads() == 1 or work < PARALLEL_MIN_WORK:
        serial = _SERIAL.get(kernel)
        if serial is None:
            flags = {k: v for k, v in kernel.targetoptions.items() if k == "fastmath"}  # the kernel's own
            serial = _SERIAL[kernel] = numba.njit(error_model="numpy", cache=True, **flags)(kernel.py_func)
        return serial
    sync_threads()
    return kernel


def sync_threads() -> None:
    """Give numba's prange the same thread budget as torch (cheap; called per launch)."""
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
