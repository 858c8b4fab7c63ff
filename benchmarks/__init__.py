"""The benchmarks of PagedLLM (python -m benchmarks --help): comparisons with other engines and analyses."""
