"""What a grammar costs inside the step: the structured-outputs benchmark's 32 chat prompts
at batch 32 (greedy, bf16, <= 256 new tokens), unconstrained then with the form schema, in
one engine, with the time spent filling and applying the bitmasks (GrammarMatchers.mask) and
advancing the matchers (GrammarMatchers.advance) summed per step beside the whole step's.

    python -m benchmarks structured_step_cost --out benchmarks/results/structured_step_cost.json
"""
from __future__ import annotations

import argparse
import time

from benchmarks.structured_outputs import MAX_TOKENS, SCHEMA, chat_prompts


def _timed(cls, name: str, acc: dict) -> None:
    """Wrap cls.name so that its seconds add up in acc[name]."""
    fn = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0
    setattr(cls, name, wrapper)


def main() -> None:
    from pagedllm import LLM, SamplingParams, StructuredOutputsParams
    from pagedllm.bench.throughput import save
    from pagedllm.runtime.grammar import GrammarMatchers
    from pagedllm.runtime.model_runner import ModelRunner

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/structured_step_cost.json")
    args = ap.parse_args()
    asks = [{"prompt_token_ids": p} for p in chat_prompts(32)]
    llm = LLM(dtype="bfloat16", max_model_len=2048)
    acc = {"mask": 0.0, "advance": 0.0, "execute": 0.0}
    _timed(GrammarMatchers, "mask", acc)
    _timed(GrammarMatchers, "advance", acc)
    _timed(ModelRunner, "execute", acc)
    llm.generate(asks[:1], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+")),
                 use_tqdm=False)
    rows = []
    for name, schema in (("unconstrained", None), ("constrained", SCHEMA)):
        acc.update(mask=0.0, advance=0.0, execute=0.0)
        so = StructuredOutputsParams(json=schema) if schema is not None else None
        steps0, t0 = llm.engine.steps, time.perf_counter()
        outs = llm.generate(asks, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so),
                            use_tqdm=False)
        dt, steps = time.perf_counter() - t0, llm.engine.steps - steps0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"engine": f"pagedllm, {name}", "mode": name, "output_tokens": n, "steps": steps, "elapsed_s": dt, "output_tok_s": n / dt,
               "tokens_per_step": n / steps, **{f"{k}_ms_per_step": v / steps * 1e3 for k, v in acc.items()}}
        rows.append(row)
        print(f"{name:<14} {row['output_tok_s']:6.1f} out tok/s, {n} tokens in {steps} steps "
              f"({row['tokens_per_step']:.1f} a step), step {row['execute_ms_per_step']:.1f} ms: masks "
              f"{row['mask_ms_per_step']:.2f} ms, matchers {row['advance_ms_per_step']:.2f} ms")
    save({"workload": "32 form-filling chat prompts, batch 32, greedy, bf16", "results": rows,
          "runner": llm.engine.runner.describe()}, args.out)


if __name__ == "__main__":
    main()
