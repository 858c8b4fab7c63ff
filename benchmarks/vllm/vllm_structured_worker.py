"""The structured-outputs benchmark's passes (benchmarks/structured_outputs.py), for any
engine with vLLM's offline interface: `run_passes` and `time_to_first_token` serve ours in
its process and vLLM's here, in vLLM's own venv (this file imports nothing of pagedllm),
where main() prints the results as JSON.

    VENV/bin/python vllm_structured_worker.py spec.json
spec: {"model": dir, "prompts": [[ids]], "batches": [1, 32, 96], "max_tokens": n, "schema": {...},
       "max_model_len": n, "single_runs": k, "ttft_runs": k, "repeats": k}
"""
import json
import statistics
import sys
import time


def run_passes(llm, prompts: list, params, schema: dict, batches: list[int], single_runs: int,
               repeats: int) -> list[dict]:
    """Output tok/s of each batch size, unconstrained and constrained (`params(schema)`), each
    pass `repeats` times interleaved with the other mode (a slow spell of the machine hits
    both), the median reported; batch 1 runs `single_runs` prompts one after another."""
    passes = []
    for batch in batches:
        runs = [[p] for p in prompts[:single_runs]] if batch == 1 else [prompts[:batch]]
        timed = {"unconstrained": [], "constrained": []}
        for _ in range(repeats):
            for mode, constraint in (("unconstrained", None), ("constrained", schema)):
                texts, n, t0 = [], 0, time.perf_counter()
                for group in runs:
                    outs = llm.generate(group, params(constraint), use_tqdm=False)
                    n += sum(len(o.outputs[0].token_ids) for o in outs)
                    texts += [o.outputs[0].text for o in outs]
                timed[mode].append((time.perf_counter() - t0, n, texts))
        for mode, reps in timed.items():  # greedy: every repeat writes the same tokens
            dt = statistics.median(r[0] for r in reps)
            passes.append({"batch": batch, "mode": mode, "elapsed_s": dt, "elapsed_all_s": [r[0] for r in reps],
                           "output_tokens": reps[0][1], "output_tok_s": reps[0][1] / dt, "texts": reps[0][2]})
    return passes


def time_to_first_token(llm, prompt, params, schema: dict, runs: int) -> dict[str, float]:
    """Median seconds of a one-token request with a grammar never seen (a new title: a new
    cache key) and with one compiled before."""
    ttft = {}
    for name, fresh in (("cold", True), ("cached", False)):
        times = []
        if not fresh:  # compiled once, untimed
            llm.generate([prompt], params(dict(schema, title="form"), 1), use_tqdm=False)
        for i in range(runs):
            t0 = time.perf_counter()
            llm.generate([prompt], params(dict(schema, title=f"form {i}" if fresh else "form"), 1), use_tqdm=False)
            times.append(time.perf_counter() - t0)
        ttft[name] = statistics.median(times)
    return ttft


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"], seed=0,
              max_num_seqs=max(spec["batches"], default=8))
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]

    def params(schema, max_tokens=spec["max_tokens"]):
        so = StructuredOutputsParams(json=schema) if schema is not None else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)

    llm.generate(prompts[:2], params(None, 4), use_tqdm=False)  # warm-up, as ours
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+")),
                 use_tqdm=False)
    passes = run_passes(llm, prompts, params, spec["schema"], spec["batches"], spec["single_runs"], spec["repeats"])
    ttft = time_to_first_token(llm, prompts[0], params, spec["schema"], spec["ttft_runs"])
    import torch
    print("PAGEDLLM_RESULT " + json.dumps({"startup_s": startup, "passes": passes, "ttft_s": ttft,
                                           "torch": torch.__version__, "threads": torch.get_num_threads()}),
          flush=True)


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main()
