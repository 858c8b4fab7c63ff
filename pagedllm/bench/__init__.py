"""Workloads and baselines for benchmarks."""
