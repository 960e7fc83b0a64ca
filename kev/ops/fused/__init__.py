"""Fused norms and activations (`norms`, `activations`: Triton) and their reference maths (`reference`)."""
