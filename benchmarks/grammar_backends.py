"""Why xgrammar: the two grammar libraries vLLM ships for structured outputs, measured on
our tokenizer (SmolLM2, 49,152 tokens) and the benchmark's form schema, single-threaded
beside each other in one process: compile time, the token-mask fill per token while
walking a valid document, the fill of 32 matchers per step (what our batched step does),
and the compile of a 20,000-value enum (a hostile schema's cost).

    python -m benchmarks grammar_backends --out benchmarks/results/grammar_backends.json
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import time

from benchmarks.structured_outputs import SCHEMA

DOC = {"title": "Integrating questions", "summary": "Students ask, teachers answer.", "language": "english",
       "category": "question", "sentiment": "positive", "ticket": "AB-1234", "keywords": ["school", "questions"],
       "urgency": 3, "confidence": 0.75, "needs_reply": True}
HUGE_ENUM = {"enum": [f"value-{i}" for i in range(20000)]}
BATCH = 32


def _timed(fn, repeat: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def xgrammar_figures(tok) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    text = json.dumps(DOC)  # xgrammar's compact JSON: ", " and ": "
    ids = tok.encode(text, add_special_tokens=False)
    compile_s = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False), 3)
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    bitmask = xgr.allocate_token_bitmask(BATCH, info.vocab_size)

    def walk(matchers):
        for t in ids:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
                assert m.accept_token(t)
    one = _timed(lambda: walk([xgr.GrammarMatcher(grammar)])) / len(ids)
    batch = _timed(lambda: walk([xgr.GrammarMatcher(grammar) for _ in range(BATCH)])) / len(ids)
    huge = _timed(lambda: compiler.compile_json_schema(json.dumps(HUGE_ENUM)))
    return {"version": importlib.metadata.version("xgrammar"), "compile_s": compile_s, "fill_per_token_s": one,
            f"fill_{BATCH}_per_step_s": batch, "huge_enum_compile_s": huge}


def llguidance_figures(tok) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    text = json.dumps(DOC, separators=(",", ":"))  # llguidance's compact JSON
    ids = tok.encode(text, add_special_tokens=False)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    compile_s = _timed(lambda: llguidance.LLMatcher(lltok, grammar), 3)  # it compiles lazily, as it walks
    bitmask = lt.allocate_token_bitmask(BATCH, len(tok))

    def walk(matchers):
        for t in ids:
            for i, m in enumerate(matchers):
                lt.fill_next_token_bitmask(m, bitmask, i)
                assert m.consume_token(t), m.get_error()
    one = _timed(lambda: walk([llguidance.LLMatcher(lltok, grammar)])) / len(ids)
    batch = _timed(lambda: walk([llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)])) / len(ids)

    def huge():
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(HUGE_ENUM)))
        lt.fill_next_token_bitmask(m, bitmask, 0)
    return {"version": importlib.metadata.version("llguidance"),
            "compile_s": compile_s, "fill_per_token_s": one, f"fill_{BATCH}_per_step_s": batch,
            "huge_enum_compile_s": _timed(huge)}


def main() -> None:
    from pagedllm.bench.throughput import save
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/grammar_backends.json")
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model_dir(None))
    rows = {"xgrammar": xgrammar_figures(tok), "llguidance": llguidance_figures(tok)}
    for name, r in rows.items():
        print(f"{name:<10} compile {r['compile_s'] * 1e3:7.2f} ms, fill {r['fill_per_token_s'] * 1e6:6.1f} us/token, "
              f"{BATCH} rows {r[f'fill_{BATCH}_per_step_s'] * 1e3:5.2f} ms/step, "
              f"20k-value enum {r['huge_enum_compile_s']:.2f} s")
    save({"tokenizer": "SmolLM2-135M-Instruct", "schema": SCHEMA, "results": rows}, args.out)


if __name__ == "__main__":
    main()
