"""Runs inside OpenVINO GenAI's own venv (it imports nothing of pagedllm): its
ContinuousBatchingPipeline (paged attention on the CPU plugin) over a fixed request list
of token ids, timed twice in one process (cold, then warm), printed as JSON.

    VENV/bin/python openvino_worker.py spec.json
spec: {"ir": dir of `optimum-cli export openvino`, "prompts": [[ids]], "output_lens": [n],
       "kv_cache_precision": "bf16" | "u8" | "f32", "inference_precision": "bf16" | "f32",
       "cache_gb": n, "max_num_batched_tokens": n, "max_num_seqs": n}
"""
import json
import sys
import time


def main() -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    sched = ov_genai.SchedulerConfig()
    sched.cache_size = spec["cache_gb"]
    sched.max_num_batched_tokens = spec["max_num_batched_tokens"]
    sched.max_num_seqs = spec["max_num_seqs"]
    sched.dynamic_split_fuse = True  # chunked prefill mixed with decodes, as ours and vLLM's
    sched.enable_prefix_caching = False  # every pass starts cold, as ours (reset) and vLLM's (reset)
    props = {"KV_CACHE_PRECISION": spec["kv_cache_precision"],
             "INFERENCE_PRECISION_HINT": spec["inference_precision"]}
    t0 = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(spec["ir"], sched, "CPU", props)
    startup = time.perf_counter() - t0
    inputs = [ov.Tensor(np.array([p], dtype=np.int64)) for p in spec["prompts"]]
    configs = []
    for n in spec["output_lens"]:
        g = ov_genai.GenerationConfig()
        g.max_new_tokens, g.min_new_tokens, g.ignore_eos, g.do_sample = n, n, True, False
        configs.append(g)
    passes, first = [], None
    for name in ("cold", "warm"):
        t0 = time.perf_counter()
        outs = pipe.generate(inputs, configs)
        dt = time.perf_counter() - t0
        ids = [list(o.m_generation_ids[0]) for o in outs]
        first = first or ids
        n = sum(len(x) for x in ids)
        passes.append({"pass": name, "elapsed_s": dt, "output_tokens": n, "output_tok_s": n / dt})
    print("PAGEDLLM_RESULT " + json.dumps({"startup_s": startup, "passes": passes, "openvino": ov.__version__,
                                           "genai": ov_genai.__version__, "tokens": first}), flush=True)


if __name__ == "__main__":
    main()
