"""Kernel registry: (kernel key, device type) -> launcher.

Backends register launchers; callers look them up by the tensor's ``device.type``, so no
kernel ever branches on the device.

    @register("add_layernorm", "cpu")
    def add_layernorm(...): ...

    lookup("add_layernorm", x.device.type)(x, ...)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

Key = tuple[str, str]  # (kernel_key, device_type)


class KernelRegistry(Mapping[Key, Callable[..., Any]]):
    """A read-only mapping plus ``register``; re-registering the same function is allowed
    (module reload), registering a different one under a taken key is an error."""

    def __init__(self) -> None:
        self._kernels: dict[Key, Callable[..., Any]] = {}

    def __getitem__(self, key: Key) -> Callable[..., Any]:
        return self._kernels[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._kernels)

    def __len__(self) -> int:
        return len(self._kernels)

    def register(self, key: str, device_type: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            old = self._kernels.get((key, device_type))
            if old is not None and _qualified(old) != _qualified(fn):
                raise ValueError(f"opfuse: {key} kernel for device {device_type} already registered as {_qualified(old)}")
            self._kernels[(key, device_type)] = fn
            return fn

        return decorator

    def lookup(self, key: str, device_type: str) -> Callable[..., Any]:
        try:
            return self._kernels[(key, device_type)]
        except KeyError:
            raise NotImplementedError(f"opfuse: no {key} kernel for device {device_type}") from None


def _qualified(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


REGISTRY = KernelRegistry()
register = REGISTRY.register
lookup = REGISTRY.lookup
