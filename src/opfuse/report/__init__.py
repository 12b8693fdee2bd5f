"""Fusion reports: the data (:class:`FusionReport`) and its renderings (rich text)."""

from .data import FusionReport

__all__ = ["FusionReport"]
