"""The pattern library: one table of rows (:class:`~opfuse.patterns.engine.Pattern`)."""

from __future__ import annotations

from . import attention, mlp, norms, qkv_merge, rope
from .spellings import SPELLINGS
from .engine import Match, NearMiss, Pattern, find_matches

LIBRARY: list[Pattern] = [*attention.PATTERNS, *qkv_merge.PATTERNS, *norms.PATTERNS, *mlp.PATTERNS, *rope.PATTERNS]

__all__ = ["LIBRARY", "SPELLINGS", "Match", "NearMiss", "Pattern", "find_matches"]
