"""Fused kernels: eager oracles, the backend registry, torch custom ops, CPU kernels."""
