"""Where a decode step goes: the engine is brought to a steady decode of --batch ShareGPT
requests, then --steps steps run under torch's profiler. Op times are grouped (matmul,
attention, norms, RoPE, SiLU, sampling, the rest); what the ops do not cover is Python:
scheduling, the KV manager, building the step's tensors.

    python -m benchmarks step_profile --batch 96 --out benchmarks/results/step_profile.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.provenance import provenance
from pagedllm.bench.workloads import sharegpt_truncated

GROUPS = [  # first match wins
    ("matmul", ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "mkldnn::_linear_pointwise",
                "pagedllm_cpu::panel_linear", "pagedllm_cpu::panel_argmax")),
    ("attention", ("pagedllm_cpu::paged_attention", "pagedllm_cpu::write_kv", "scaled_dot_product", "index_select",
                   "index_copy")),
    ("norms", ("rms_norm",)),
    ("rope", ("pagedllm_cpu::rope",)),
    ("silu", ("silu",)),
    ("sampling", ("pagedllm_cpu::sample", "aten::max", "aten::topk", "aten::sort", "log_softmax", "exponential",
                  "aten::argmax")),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other ops"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--out", default="results/step_profile.json")
    args = ap.parse_args()
    reqs = sharegpt_truncated(args.batch, args.max_prompt_len, 1000, fixed_output_len=1000)
    llm = LLM(dtype="bfloat16", attention_backend=args.attention_backend, max_model_len=2048)
    eng = llm.engine
    for i, r in enumerate(reqs):
        eng.add_request(str(i), r.prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True,
                                                          temperature=args.temperature, seed=i))
    while eng.scheduler.waiting or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()  # prefill everyone
    for _ in range(5):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    step_s = (time.perf_counter() - t0) / args.steps
    with torch.profiler.profile() as prof:
        for _ in range(args.steps):
            eng.step()
    groups: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        groups[group_of(e.key)] += e.self_cpu_time_total / 1e6 / args.steps
    ops = sum(groups.values())
    ctx = sum(len(s.token_ids) for s in eng.scheduler.running) / max(1, len(eng.scheduler.running))
    print(f"decode step: {step_s * 1e3:.1f} ms for {len(eng.scheduler.running)} sequences, mean context {ctx:.0f} "
          f"tokens ({eng.runner.describe()})")
    rows = {g: t for g, t in sorted(groups.items(), key=lambda kv: -kv[1])}
    rows["python (scheduler, KV manager, step tensors)"] = max(0.0, step_s - ops)
    for g, t in rows.items():
        print(f"  {g:<48}{t * 1e3:8.1f} ms  {t / step_s:6.1%}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "provenance": provenance(), "step_ms": step_s * 1e3, "mean_context": ctx,
                   "batch": len(eng.scheduler.running), "groups_ms": {g: t * 1e3 for g, t in rows.items()}}, f,
                  indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
