"""Cost model: memory traffic, FLOPs, roofline time and the fusion decision."""
