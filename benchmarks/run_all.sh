#!/usr/bin/env bash
# The commands behind benchmarks/results/ (see BENCHMARKS.md). About 40 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
mkdir -p $R

# 1. Offline throughput on ShareGPT against HF transformers and llama.cpp (needs the llamacpp extra).
pagedllm bench compare --workload sharegpt --num-prompts 100 --max-model-len 2048 \
  --hf-batch-sizes 32,64 --llama-batch 64 --llama-sequential-requests 8 --out $R/compare_sharegpt.json
# ...and llama.cpp again with the continuous-batching harness (HF skipped: it is slow and unchanged).
pagedllm bench compare --workload sharegpt --num-prompts 100 --max-model-len 2048 --skip hf \
  --llama-batch 64 --llama-sequential-requests 8 --out $R/compare_sharegpt_llamacpp.json

# 2. The seed's memory analysis: paged vs reserve-max, prefix sharing, n > 1, block sizes.
pagedllm bench memory --num-prompts 48 --max-output-len 64 --kv-cache-memory 256MiB --max-model-len 2048 \
  --out $R/memory.json | tee $R/memory.txt

# 3. Serving the shared-system-prompt chat: prefix caching on vs off (TTFT).
for mode in enable no-enable; do
  if [ $mode = enable ]; then state=on; else state=off; fi
  pagedllm serve --port 8123 --max-model-len 2048 --$mode-prefix-caching > $R/serve_$mode.log 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 1; done
  pagedllm bench serve --base-url http://127.0.0.1:8123 --workload chat-shared-system --num-prompts 32 \
    --max-output-len 32 --request-rate 1 --label "chat-shared-system, prefix cache $state" \
    --out $R/serve_chat_$mode.json | tee $R/serve_chat_$mode.txt
  kill -TERM $pid; wait $pid
done

# 4. Simulator: LLaMA-13B on a 40 GB A100, ShareGPT lengths, paged vs reserve-max.
pagedllm simulate --config benchmarks/configs/llama-13b.json --gpu-memory 40GiB --dtype float16 \
  --num-prompts 1000 --max-prompt-len 1024 --max-output-len 1024 | tee $R/simulate_llama13b_a100.txt

# 5. Tables and plots.
pagedllm bench report $R/compare_sharegpt.json $R/memory.json $R/serve_chat_enable.json \
  $R/serve_chat_no-enable.json --out-dir $R/report

# 6. The visualizer costs nothing when nobody watches (absent / idle hub / watching, interleaved).
python benchmarks/viz_overhead.py --workload chat-shared-system --num-prompts 48 --rounds 3 \
  --out $R/viz_overhead.json
