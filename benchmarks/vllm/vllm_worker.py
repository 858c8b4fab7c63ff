"""Runs inside vLLM's own venv (it imports nothing of pagedllm): offline generation of a
fixed request list, timed twice in one process (cold, then warm), printed as JSON.

    VENV/bin/python vllm_worker.py spec.json
spec: {"model": dir, "prompts": [[ids]], "output_lens": [n], "max_model_len": n, "dtype": "bfloat16"}
With "beam_width": k in the spec it times LLM.beam_search instead (max_tokens: the
longest output length, EOS ignored) and counts the returned beams' generated tokens.
With "loras": [PEFT dirs] and "lora_of": [adapter index or null per prompt] (and
"max_lora_rank") it runs with enable_lora, max_loras = the number of adapters, each prompt
under its adapter.
"""
import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    loras = spec.get("loras") or []
    lora_kw = {"enable_lora": True, "max_loras": len(loras), "max_lora_rank": spec.get("max_lora_rank", 16)} \
        if loras else {}
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_model_len=spec["max_model_len"],
              seed=0, enable_prefix_caching=spec.get("enable_prefix_caching", True),
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), enforce_eager=spec.get("enforce_eager", False),
              **lora_kw)
    requests = None
    if loras:
        from vllm.lora.request import LoRARequest

        adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(loras)]
        requests = [None if i is None else adapters[i] for i in spec["lora_of"]]
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
    passes = []
    for name in ("cold", "warm"):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        if spec.get("beam_width"):
            n = beam_search(llm, spec)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
        dt = time.perf_counter() - t0
        passes.append({"pass": name, "elapsed_s": dt, "output_tokens": n, "output_tok_s": n / dt})
    import torch
    print("PAGEDLLM_RESULT " + json.dumps({"startup_s": startup, "passes": passes, "torch": torch.__version__,
                                           "threads": torch.get_num_threads()}), flush=True)


def beam_search(llm, spec: dict) -> int:
    from vllm.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=spec["beam_width"], max_tokens=max(spec["output_lens"]), ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in spec["prompts"]], params)
    return sum(len(s.tokens) - len(p) for o, p in zip(outs, spec["prompts"]) for s in o.sequences)


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main()
