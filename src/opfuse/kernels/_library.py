"""Defining ``torch.ops.opfuse.*`` with ``torch.library.Library`` (one Python kernel under
``CompositeExplicitAutograd``) instead of ``torch.library.custom_op``.

Why: measured on this project's CPU machines, ``custom_op``'s Python wrapper costs ~40 µs
per call more than a plain ``Library.impl`` kernel (add_layernorm on [128, 384] float32,
no_grad: 215 µs vs 174 µs), which is most of the gain of a fused norm on small inputs
(the MiniLM demo makes ~30 fused calls per forward).

What custom_op gave and this keeps:
* schema and ``torch.ops.opfuse.<name>.default`` overloads (FX graphs call those);
* fake (meta) implementations via :func:`torch.library.register_fake`, so torch.export,
  FakeTensor propagation and ``torch.compile`` trace the ops;
* empty inputs (a batch, sequence or feature dim of 0) return empty outputs of the fake
  implementation's shapes and dtypes, as eager's ops do, instead of reaching a kernel;
* no silent wrong gradients: opfuse ops are inference-only, and a call that autograd
  would have to differentiate (grad mode on and a tensor input that requires grad) raises
  :class:`RuntimeError` naming the op, instead of the autograd fallback's warning.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LIB = torch.library.Library("opfuse", "DEF")  # noqa: TOR901  (ops live as long as the process)


def _needs_grad(args) -> bool:
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return False


def _empty_input(args) -> bool:
    """The op's first tensor argument (x, q) has no elements: every output is empty too (a
    batch, sequence or feature dim of 0), and the kernels' row loops would index row 0."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.numel() == 0
    return False


class LibraryOp:
    """``@LibraryOp.define(name, schema)`` on a Python function: defines ``opfuse::name``,
    registers the function as its kernel for every backend, and offers ``register_fake``
    like a ``custom_op`` does. Calling the object calls the op."""

    #: name -> LibraryOp, every op defined (for :meth:`direct`).
    BY_NAME: dict[str, LibraryOp] = {}

    def __init__(self, name: str, schema: str, fn: Callable):
        self.name = name
        self._fn = fn
        LIB.define(f"{name}{schema}")
        LibraryOp.BY_NAME[name] = self

        self._fake: Callable | None = None

        def kernel(*args):
            if _needs_grad(args):
                raise RuntimeError(f"opfuse::{name} is inference-only (no backward): called with grad mode on "
                                   "and an input that requires grad; use torch.no_grad() or the unfused model")
            if self._fake is not None and _empty_input(args):
                return self._fake(*args)  # empty in, empty out: the fake's shapes and dtypes, as real tensors
            return fn(*args)

        LIB.impl(name, kernel, "CompositeExplicitAutograd")
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        entry = getattr(torch.ops.opfuse, name).default._op
        profiling = torch._C._autograd._profiler_enabled  # ~0.1 µs

        def direct(*args):
            # the dispatcher's round trip into ``kernel`` (boxing, the Python frame) costs ~14 µs
            # a call on one-row decode inputs; a profiled run still dispatches (the op appears
            # under its name); ``kernel`` itself refuses what needs grad and answers empty inputs
            return entry(*args) if profiling() else kernel(*args)
        self._direct = direct

    @classmethod
    def define(cls, name: str, schema: str) -> Callable[[Callable], LibraryOp]:
        return lambda fn: cls(name, schema, fn)

    @property
    def default(self):
        return getattr(torch.ops.opfuse, self.name).default

    def register_fake(self, fake: Callable) -> Callable:
        """Register ``fake`` (output shapes and dtypes), preceded by the op's argument check
        (:data:`opfuse.kernels.checks.OP_CHECKS`): a fake run raises the ``ValueError`` the
        kernel would raise, which is what legality relies on."""
        from opfuse.kernels.checks import OP_CHECKS
        check = OP_CHECKS[self.name]

        def checked(*args):
            device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
            check(*args, device_type=device)
            return fake(*args)

        torch.library.register_fake(f"opfuse::{self.name}", checked, lib=LIB)
        self._fake = fake
        return fake

    def __call__(self, *args):
        return self.default(*args)

    @property
    def direct(self) -> Callable:
        """The op's kernel called from Python without the dispatcher: the same checks (an
        input that needs grad, empty inputs) and result as ``torch.ops.opfuse.<name>.default``;
        what plans bind (:func:`opfuse.rewrite.bind_op_builtins`)."""
        return self._direct
