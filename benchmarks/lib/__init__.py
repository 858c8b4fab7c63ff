"""What the benchmarks share: the other engines' runners (HF, llama.cpp, vLLM), the comparisons, plots."""
