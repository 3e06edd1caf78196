"""Compute kernels: torch references and Triton kernels. No model knowledge."""
