"""The shared KV tier on Redis (issue 42): a prefix one replica computed, served to another.

Workload: a ~3,000-token document (ShareGPT replies concatenated, cut there) and a question
after it, chat-templated; greedy, 32 output tokens, ignore_eos. SmolLM2-135M-Instruct, dtype
auto (bfloat16 here), block size 16. A real redis-server on a loopback port (maxmemory 1gb,
allkeys-lru). Replica A (a process of its own) answers once, writing the document's blocks
through to the store, and exits. Then, each in a fresh process (two replicas on two machines
are two processes to the store), alternating over --rounds:
- `cold`: no tier: the whole prompt is computed;
- `redis`: replica B on the same store: the document's blocks are read from Redis;
- `disk`: replica B on a local disk tier that A filled the same way (the single-machine tier,
  for scale);
- `pool`: the same engine asked twice, the second answer's TTFT (the document in its own pool:
  the floor any tier approaches).
Each engine first runs one 12-token prompt for 2 tokens (kernels warm, nothing cached). TTFT is
first token time minus arrival. Every setting must give the cold answer's tokens.

    python -m benchmarks shared_tier --out benchmarks/results/shared_tier.json [--rounds 3]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from pagedllm.bench.throughput import in_own_process, save

from benchmarks.kv_tier import _chat_ids, _prose, _tokenizer

DOC_TOKENS = 3000
OUTPUT = 32


def _ask(engine_kw: dict, ids: list[int], times: int = 1) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**engine_kw)
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate([list(range(1000, 1012))], warm, use_tqdm=False)
    runs = []
    for _ in range(times):
        t0 = time.time()
        o = llm.generate([ids], SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True), use_tqdm=False)[0]
        runs.append({"ttft_s": o.metrics["first_token_time"] - t0, "tokens": list(o.outputs[0].token_ids),
                     "cached_tokens": o.num_cached_tokens})
    kv = llm.engine.stats(walk=False).kv
    res = {**runs[-1], "tier_loaded_blocks": kv.tier.loaded_blocks if kv.tier is not None else 0,
           "computed_prompt_tokens": llm.engine.scheduler.counters.computed_prompt_tokens}
    if llm.engine.kv.connector is not None:
        llm.engine.kv.connector.store.flush()
    llm.close()
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from benchmarks.lib.redis_server import RedisServer

    tok = _tokenizer()
    doc = _prose(tok, 42, DOC_TOKENS)
    ids = _chat_ids(tok, [{"role": "system", "content": doc},
                          {"role": "user", "content": "Summarise the text above in one sentence."}])
    base = {"max_model_len": 4096}
    disk = tempfile.mkdtemp(prefix="pagedllm-shared-tier-")
    runs: dict[str, list[dict]] = {"cold": [], "redis": [], "disk": [], "pool": []}
    with RedisServer(maxmemory="1gb") as server:
        settings = {"cold": base, "redis": {**base, "kv_offload_url": server.url},
                    "disk": {**base, "kv_offload_dir": disk}}
        for name in ("redis", "disk"):   # replica A, once per store
            a_run = in_own_process(_ask, settings[name], ids)
            print(f"replica A ({name}): TTFT {a_run['ttft_s'] * 1000:.0f} ms, wrote the document")
        for i in range(a.rounds):
            order = ["cold", "redis", "disk", "pool"] if i % 2 == 0 else ["pool", "disk", "redis", "cold"]
            for name in order:
                r = in_own_process(_ask, base, ids, 2) if name == "pool" else in_own_process(_ask, settings[name], ids)
                runs[name].append(r)
                print(f"round {i + 1} {name}: TTFT {r['ttft_s'] * 1000:.0f} ms, {r['tier_loaded_blocks']} blocks "
                      f"loaded, {r['cached_tokens']} prompt tokens cached")
        info = server.client().info("memory")
    shutil.rmtree(disk, ignore_errors=True)
    want = runs["cold"][0]["tokens"]
    for name, rs in runs.items():
        for r in rs:
            if r["tokens"] != want:
                raise SystemExit(f"{name}: another answer than cold's")
    ttft = {name: statistics.median(r["ttft_s"] for r in rs) for name, rs in runs.items()}
    res = {"benchmark": "shared_tier", "model": "SmolLM2-135M-Instruct", "prompt_tokens": len(ids),
           "output_tokens": OUTPUT, "rounds": a.rounds, "redis_used_memory": info.get("used_memory"),
           "workload": f"a {len(ids)}-token chat prompt (a {DOC_TOKENS}-token document) asked on replica B",
           "runs": {k: [{x: v for x, v in r.items() if x != "tokens"} for r in rs] for k, rs in runs.items()},
           "ttft_s": ttft, "cold_over_redis": ttft["cold"] / ttft["redis"],
           "cold_over_disk": ttft["cold"] / ttft["disk"], "redis_over_pool": ttft["redis"] / ttft["pool"],
           "same_answer": True}
    print(f"TTFT medians: cold {ttft['cold'] * 1000:.0f} ms, redis {ttft['redis'] * 1000:.0f} ms, disk "
          f"{ttft['disk'] * 1000:.0f} ms, own pool {ttft['pool'] * 1000:.0f} ms; cold / redis "
          f"{res['cold_over_redis']:.1f}x, cold / disk {res['cold_over_disk']:.1f}x")
    if a.out:
        save(res, a.out)


if __name__ == "__main__":
    main()
