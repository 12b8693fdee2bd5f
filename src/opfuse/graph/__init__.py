"""Capture and canonicalisation of ATen FX graphs (knows no patterns)."""
