"""The engines people would otherwise pick, on the same model and workload:
HF transformers `generate` (static batches, padding, contiguous KV) and llama.cpp
(llama-cpp-python, an optional extra: its high-level API one request at a time, and
continuous batching over sequence slots through the low-level llama_batch API)."""
from __future__ import annotations

import os
import time

from pagedllm.bench.sharegpt import BenchRequest


def hf_generate(reqs: list[BenchRequest], model_dir, dtype: str, batch_size: int, warmup: bool = True) -> dict:
    """Static batches in arrival order, left padding; each batch runs to its longest
    output. Only each request's own output tokens are credited, counted from what
    generate returned. warmup=False skips the untimed first call (tests)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if warmup:
        with torch.inference_mode():  # warm up, as the engine is
            model.generate(input_ids=torch.full((batch_size, 16), 1000), max_new_tokens=4, do_sample=False,
                           pad_token_id=pad)
    out_tok = 0
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        ids = [r.prompt if isinstance(r.prompt, list) else tok.encode(r.prompt, add_special_tokens=False)
               for r in chunk]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        new = max(r.output_len for r in chunk)
        with torch.inference_mode():
            seqs = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=pad)
        # min_new_tokens keeps EOS out, so every row ran `new` steps; credit each its own length
        out_tok += sum(min(r.output_len, seqs.shape[1] - width) for r in chunk)
    dt = time.perf_counter() - t0
    return _result(f"hf-transformers bs={batch_size}", reqs, dt, output_tokens=out_tok, batch_size=batch_size,
                   dtype=dtype)


def hf_generate_batch(reqs: list[BenchRequest], model_dir, dtype: str, warmup: bool = True) -> dict:
    """HF transformers' continuous batching (`generate_batch`'s manager over its paged
    cache, SDPA attention), each request with its own max_new_tokens, EOS ignored.
    warmup=False skips the untimed first call (tests)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen = GenerationConfig(max_new_tokens=max(r.output_len for r in reqs), do_sample=False, pad_token_id=pad,
                           eos_token_id=tok.eos_token_id)
    ids = [r.prompt if isinstance(r.prompt, list) else tok.encode(r.prompt, add_special_tokens=False)
           for r in reqs]
    if warmup:
        with torch.inference_mode():  # warm up, as the engine is
            model.generate_batch([ids[0][:16]] * 4, generation_config=gen, max_new_tokens=4)
    t0 = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        for x, r in zip(ids, reqs):
            manager.add_request(x, max_new_tokens=r.output_len, eos_token_id=-1)  # -1: no token ends it
        done, out_tok = 0, 0
        while done < len(reqs):
            res = manager.get_result(timeout=600)
            if res is None:
                raise RuntimeError("HF continuous batching returned nothing for 10 minutes")
            if res.is_finished():
                done += 1
                out_tok += len(res.generated_tokens)
    finally:
        manager.stop(block=True)
    dt = time.perf_counter() - t0
    r = _result("hf-transformers generate_batch (continuous)", reqs, dt, dtype=dtype)
    r["generated_tokens"] = out_tok
    return r


def llama_cpp_available() -> str | None:
    """None if llama-cpp-python imports, else why not (for a clean skip)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or a broken native build
        return f"llama-cpp-python is not installed ({type(e).__name__}: {e}); pip install '.[llamacpp]'"
    return None


def _llama(gguf: str, n_ctx: int, n_seq_max: int = 1, n_batch: int = 512, threads: int | None = None):
    from llama_cpp import Llama

    kw = dict(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads or os.cpu_count(),
              verbose=False)
    if n_seq_max > 1:
        kw["n_seq_max"] = n_seq_max
    return Llama(**kw)


def _tokens(llm, r: BenchRequest) -> list[int]:
    if isinstance(r.prompt, list):
        return list(r.prompt)
    return llm.tokenize(r.prompt.encode(), add_bos=False, special=True)


def llama_cpp_sequential(reqs: list[BenchRequest], gguf: str) -> dict:
    """High-level API, one request at a time (what llama.cpp's simple server loop does)."""
    max_len = max(r.prompt_len + r.output_len for r in reqs) + 8
    llm = _llama(gguf, n_ctx=max_len)
    t0 = time.perf_counter()
    for r in reqs:
        llm.reset()
        n = 0
        for _ in llm.generate(_tokens(llm, r), temp=0.0, reset=True):
            n += 1  # ignore_eos: the generator runs until we stop it
            if n >= r.output_len:
                break
    return _result("llama.cpp high-level, sequential", reqs, time.perf_counter() - t0, quant="Q4_1 GGUF")


def llama_cpp_batched(reqs: list[BenchRequest], gguf: str, batch_size: int = 64) -> dict:
    """Continuous batching over `batch_size` llama.cpp sequence slots, as llama-server
    does with --parallel: every llama_decode call carries one token per live slot plus
    the prompts of requests just admitted into free slots; a finished slot's KV is
    dropped and the next request takes it. Greedy."""
    import llama_cpp as lc
    import numpy as np

    # Each slot gets its own slice of the context (kv_unified off), sized for the
    # longest request: attention then spans a sequence's own cells, not every slot's.
    per_seq = max(r.prompt_len + r.output_len for r in reqs) + 16
    n_batch = max(512, batch_size + max(r.prompt_len for r in reqs))
    llm = _llama(gguf, n_ctx=256)  # the model and its tokenizer; the context is ours
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = per_seq * batch_size, n_batch, 512
    params.n_seq_max = batch_size
    params.n_threads = params.n_threads_batch = os.cpu_count() or 1
    if hasattr(params, "kv_unified"):
        params.kv_unified = False
    if hasattr(params, "flash_attn_type"):  # measured here: ~10 % faster decode than off or auto
        params.flash_attn_type = 1
    ctx = lc.llama_init_from_model(llm.model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    mem = lc.llama_get_memory(ctx)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm.model))
    batch = lc.llama_batch_init(n_batch, 0, 1)
    queue = [(_tokens(llm, r), r.output_len) for r in reqs]
    queue.reverse()  # pop() from the end takes them in order

    def decode(items: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """items: (token, pos, slot, want_logits); returns the wanted rows' logits."""
        batch.n_tokens = len(items)
        for j, (t, p, s, want) in enumerate(items):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, p, 1
            batch.seq_id[j][0] = s
            batch.logits[j] = want
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (context too small?)")
        n_out = sum(1 for it in items if it[3])
        return np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n_out * n_vocab,)).reshape(n_out, n_vocab)

    t0 = time.perf_counter()
    try:
        # slot -> [next token, position, tokens still to produce]; None for a free slot
        slots: list[list[int] | None] = [None] * batch_size
        while queue or any(slots):
            items, order = [], []
            for s, st in enumerate(slots):
                if st is not None:
                    items.append((st[0], st[1], s, True))
                    order.append(s)
            for s in range(batch_size):  # admit into free slots while the batch has room
                if slots[s] is None and queue and len(items) + len(queue[-1][0]) <= n_batch:
                    toks, out_len = queue.pop()
                    lc.llama_memory_seq_rm(mem, s, -1, -1)
                    items += [(t, p, s, p == len(toks) - 1) for p, t in enumerate(toks)]
                    slots[s] = [0, len(toks) - 1, out_len]
                    order.append(s)
            nxt = decode(items).argmax(axis=1)
            for s, tok in zip(order, nxt.tolist()):
                st = slots[s]
                st[0], st[1], st[2] = tok, st[1] + 1, st[2] - 1
                if st[2] <= 0:
                    slots[s] = None
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    return _result(f"llama.cpp batched llama_batch bs={batch_size}", reqs, time.perf_counter() - t0,
                   batch_size=batch_size, quant="Q4_1 GGUF")


def _result(engine: str, reqs: list[BenchRequest], dt: float, output_tokens: int | None = None, **extra) -> dict:
    """output_tokens: those the engine returned, where it says (None: the requested lengths)."""
    out_tok = sum(r.output_len for r in reqs) if output_tokens is None else output_tokens
    prompt_tok = sum(r.prompt_len for r in reqs)
    return {"engine": engine, "num_requests": len(reqs), "elapsed_s": dt, "requests_per_s": len(reqs) / dt,
            "output_tokens": out_tok, "prompt_tokens": prompt_tok, "output_tok_s": out_tok / dt,
            "total_tok_s": (out_tok + prompt_tok) / dt, **extra}


def single_against_llama_cpp(llama_single, gguf: str, ids: list[int], new: int, runs: list[tuple]) -> dict:
    """One request on `gguf`: `llama_single(gguf, ids, new)` (llama.cpp's decode, in its own
    process), then each of our runs (a function, its arguments and, optionally, keyword
    arguments; in its own process), each with its decode_ratio to llama.cpp's."""
    from pagedllm.bench.throughput import in_own_process

    theirs = in_own_process(llama_single, gguf, ids, new)
    out = {"prompt_tokens": len(ids), "new_tokens": new, "llama_cpp": theirs, "ours": []}
    for fn, args, *kw in runs:
        ours = in_own_process(fn, *args, **(kw[0] if kw else {}))
        ours["decode_ratio"] = ours["decode_tok_s"] / theirs["decode_tok_s"]
        out["ours"].append(ours)
        print(f"single: {ours['engine']} {ours['decode_tok_s']:.1f} tok/s decode; llama.cpp "
              f"{theirs['decode_tok_s']:.1f}: {ours['decode_ratio']:.2f}x")
    return out


def batch_against_llama_cpp(reqs: list[BenchRequest], gguf: str, quant: str, runs: list[tuple]) -> dict:
    """`reqs` on `gguf` ("quant": what the file holds, for the record): llama.cpp's continuous
    batching over 32 slots and its one-at-a-time API, each in its own process, then each of our
    runs (as single_against_llama_cpp's), each with its ratio to llama.cpp's better mode."""
    from pagedllm.bench.throughput import in_own_process

    batched = in_own_process(llama_cpp_batched, reqs, gguf, 32)
    seq = in_own_process(llama_cpp_sequential, reqs, gguf)
    for r in (batched, seq):
        r["quant"] = quant
    best = max(batched["output_tok_s"], seq["output_tok_s"])
    out = {"llama_cpp_batched": batched, "llama_cpp_sequential": seq, "ours": []}
    for fn, args, *kw in runs:
        ours = in_own_process(fn, *args, **(kw[0] if kw else {}))
        ours["ratio_vs_best_llama_cpp"] = ours["output_tok_s"] / best
        out["ours"].append(ours)
        print(f"batch: {ours['engine']} {ours['output_tok_s']:.1f} tok/s; llama.cpp batched "
              f"{batched['output_tok_s']:.1f}, sequential {seq['output_tok_s']:.1f}: "
              f"{ours['ratio_vs_best_llama_cpp']:.2f}x the best")
    return out
