"""The KV tier (issue 28): the prefix cache's disk tier, swap preemption and LPM admission,
each against what it replaces, every engine configuration in a process of its own.

1. rag: one ~6,000-token document (ShareGPT replies concatenated) and 100 questions about it
   (chat template: the document, then one short question), in 10 bursts of 10. Between bursts,
   ShareGPT prompts (long ones truncated to 512 tokens, 16 output tokens) run through the same
   engine, 1.1 pools' worth of blocks, so that the document leaves a pool of 1.6x its blocks
   (salted per setting: unrelated traffic, never a hit on another run's blocks). Settings:
   `pool` (no tier); `tier` (a fresh tier, write-through); `restart_cold` (a new process on the
   tier `tier` left, its files first dropped from the OS page cache with posix_fadvise, as after
   a reboot; first burst only); `restart` (a new process on that tier, page cache as it is);
   `llamacpp_slot`: llama.cpp (llama-cpp-python, the same GGUF at Q4_1) computes the document's
   state once and persists it, as llama-server's slot save (llama_state_seq_save_file) and as
   Llama.save_state() pickled; a fresh process loads it and answers one question, against a
   fresh process recomputing the document.
   Per setting: TTFT mean and P99 over the questions, the first answer's TTFT (cold), the first
   answer of each later burst, total time, prefill tokens computed, prefix and tier hits.
2. chat: 8 system prompts (a header and 300-600 tokens of prose), 160 ShareGPT first turns (truncated to 256 tokens)
   as user turns, each behind a system prompt picked at random; Poisson arrivals at 6 req/s
   (above what 2 cores serve); max_num_seqs 8 and a pool of that batch plus ~3 system prompts.
   `fcfs` against `lpm` (the default aging bound of 2 s), `lpm_unbounded` (aging bound 3600 s),
   and fcfs / lpm_unbounded with a tier. Mean, median and P99 TTFT, hit rate, total time.
3. swap: 8 distinct prompts of L tokens (L = 256, 1024, 2048, 4096), 128 output tokens each, all
   at once into a pool of half of them with half their output, so the admitted half grows into
   preemptions: `recompute` (no tier), `recompute_write_back` (a write-back tier, which saves a
   victim's blocks as the pool evicts them), `swap_write_back` (swap: a victim's full blocks
   saved at preemption; write-back otherwise) and `swap_write_through`. Total time, output
   tok/s, preemptions, swap-outs, tier loads, prefill tokens computed.

Greedy, ignore_eos, dtype auto (bfloat16 on these CPUs), SmolLM2-135M-Instruct, block size 16,
default max_num_batched_tokens. Each engine process first runs one 12-token prompt for 2 tokens
(kernels and threads warm; no full block, so nothing is cached or written); the prefix cache and
the tier start as the setting says. TTFT: first token time minus the request's arrival (chat:
its scheduled arrival). --rounds N runs every setting N times, in ABBA order, and reports
medians. llama.cpp's OpenMP threads spin at barriers: beside a busy neighbour set
OMP_WAIT_POLICY=passive, or its 2-thread evals stall (the result records the variable).

    python -m benchmarks kv_tier --out benchmarks/results/kv_tier.json [--parts rag,chat,swap] [--rounds 3]
    python -m benchmarks kv_tier --quick --out /tmp/kv_tier_quick.json   # every part, tiny (~5 min)
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time

BLOCK = 16
FULL = {
    "doc_tokens": 6000, "bursts": 10, "questions_per_burst": 10, "question_output_len": 32,
    "pool_over_doc": 1.6, "filler_prompt_len": 512, "filler_output_len": 16, "filler_over_pool": 1.1,
    "filler_stream": 3000,
    "chat_systems": 8, "chat_system_tokens": (300, 600), "chat_requests": 160, "chat_user_len": 256,
    "chat_output_len": 32, "chat_rate": 6.0, "chat_max_num_seqs": 8, "chat_pool_systems": 3,
    "swap_lengths": (256, 1024, 2048, 4096), "swap_seqs": 8, "swap_output_len": 128,
}
QUICK = {
    **FULL, "doc_tokens": 320, "bursts": 2, "questions_per_burst": 3, "question_output_len": 4,
    "filler_prompt_len": 96, "filler_output_len": 4, "filler_stream": 300,
    "chat_systems": 4, "chat_system_tokens": (40, 80), "chat_requests": 12, "chat_user_len": 24,
    "chat_output_len": 4, "chat_rate": 100.0, "chat_max_num_seqs": 4, "chat_pool_systems": 1,
    "swap_lengths": (64,), "swap_seqs": 8, "swap_output_len": 32,
}
RAG_SETTINGS = ("pool", "tier", "restart_cold", "restart", "llamacpp_slot")
CHAT_SETTINGS = {  # name: engine kwargs beyond the pool
    "fcfs": {"scheduling_policy": "fcfs"},
    "lpm": {"scheduling_policy": "lpm"},
    "lpm_unbounded": {"scheduling_policy": "lpm", "scheduling_aging_bound": 3600.0},
    "fcfs_tier": {"scheduling_policy": "fcfs", "tier": True},
    "lpm_unbounded_tier": {"scheduling_policy": "lpm", "scheduling_aging_bound": 3600.0, "tier": True},
}
SWAP_SETTINGS = {
    "recompute": {"preemption_mode": "recompute"},
    # A write-back tier alone already saves a victim's blocks as the pool evicts them: what
    # swap adds beyond it is saving them all at once, at the preemption.
    "recompute_write_back": {"preemption_mode": "recompute", "kv_offload_write_policy": "write_back", "tier": True},
    "swap_write_back": {"preemption_mode": "swap", "kv_offload_write_policy": "write_back", "tier": True},
    "swap_write_through": {"preemption_mode": "swap", "kv_offload_write_policy": "write_through", "tier": True},
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- workloads (built once in the parent, token ids handed to every process) -----------------
def _tokenizer():
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(None))


def _prose(tok, seed: int, n_tokens: int) -> str:
    """Real prose: ShareGPT replies (seeded order) concatenated to n_tokens, cut there."""
    from pagedllm.bench.sharegpt import records

    replies = [r["conversations"][1]["value"].strip() for r in records()
               if len(r.get("conversations", [])) >= 2 and r["conversations"][1].get("from") == "gpt"]
    random.Random(seed).shuffle(replies)
    parts, n = [], 0
    for text in replies:
        if not text:
            continue
        parts.append(text)
        n += len(tok.encode(text, add_special_tokens=False)) + 1
        if n >= n_tokens + 16:
            break
    ids = tok.encode("\n\n".join(parts), add_special_tokens=False)[:n_tokens]
    return tok.decode(ids)


def _chat_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def _sharegpt_ids(tok, n: int, seed: int, max_len: int, output_len: int) -> list[list[int]]:
    """ShareGPT first turns as vLLM samples them, long ones truncated to max_len (kept)."""
    from pagedllm.bench.sharegpt import sample_sharegpt

    reqs = sample_sharegpt(tok, n, seed=seed, max_prompt_len=max_len, max_total_len=1 << 30, truncate=True,
                           fixed_output_len=output_len)
    if len(reqs) < n:
        raise RuntimeError(f"ShareGPT gave {len(reqs)} prompts, {n} wanted")
    return [list(r.prompt) for r in reqs]


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(map(len, seqs))
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def rag_workload(tok, c: dict) -> dict:
    doc = _prose(tok, 2, c["doc_tokens"])
    rng = random.Random(0)
    words = sorted({w.strip(".,:;()*#\"'`").lower() for w in doc.split() if len(w.strip(".,:;()*#\"'`")) > 6})
    asks = ["What does the document say about {}?", "Summarize the part of the document about {}.",
            "Why does the document mention {}?", "List the facts the document gives about {}.",
            "Quote the sentence of the document that mentions {}."]
    n_q = c["bursts"] * c["questions_per_burst"]
    questions, seen = [], set()
    while len(questions) < n_q:
        q = rng.choice(asks).format(rng.choice(words))
        if q not in seen:
            seen.add(q)
            questions.append(q)
    prompts = [_chat_ids(tok, [{"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {q}"}]) for q in questions]
    shared = _common_prefix(prompts)
    doc_blocks = shared // BLOCK
    pool = int(c["pool_over_doc"] * cdiv(max(map(len, prompts)), BLOCK))
    # Filler between bursts: ShareGPT prompts until they take at least filler_over_pool pools of blocks.
    stream = _sharegpt_ids(tok, c["filler_stream"], 1, c["filler_prompt_len"], c["filler_output_len"])
    fillers, at = [], 0
    for _ in range(c["bursts"] - 1):
        gap, blocks = [], 0
        while blocks < c["filler_over_pool"] * pool:
            ids = stream[at % len(stream)]
            at += 1
            gap.append(ids)
            blocks += cdiv(len(ids) + c["filler_output_len"], BLOCK)
        fillers.append(gap)
    return {"doc_text_chars": len(doc), "prompts": prompts, "questions": questions, "shared_prefix_tokens": shared,
            "doc_blocks": doc_blocks, "pool_blocks": pool, "fillers": fillers,
            "filler_requests_per_gap": [len(g) for g in fillers],
            "filler_tokens_per_gap": [sum(map(len, g)) for g in fillers]}


def chat_workload(tok, c: dict) -> dict:
    rng = random.Random(3)
    lo, hi = c["chat_system_tokens"]
    systems = []
    for i in range(c["chat_systems"]):
        head = (f"You are the support assistant of tenant {i + 1}, one of several apps behind this server. "
                "Follow the policy below exactly, answer briefly, and end with one next step.\n\nPolicy:\n")
        systems.append(head + _prose(tok, 100 + i, rng.randint(lo, hi)))
    users = _sharegpt_ids(tok, c["chat_requests"], 0, c["chat_user_len"], c["chat_output_len"])
    pick = random.Random(4)
    arrivals = random.Random(5)
    t, reqs = 0.0, []
    for i, u in enumerate(users):
        s = pick.randrange(len(systems))
        ids = _chat_ids(tok, [{"role": "system", "content": systems[s]}, {"role": "user", "content": tok.decode(u)}])
        reqs.append({"rid": f"c{i}", "ids": ids, "max_tokens": c["chat_output_len"], "at": t, "tag": f"system{s}"})
        t += arrivals.expovariate(c["chat_rate"])
    sys_lens = [len(_chat_ids(tok, [{"role": "system", "content": s}, {"role": "user", "content": ""}]))
                for s in systems]
    sys_blocks = [n // BLOCK for n in sys_lens]
    own = [cdiv(len(r["ids"]) + r["max_tokens"], BLOCK) - sys_blocks[int(r["tag"][6:])] for r in reqs]
    batch_blocks = int(c["chat_max_num_seqs"] * sum(own) / len(own))
    pool = batch_blocks + c["chat_pool_systems"] * sum(sys_blocks) // len(sys_blocks)
    pool = max(pool, max(cdiv(len(r["ids"]) + r["max_tokens"], BLOCK) for r in reqs) + 2)
    return {"requests": reqs, "system_tokens": sys_lens, "pool_blocks": pool, "batch_blocks": batch_blocks,
            "mean_prompt_tokens": sum(len(r["ids"]) for r in reqs) / len(reqs), "arrival_span_s": reqs[-1]["at"]}


def swap_workload(tok, c: dict, length: int) -> dict:
    prompts = [tok.encode(_prose(tok, 1000 + length + i, length), add_special_tokens=False)[:length]
               for i in range(c["swap_seqs"])]
    per_seq = cdiv(length + c["swap_output_len"], BLOCK)
    # Half the sequences' prompts and half their output: the engine admits about half of them
    # (blocks for their prompts), and their growth preempts the newest before any finishes.
    half = max(1, c["swap_seqs"] // 2)
    pool = max(per_seq + 2, half * (cdiv(length, BLOCK) + cdiv(c["swap_output_len"], BLOCK) // 2) + 1)
    reqs = [{"rid": f"s{i}", "ids": p, "max_tokens": c["swap_output_len"], "at": 0.0, "tag": "seq"}
            for i, p in enumerate(prompts)]
    return {"requests": reqs, "prompt_tokens": [len(p) for p in prompts], "pool_blocks": pool,
            "blocks_per_seq": per_seq}


# -- in an engine's own process ------------------------------------------------------------
def _snapshot(engine) -> dict:
    st = engine.stats(walk=False)
    kv, tier = st.kv, st.kv.tier
    return {"computed_prompt_tokens": st.computed_prompt_tokens, "prompt_tokens": st.prompt_tokens,
            "generation_tokens": st.generation_tokens, "preemptions": st.preemptions, "steps": st.steps,
            "prefix_queries": kv.prefix_queries, "prefix_hits": kv.prefix_hits, "evictions": kv.evictions,
            "tier_hits": kv.tier_hits, "tier_loaded_blocks": kv.tier_loaded_blocks,
            "tier_offloaded_blocks": kv.tier_offloaded_blocks, "swap_outs": kv.swap_outs,
            "swap_out_blocks": kv.swap_out_blocks,
            "tier_written_blocks": tier.written_blocks if tier else 0,
            "tier_read_blocks": tier.read_blocks if tier else 0,
            "tier_read_failures": tier.read_failures if tier else 0,
            "tier_write_errors": tier.write_errors if tier else 0}


def _diff(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def _serve(engine, reqs: list[dict]) -> tuple[list[dict], float, int]:
    """Add each request at its arrival (`at` seconds after the start) and step until all have
    finished. Returns per-request records (TTFT from the scheduled arrival), the elapsed time
    and the longest waiting queue seen."""
    from pagedllm import SamplingParams

    pending = sorted(reqs, key=lambda r: r["at"])
    outs, i, max_waiting = {}, 0, 0
    wall0, t0 = time.time(), time.perf_counter()
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(pending) and pending[i]["at"] <= now:
            r = pending[i]
            engine.add_request(r["rid"], r["ids"], SamplingParams(max_tokens=r["max_tokens"], temperature=0.0,
                                                                  ignore_eos=True),
                               cache_salt=r.get("salt"), add_special_tokens=False)
            i += 1
        if engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
            max_waiting = max(max_waiting, len(engine.scheduler.waiting))
        else:
            time.sleep(max(0.0, min(pending[i]["at"] - now, 0.05)))
    elapsed = time.perf_counter() - t0
    recs = []
    for r in reqs:
        o = outs[r["rid"]]
        m, arrival = o.metrics, wall0 + r["at"]
        if o.error or m.get("first_token_time") is None:
            raise RuntimeError(f"request {r['rid']} failed: {o.error}")
        recs.append({"rid": r["rid"], "tag": r["tag"], "at": r["at"], "prompt_tokens": len(r["ids"]),
                     "cached_tokens": o.num_cached_tokens, "output_tokens": len(o.outputs[0].token_ids),
                     "ttft_s": m["first_token_time"] - arrival, "latency_s": m["finish_time"] - arrival,
                     "queued_s": (m["scheduled_time"] or arrival) - arrival})
    return recs, elapsed, max_waiting


def _warmup(engine) -> None:
    """One 12-token prompt, 2 tokens: kernels and thread pools warm, no full block cached."""
    from pagedllm import SamplingParams

    engine.add_request("warmup", list(range(1000, 1012)), SamplingParams(max_tokens=2, ignore_eos=True),
                       add_special_tokens=False)
    while engine.has_unfinished_requests():
        engine.step()


def _drop_page_cache(root: str) -> int:
    """Evict the tier's files (only those) from the OS page cache: written back, then dropped."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return n


def _engine(engine_kw: dict):
    from pagedllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kw)
    startup = time.perf_counter() - t0
    _warmup(llm.engine)
    return llm, startup


def _close(llm, res: dict) -> None:
    t0 = time.perf_counter()
    llm.close()
    res["close_s"] = time.perf_counter() - t0
    tier = llm.engine.kv.tier
    if tier is not None:
        s = tier.snapshot()
        res["tier_after_close"] = {"blocks": s.blocks, "bytes": s.bytes, "written_blocks": s.written_blocks,
                                   "read_blocks": s.read_blocks, "read_failures": s.read_failures,
                                   "write_errors": s.write_errors, "evicted_blocks": s.evicted_blocks}


def rag_run(setting: str, engine_kw: dict, prompts: list[list[int]], fillers: list[list[list[int]]],
            per_burst: int, out_len: int, filler_out: int, drop_cache: bool, first_burst_only: bool) -> dict:
    res: dict = {"setting": setting, "engine_kwargs": engine_kw}
    if drop_cache:
        res["page_cache_dropped_files"] = _drop_page_cache(engine_kw["kv_offload_dir"])
    llm, res["startup_s"] = _engine(engine_kw)
    engine = llm.engine
    res["runner"] = engine.runner.describe()
    res["num_blocks"] = engine.kv.pool.num_blocks
    res["pool_mib"] = engine.kv.pool.num_blocks * BLOCK * engine.stats(walk=False).bytes_per_token / 2**20
    start = _snapshot(engine)
    bursts, recs = [], []
    t0 = time.perf_counter()
    n_bursts = 1 if first_burst_only else cdiv(len(prompts), per_burst)
    for k in range(n_bursts):
        qs = [{"rid": f"q{k * per_burst + j}", "ids": p, "max_tokens": out_len, "at": 0.0, "tag": f"burst{k}"}
              for j, p in enumerate(prompts[k * per_burst:(k + 1) * per_burst])]
        a = _snapshot(engine)
        r, el, _ = _serve(engine, qs)
        b = _snapshot(engine)
        recs += r
        row = {"burst": k, "elapsed_s": el, "first_ttft_s": r[0]["ttft_s"],
               "first_cached_tokens": r[0]["cached_tokens"], "mean_ttft_s": sum(x["ttft_s"] for x in r) / len(r),
               **_diff(a, b)}
        if k < len(fillers) and not first_burst_only:
            # Salted per setting: a restart's filler finds nothing of the tier run's in the tier
            # (unrelated traffic; the same tokens, so the same work).
            fr = [{"rid": f"f{k}-{j}", "ids": ids, "max_tokens": filler_out, "at": 0.0, "tag": "filler",
                   "salt": f"filler-{setting}"} for j, ids in enumerate(fillers[k])]
            _, el2, _ = _serve(engine, fr)
            row["filler"] = {"requests": len(fr), "elapsed_s": el2, **_diff(b, _snapshot(engine))}
        bursts.append(row)
        print(f"  {setting} burst {k}: first TTFT {row['first_ttft_s'] * 1e3:8.1f} ms (cached "
              f"{row['first_cached_tokens']}), computed {row['computed_prompt_tokens']}, tier loaded "
              f"{row['tier_loaded_blocks']} blocks, evictions during filler "
              f"{row.get('filler', {}).get('evictions', '-')}", flush=True)
    res["total_s"] = time.perf_counter() - t0
    res["counters"] = _diff(start, _snapshot(engine))
    res["bursts"] = bursts
    res["questions"] = recs
    _close(llm, res)
    return res


def serve_run(setting: str, engine_kw: dict, reqs: list[dict]) -> dict:
    """chat and swap: one stream of requests through a fresh engine."""
    res: dict = {"setting": setting, "engine_kwargs": engine_kw}
    llm, res["startup_s"] = _engine(engine_kw)
    engine = llm.engine
    res["runner"] = engine.runner.describe()
    res["num_blocks"] = engine.kv.pool.num_blocks
    res["pool_mib"] = engine.kv.pool.num_blocks * BLOCK * engine.stats(walk=False).bytes_per_token / 2**20
    start = _snapshot(engine)
    recs, res["total_s"], res["max_waiting"] = _serve(engine, reqs)
    res["counters"] = _diff(start, _snapshot(engine))
    res["requests"] = recs
    _close(llm, res)
    return res


# llama.cpp: the document's state computed once and persisted, then a fresh process answers
# one question from it, against a fresh process recomputing the document.
def llama_save(gguf: str, prefix: list[int], path: str, method: str, n_ctx: int) -> dict:
    import llama_cpp
    from benchmarks.lib.baselines import _llama

    llm = _llama(gguf, n_ctx=n_ctx)
    t0 = time.perf_counter()
    llm.eval(prefix)
    compute = time.perf_counter() - t0
    t0 = time.perf_counter()
    if method == "save_state":  # the high-level API: LlamaState (KV, logits rows, ids), pickled
        state = llm.save_state()
        with open(path, "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
    else:  # llama-server's slot save: llama_state_seq_save_file of sequence 0 with its tokens
        toks = (llama_cpp.llama_token * len(prefix))(*prefix)
        n = llama_cpp.llama_state_seq_save_file(llm._ctx.ctx, path.encode(), 0, toks, len(prefix))
        if not n:
            raise RuntimeError("llama_state_seq_save_file wrote nothing")
    save = time.perf_counter() - t0
    return {"method": method, "compute_s": compute, "save_s": save, "file_bytes": os.path.getsize(path),
            "tokens": len(prefix)}


def llama_answer(gguf: str, prefix: list[int], question: list[int], path: str | None, method: str | None,
                 n_ctx: int, drop_cache: bool) -> dict:
    import ctypes

    import llama_cpp
    from benchmarks.lib.baselines import _llama

    if drop_cache and path:
        _drop_page_cache(os.path.dirname(path))
    llm = _llama(gguf, n_ctx=n_ctx)
    llm.eval(list(range(1000, 1012)))  # warm, as our engines are
    llm.reset()
    t0 = time.perf_counter()
    if path is None:
        llm.eval(prefix + question)
        computed = len(prefix) + len(question)
    else:
        if method == "save_state":
            with open(path, "rb") as f:
                state = pickle.load(f)
            llm.load_state(state)
        else:
            toks = (llama_cpp.llama_token * n_ctx)()
            count = ctypes.c_size_t(0)
            n = llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, path.encode(), 0, toks, n_ctx, count)
            if not n:
                raise RuntimeError("llama_state_seq_load_file read nothing")
            llm.n_tokens = count.value
            llm.input_ids[:count.value] = toks[:count.value]
        loaded = time.perf_counter() - t0
        llm.eval(question)
        computed = len(question)
    token = llm.sample(temp=0.0)
    ttft = time.perf_counter() - t0
    out = {"ttft_s": ttft, "computed_tokens": computed, "first_token": int(token)}
    if path is not None:
        out["load_s"] = loaded
    return out


def _own(fn, *args):
    from pagedllm.bench.throughput import in_own_process

    return in_own_process(fn, *args)


# -- the parts ----------------------------------------------------------------------------
def _ttft_summary(recs: list[dict]) -> dict:
    import numpy as np

    v = np.array([r["ttft_s"] for r in recs])
    return {"n": len(v), "mean_ttft_s": float(v.mean()), "median_ttft_s": float(np.median(v)),
            "p99_ttft_s": float(np.percentile(v, 99)), "max_ttft_s": float(v.max())}


def _medians(runs: list[dict], metrics) -> dict:
    """Each metric's median over the rounds (metrics(run) -> {name: number or None})."""
    import statistics

    per = [metrics(r) for r in runs]
    return {k: statistics.median(v) if (v := [p[k] for p in per if p.get(k) is not None]) else None for k in per[0]}


def _order(settings: list[str], k: int) -> list[str]:
    """Round k's order: as given, then reversed (ABBA), so drift on a shared machine evens out."""
    return settings if k % 2 == 0 else settings[::-1]


def _rag_metrics(r: dict) -> dict:
    later = [b["first_ttft_s"] for b in r["bursts"][1:]]
    k = r["counters"]
    return {"first_ttft_s": r["bursts"][0]["first_ttft_s"], "later_bursts_first_ttft_s": sum(later) / len(later)
            if later else None, "mean_ttft_s": r["ttft"]["mean_ttft_s"], "p99_ttft_s": r["ttft"]["p99_ttft_s"],
            "total_s": r["total_s"], "computed_prompt_tokens": k["computed_prompt_tokens"],
            "prefix_hits": k["prefix_hits"], "tier_hits": k["tier_hits"], "tier_loaded_blocks": k["tier_loaded_blocks"],
            "evictions": k["evictions"]}


def _llama_metrics(r: dict) -> dict:
    out = {"recompute_ttft_s": r["recompute"]["ttft_s"]}
    for method in ("seq_state_file", "save_state"):
        for how in ("restore_warm", "restore_cold"):
            out[f"{method}_{how}_ttft_s"] = r[method][how]["ttft_s"] if how in r.get(method, {}) else None
    return out


def part_rag(tok, c: dict, tier_root: str, settings: list[str], rounds: int) -> dict:
    w = rag_workload(tok, c)
    prompts, pool = w["prompts"], w["pool_blocks"]
    print(f"rag: document prefix {w['shared_prefix_tokens']} tokens ({w['doc_blocks']} blocks), "
          f"{len(prompts)} questions in {c['bursts']} bursts, pool {pool} blocks, filler "
          f"{w['filler_requests_per_gap'][:1]} requests / {w['filler_tokens_per_gap'][:1]} tokens a gap", flush=True)
    base = {"num_gpu_blocks_override": pool, "max_model_len": max(8192, max(map(len, prompts)) + 64)}
    tier_dir = os.path.join(tier_root, "rag")
    tier_kw = {**base, "kv_offload_dir": tier_dir, "kv_offload_write_policy": "write_through"}
    args = (w["fillers"], c["questions_per_burst"], c["question_output_len"], c["filler_output_len"])
    rows: dict = {s: {"runs": []} for s in settings}
    for s in ("restart", "restart_cold"):
        if s in rows and "tier" not in rows:
            rows[s] = {"skipped": "needs the tier setting's directory: run it in the same command"}
    chain = [s for s in ("tier", "restart_cold", "restart") if "runs" in rows.get(s, {})]  # in this order
    others = [s for s in settings if s not in chain and "runs" in rows[s]]
    for k in range(rounds):
        # The tier chain keeps its order; the others go before it, then after it (ABBA).
        for s in (others + chain if k % 2 == 0 else chain + others[::-1]):
            if s == "llamacpp_slot":
                r = rag_llamacpp(prompts, w["shared_prefix_tokens"], tier_root)
                if "skipped" in r:
                    rows[s] = r
                    others = [o for o in others if o != s]
                else:
                    rows[s]["runs"].append(r)
                continue
            if s == "tier":
                shutil.rmtree(tier_dir, ignore_errors=True)
            r = _own(rag_run, s, base if s == "pool" else tier_kw, prompts, *args, s == "restart_cold",
                     s == "restart_cold")
            r["ttft"] = _ttft_summary(r["questions"])
            if s.startswith("restart"):
                b0 = r["bursts"][0]
                r["first_answer_from_tier"] = b0["tier_loaded_blocks"] > 0 and \
                    b0["first_cached_tokens"] >= w["doc_blocks"] * BLOCK
            if s == "pool":  # its bursts after the first recompute the document: the filler evicted it
                r["recomputed_doc_every_burst"] = all(b["computed_prompt_tokens"] >= w["doc_blocks"] * BLOCK
                                                      for b in r["bursts"])
            rows[s]["runs"].append(r)
            m = _rag_metrics(r)
            print(f"round {k + 1} {s:<13} first answer {m['first_ttft_s'] * 1e3:9.1f} ms  mean TTFT "
                  f"{m['mean_ttft_s'] * 1e3:8.1f} ms  P99 {m['p99_ttft_s'] * 1e3:8.1f} ms  total "
                  f"{m['total_s']:7.1f} s  computed {m['computed_prompt_tokens']}  hits {m['prefix_hits']} "
                  f"(tier {m['tier_hits']})", flush=True)
    for s, row in rows.items():
        if row.get("runs"):
            row["median"] = _medians(row["runs"], _llama_metrics if s == "llamacpp_slot" else _rag_metrics)
    ratios: dict = {}
    med = {s: row["median"] for s, row in rows.items() if "median" in row}
    if "pool" in med:
        p = med["pool"]
        ratios["pool_recomputed_doc_every_burst"] = all(r["recomputed_doc_every_burst"] for r in rows["pool"]["runs"])
        for s in ("tier", "restart_cold", "restart"):
            if s in med:
                m = med[s]
                ratios[f"pool_first_over_{s}_first"] = p["first_ttft_s"] / m["first_ttft_s"]
                if s != "restart_cold":
                    ratios[f"pool_over_{s}_later_bursts_first"] = p["later_bursts_first_ttft_s"] / \
                        m["later_bursts_first_ttft_s"] if m["later_bursts_first_ttft_s"] else None
                    for q in ("mean_ttft_s", "p99_ttft_s", "total_s"):
                        ratios[f"pool_over_{s}_{q[:-2]}"] = p[q] / m[q]
    if "llamacpp_slot" in med:
        m = med["llamacpp_slot"]
        for key, v in m.items():
            if key != "recompute_ttft_s" and v:
                ratios[f"llamacpp_recompute_over_{key[:-7]}"] = m["recompute_ttft_s"] / v
    for s in ("restart", "restart_cold"):
        if rows.get(s, {}).get("runs"):
            ratios[f"{s}_first_answer_from_tier"] = all(r["first_answer_from_tier"] for r in rows[s]["runs"])
    print(f"rag, medians of {rounds} round(s):")
    print(f"  {'setting':<14}{'first answer':>14}{'later bursts 1st':>18}{'mean TTFT':>11}{'P99 TTFT':>11}"
          f"{'total':>9}{'computed':>10}{'hits':>9}{'tier hits':>10}")
    for s, m in med.items():
        if s == "llamacpp_slot":
            continue
        later = m["later_bursts_first_ttft_s"]
        later = f"{later * 1e3:15.1f} ms" if later else f"{'-':>18}"
        print(f"  {s:<14}{m['first_ttft_s'] * 1e3:11.1f} ms{later}"
              f"{m['mean_ttft_s'] * 1e3:8.1f} ms"
              f"{m['p99_ttft_s'] * 1e3:8.1f} ms{m['total_s']:7.1f} s{m['computed_prompt_tokens']:10.0f}"
              f"{m['prefix_hits']:9.0f}{m['tier_hits']:10.0f}")
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x" if isinstance(v, float) else f"  {k}: {v}")
    if "pool_first_over_restart_first" in ratios:
        print(f"restarted server's first answer on the document: {ratios['pool_first_over_restart_first']:.2f}x "
              f"faster than recomputing it (the pool setting's first answer); target >= 5x", flush=True)
    cfg = {k: c[k] for k in ("doc_tokens", "bursts", "questions_per_burst", "question_output_len", "pool_over_doc",
                             "filler_prompt_len", "filler_output_len", "filler_over_pool")}
    cfg.update({k: w[k] for k in ("doc_text_chars", "shared_prefix_tokens", "doc_blocks", "pool_blocks",
                                  "filler_requests_per_gap", "filler_tokens_per_gap")})
    cfg["prompt_tokens"] = [len(p) for p in prompts]
    cfg["questions"] = w["questions"]
    cfg["engine_kwargs"] = {"pool": base, "tier": tier_kw}
    return {"config": cfg, "settings": rows, "ratios": ratios}


def rag_llamacpp(prompts: list[list[int]], shared: int, tier_root: str) -> dict:
    from benchmarks.lib.baselines import llama_cpp_available
    from pagedllm.loader import default_gguf_path

    why = llama_cpp_available()
    if why:
        print(f"llamacpp_slot: skipped: {why}", flush=True)
        return {"skipped": why}
    import llama_cpp

    gguf = str(default_gguf_path())
    prefix, question = prompts[0][:shared], prompts[0][shared:]
    n_ctx = max(map(len, prompts)) + 64
    d = os.path.join(tier_root, "llamacpp")
    os.makedirs(d, exist_ok=True)
    # OMP_WAIT_POLICY: llama.cpp's OpenMP threads spin at barriers by default; beside a busy
    # neighbour a 2-thread decode then stalls (a 14-token eval took 4.7 s instead of 0.1 s).
    res: dict = {"gguf": gguf, "weights": "Q4_1 (the GGUF as shipped; ours run it dequantized to bf16)",
                 "llama_cpp_python": llama_cpp.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                 "prefix_tokens": len(prefix), "question_tokens": len(question), "n_ctx": n_ctx}
    res["recompute"] = _own(llama_answer, gguf, prefix, question, None, None, n_ctx, False)
    for method in ("seq_state_file", "save_state"):
        path = os.path.join(d, f"doc.{method}")
        try:
            saved = _own(llama_save, gguf, prefix, path, method, n_ctx)
            res[method] = {"save": saved,
                           "restore_warm": _own(llama_answer, gguf, prefix, question, path, method, n_ctx, False),
                           "restore_cold": _own(llama_answer, gguf, prefix, question, path, method, n_ctx, True)}
        except Exception as e:  # an API this build lacks: say so, keep the rest
            res[method] = {"skipped": f"{type(e).__name__}: {e}"}
        finally:
            if os.path.exists(path):
                os.unlink(path)
    rc = res["recompute"]["ttft_s"]
    print(f"llamacpp_slot: recompute first answer {rc * 1e3:9.1f} ms", flush=True)
    for method in ("seq_state_file", "save_state"):
        m = res[method]
        if "skipped" in m:
            print(f"  {method}: skipped: {m['skipped']}")
            continue
        for how in ("restore_warm", "restore_cold"):
            t = m[how]["ttft_s"]
            m[how]["same_first_token"] = m[how]["first_token"] == res["recompute"]["first_token"]
            print(f"  {method} {how}: first answer {t * 1e3:9.1f} ms ({rc / t:.2f}x recompute; load "
                  f"{m[how]['load_s'] * 1e3:.1f} ms; file {m['save']['file_bytes'] / 2**20:.1f} MiB; same first "
                  f"token: {m[how]['same_first_token']})", flush=True)
    return res


def _chat_metrics(r: dict) -> dict:
    k = r["counters"]
    return {**{q: r["ttft"][q] for q in ("mean_ttft_s", "median_ttft_s", "p99_ttft_s")}, "hit_rate": r["hit_rate"],
            "total_s": r["total_s"], "output_tok_s": r["output_tok_s"],
            "computed_prompt_tokens": k["computed_prompt_tokens"], "preemptions": k["preemptions"],
            "tier_hits": k["tier_hits"], "max_waiting": r["max_waiting"]}


def _setting_run(setting: dict, name: str, base: dict, requests: list, tier_dir: str) -> dict:
    """serve_run of one setting in its own process; a setting with a tier gets a fresh, empty
    one at `tier_dir`, removed after."""
    kw = {**base, **{key: v for key, v in setting.items() if key != "tier"}}
    if setting.get("tier"):
        shutil.rmtree(tier_dir, ignore_errors=True)
        kw["kv_offload_dir"] = tier_dir
    try:
        return _own(serve_run, name, kw, requests)
    finally:
        if setting.get("tier"):
            shutil.rmtree(tier_dir, ignore_errors=True)


def part_chat(tok, c: dict, tier_root: str, settings: list[str], rounds: int) -> dict:
    w = chat_workload(tok, c)
    reqs, pool = w["requests"], w["pool_blocks"]
    print(f"chat: {len(reqs)} requests over {c['chat_systems']} system prompts ({min(w['system_tokens'])}-"
          f"{max(w['system_tokens'])} tokens), Poisson {c['chat_rate']} req/s (arrivals over "
          f"{w['arrival_span_s']:.1f} s), max_num_seqs {c['chat_max_num_seqs']}, pool {pool} blocks", flush=True)
    base = {"num_gpu_blocks_override": pool, "max_num_seqs": c["chat_max_num_seqs"]}
    rows: dict = {s: {"runs": []} for s in settings}
    for k in range(rounds):
        for s in _order(settings, k):
            r = _setting_run(CHAT_SETTINGS[s], s, base, reqs, os.path.join(tier_root, f"chat-{s}"))
            r["ttft"] = _ttft_summary(r["requests"])
            kc = r["counters"]
            r["hit_rate"] = kc["prefix_hits"] / kc["prefix_queries"] if kc["prefix_queries"] else 0.0
            r["output_tok_s"] = kc["generation_tokens"] / r["total_s"]
            rows[s]["runs"].append(r)
            print(f"round {k + 1} {s:<20} mean TTFT {r['ttft']['mean_ttft_s']:7.2f} s  median "
                  f"{r['ttft']['median_ttft_s']:7.2f} s  P99 {r['ttft']['p99_ttft_s']:7.2f} s  hit rate "
                  f"{r['hit_rate']:6.1%}  computed {kc['computed_prompt_tokens']}  total {r['total_s']:6.1f} s  "
                  f"preemptions {kc['preemptions']}  max waiting {r['max_waiting']}", flush=True)
    for row in rows.values():
        row["median"] = _medians(row["runs"], _chat_metrics)
    ratios = {}
    print(f"chat, medians of {rounds} round(s):")
    for s, row in rows.items():
        m = row["median"]
        print(f"  {s:<20} mean TTFT {m['mean_ttft_s']:7.2f} s  median {m['median_ttft_s']:7.2f} s  P99 "
              f"{m['p99_ttft_s']:7.2f} s  hit rate {m['hit_rate']:6.1%}  total {m['total_s']:6.1f} s")
    if "fcfs" in rows:
        f = rows["fcfs"]["median"]
        for s, row in rows.items():
            if s != "fcfs":
                m = row["median"]
                ratios[s] = {"fcfs_over_mean_ttft": f["mean_ttft_s"] / m["mean_ttft_s"],
                             "fcfs_over_p99_ttft": f["p99_ttft_s"] / m["p99_ttft_s"],
                             "fcfs_over_total": f["total_s"] / m["total_s"]}
                print(f"  {s}: mean TTFT {ratios[s]['fcfs_over_mean_ttft']:.2f}x lower than fcfs (target >= 1.5x), "
                      f"P99 {ratios[s]['fcfs_over_p99_ttft']:.2f}x (target >= 1), total time "
                      f"{ratios[s]['fcfs_over_total']:.2f}x", flush=True)
    cfg = {k: c[k] for k in ("chat_systems", "chat_system_tokens", "chat_requests", "chat_user_len",
                             "chat_output_len", "chat_rate", "chat_max_num_seqs", "chat_pool_systems")}
    cfg.update({k: w[k] for k in ("system_tokens", "pool_blocks", "batch_blocks", "mean_prompt_tokens",
                                  "arrival_span_s")})
    cfg["engine_kwargs"] = base
    return {"config": cfg, "settings": rows, "ratios": ratios}


def _swap_metrics(r: dict) -> dict:
    k = r["counters"]
    return {"total_s": r["total_s"], "output_tok_s": r["output_tok_s"], "mean_ttft_s": r["ttft"]["mean_ttft_s"],
            **{q: k[q] for q in ("preemptions", "swap_outs", "swap_out_blocks", "tier_loaded_blocks",
                                 "computed_prompt_tokens", "tier_written_blocks")}}


def part_swap(tok, c: dict, tier_root: str, settings: list[str], rounds: int) -> dict:
    out = []
    for length in c["swap_lengths"]:
        w = swap_workload(tok, c, length)
        pool = w["pool_blocks"]
        print(f"swap: {c['swap_seqs']} prompts of {length} tokens, {c['swap_output_len']} output tokens each, "
              f"pool {pool} blocks ({w['blocks_per_seq']} a sequence at its end)", flush=True)
        base = {"num_gpu_blocks_override": pool, "max_model_len": max(length + c["swap_output_len"] + 16, 512)}
        rows: dict = {s: {"runs": []} for s in settings}
        for k in range(rounds):
            for s in _order(settings, k):
                r = _setting_run(SWAP_SETTINGS[s], s, base, w["requests"],
                                 os.path.join(tier_root, f"swap-{length}-{s}"))
                kc = r["counters"]
                r["output_tok_s"] = kc["generation_tokens"] / r["total_s"]
                r["ttft"] = _ttft_summary(r["requests"])
                rows[s]["runs"].append(r)
                print(f"  round {k + 1} {s:<20} total {r['total_s']:7.2f} s  {r['output_tok_s']:7.1f} output tok/s  "
                      f"preemptions {kc['preemptions']}  swap-outs {kc['swap_outs']} ({kc['swap_out_blocks']} blocks)"
                      f"  tier loaded {kc['tier_loaded_blocks']}  computed {kc['computed_prompt_tokens']}", flush=True)
        for row in rows.values():
            row["median"] = _medians(row["runs"], _swap_metrics)
        ratios = {}
        if "recompute" in rows:
            base_tok_s = rows["recompute"]["median"]["output_tok_s"]
            for s, row in rows.items():
                if s != "recompute":
                    ratios[f"{s}_over_recompute_tok_s"] = row["median"]["output_tok_s"] / base_tok_s
                    print(f"    {s}: {ratios[f'{s}_over_recompute_tok_s']:.2f}x recompute's output tok/s "
                          f"(medians of {rounds})", flush=True)
        out.append({"prompt_len": length, "config": {"pool_blocks": pool, "blocks_per_seq": w["blocks_per_seq"],
                                                     "seqs": c["swap_seqs"], "output_len": c["swap_output_len"],
                                                     "engine_kwargs": base},
                    "settings": rows, "ratios": ratios})
    fastest = {row["prompt_len"]: max(row["settings"], key=lambda s: row["settings"][s]["median"]["output_tok_s"])
               for row in out if row["settings"]}
    if fastest:
        print("swap: fastest per prompt length (median output tok/s): "
              + ", ".join(f"{k}: {v}" for k, v in fastest.items()), flush=True)
    return {"lengths": out, "fastest": fastest}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/kv_tier.json")
    p.add_argument("--parts", default="rag,chat,swap")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run of every part (a few minutes)")
    p.add_argument("--rag-settings", default=",".join(RAG_SETTINGS))
    p.add_argument("--chat-settings", default=",".join(CHAT_SETTINGS))
    p.add_argument("--swap-settings", default=",".join(SWAP_SETTINGS))
    p.add_argument("--swap-lengths", default=None, help="comma-separated prompt lengths (default 256,1024,2048,4096)")
    p.add_argument("--chat-rate", type=float, default=None, help="Poisson arrival rate, requests/s (default 6)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every setting this many times, in ABBA order; medians are reported")
    p.add_argument("--tier-dir", default=None,
                   help="where the tiers go (default: a fresh folder under $TMPDIR, removed at the end)")
    a = p.parse_args()
    from pagedllm.bench.provenance import save_result
    from pagedllm.loader import DEFAULT_MODEL_NAME

    c = dict(QUICK if a.quick else FULL)
    if a.swap_lengths:
        c["swap_lengths"] = tuple(int(x) for x in a.swap_lengths.split(","))
    if a.chat_rate:
        c["chat_rate"] = a.chat_rate
    parts = a.parts.split(",")
    for part in parts:
        if part not in ("rag", "chat", "swap"):
            p.error(f"--parts: unknown part {part!r} (rag, chat, swap)")
    for s in a.rag_settings.split(","):
        if s not in RAG_SETTINGS:
            p.error(f"--rag-settings: unknown {s!r} ({', '.join(RAG_SETTINGS)})")
    for s in a.chat_settings.split(","):
        if s not in CHAT_SETTINGS:
            p.error(f"--chat-settings: unknown {s!r} ({', '.join(CHAT_SETTINGS)})")
    for s in a.swap_settings.split(","):
        if s not in SWAP_SETTINGS:
            p.error(f"--swap-settings: unknown {s!r} ({', '.join(SWAP_SETTINGS)})")
    res: dict = {"benchmark": "kv_tier", "command": "python -m benchmarks kv_tier " + " ".join(sys.argv[1:])}
    if os.path.exists(a.out):  # parts run separately land in one file
        with open(a.out) as f:
            res = {**{k: v for k, v in json.load(f).items() if k != "provenance"}, **res}
    tier_root = a.tier_dir or tempfile.mkdtemp(prefix="kv_tier_bench_")
    os.makedirs(tier_root, exist_ok=True)
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    res.update({"model": DEFAULT_MODEL_NAME, "dtype": "auto", "block_size": BLOCK, "quick": a.quick, "rounds": a.rounds,
                "workload_config": {k: list(v) if isinstance(v, tuple) else v for k, v in c.items()},
                "tier_dir_filesystem": _filesystem(tier_root)})
    tok = _tokenizer()
    t0 = time.perf_counter()
    try:
        if "rag" in parts:
            res["rag"] = part_rag(tok, c, tier_root, a.rag_settings.split(","), a.rounds)
        if "chat" in parts:
            res["chat"] = part_chat(tok, c, tier_root, a.chat_settings.split(","), a.rounds)
        if "swap" in parts:
            res["swap"] = part_swap(tok, c, tier_root, a.swap_settings.split(","), a.rounds)
    finally:
        if a.tier_dir is None:
            shutil.rmtree(tier_root, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - t0
    save_result(res, a.out)
    print(f"wrote {a.out} ({res['wall_s']:.0f} s)")


def _filesystem(path: str) -> str:
    """The tier's filesystem and device, as df names them."""
    try:
        return subprocess.run(["df", "-hT", path], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    main()
