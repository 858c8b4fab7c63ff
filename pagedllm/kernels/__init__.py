"""Compiled kernels: the CPU library (csrc/) built once per machine and loaded as torch ops."""
from .cpu import cpu_kernels_available, load_ops

__all__ = ["cpu_kernels_available", "load_ops"]
