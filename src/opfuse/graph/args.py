"""Arguments of an ATen FX node by schema name, with defaults filled in.

``aten.gelu(x)`` and ``aten.gelu(x, approximate="none")`` are the same call; the
matcher compares arguments by their schema name so both spellings look alike.
"""

from __future__ import annotations

from torch import fx


def schema_args(node: fx.Node) -> list[tuple[str, object]]:
    """[(schema argument name, value)] for every argument of ``node``'s ATen overload.

    Non-ATen targets (``operator.getitem``) give positional names ``arg0, arg1...``.
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return [(f"arg{i}", a) for i, a in enumerate(node.args)]
    out = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            value = None
        out.append((arg.name, value))
    return out


def arg(node: fx.Node, name: str, default=None):
    """Value of the schema argument ``name`` of ``node``."""
    for n, v in schema_args(node):
        if n == name:
            return v
    return default
