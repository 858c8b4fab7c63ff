"""Reproducible request lists, chosen by name and seed.

- sharegpt: real first turns and reply lengths (vLLM's benchmark data).
- random: random token ids with vLLM's input/output length and range ratio.
- chat-shared-system: many conversations behind one long system prompt (~40 % of each), or
  behind one of a few, picked at random (num_system_prompts).
- rag-doc-qa: one long document and many questions about it.
- batch-eval: a fixed few-shot instruction prefix and many multiple-choice items.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Callable

from .sharegpt import BenchRequest, records, sample_sharegpt

WORKLOADS = ("sharegpt", "random", "chat-shared-system", "rag-doc-qa", "batch-eval")


@dataclass
class WorkloadOptions:
    num_prompts: int = 100
    seed: int = 0
    max_prompt_len: int = 256         # sharegpt filters (or truncates); chat caps the user turn
    max_output_len: int = 128         # caps every workload's output length
    input_len: int = 128              # random
    output_len: int = 64              # random, rag-doc-qa
    range_ratio: float = 0.0          # random: lengths uniform in [len*(1-r), len*(1+r)]
    system_tokens: int = 160          # chat-shared-system
    num_system_prompts: int = 1       # chat-shared-system: each conversation picks one of this many
    doc_tokens: int = 1500            # rag-doc-qa
    shots: int = 5                    # batch-eval
    truncate: bool = False            # sharegpt: cut long prompts to max_prompt_len instead of dropping them
    fixed_output_len: int | None = None  # sharegpt: every output this long (vLLM's --sharegpt-output-len)

    def as_dict(self) -> dict:
        return asdict(self)


def load_workload(name: str, tokenizer, opts: WorkloadOptions) -> list[BenchRequest]:
    if name not in _BUILDERS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    if opts.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {opts.num_prompts}")
    return _BUILDERS[name](tokenizer, opts)


def sharegpt_truncated(num_prompts: int, max_prompt_len: int, max_output_len: int, **kw) -> list[BenchRequest]:
    """The default model's ShareGPT sample with long prompts cut, not dropped (the scripts'
    workload); kw: other WorkloadOptions fields."""
    from ..loader import load_tokenizer, resolve_model_dir

    return load_workload("sharegpt", load_tokenizer(resolve_model_dir(None)),
                         WorkloadOptions(num_prompts=num_prompts, max_prompt_len=max_prompt_len,
                                         max_output_len=max_output_len, truncate=True, **kw))


def _n_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def _sharegpt(tok, o: WorkloadOptions) -> list[BenchRequest]:
    return sample_sharegpt(tok, o.num_prompts, o.seed, o.max_prompt_len, o.max_output_len,
                           truncate=o.truncate, fixed_output_len=o.fixed_output_len)


def _random(tok, o: WorkloadOptions) -> list[BenchRequest]:
    rng = random.Random(o.seed)
    vocab = len(tok)
    special = set(tok.all_special_ids)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - o.range_ratio)), int(n * (1 + o.range_ratio))))

    out = []
    for _ in range(o.num_prompts):
        n_in, n_out = length(o.input_len), min(length(o.output_len), o.max_output_len)
        ids = [t for t in (rng.randrange(vocab) for _ in range(n_in * 2)) if t not in special][:n_in]
        out.append(BenchRequest(ids, len(ids), n_out))
    return out


def _human_turns(o: WorkloadOptions, min_tokens: int, max_tokens: int, tok, count: int) -> list[tuple[str, int]]:
    """Real user questions (ShareGPT first turns) and their reply lengths."""
    convs = [r["conversations"] for r in records()
             if len(r.get("conversations", [])) >= 2 and r["conversations"][0].get("from") == "human"]
    random.Random(o.seed).shuffle(convs)
    out = []
    for c in convs:
        q = c[0]["value"]
        n = _n_tokens(tok, q)
        if min_tokens <= n <= max_tokens:
            out.append((q, max(4, min(_n_tokens(tok, c[1]["value"]), o.max_output_len))))
            if len(out) == count:
                break
    return out


def _words(seed: int, n_tokens: int, tok) -> str:
    """Real prose (ShareGPT replies), concatenated to about n_tokens."""
    replies = [r["conversations"][1]["value"] for r in records()
               if len(r.get("conversations", [])) >= 2 and r["conversations"][1].get("from") == "gpt"]
    rng = random.Random(seed)
    text = ""
    while _n_tokens(tok, text) < n_tokens:
        text += rng.choice(replies).strip() + "\n\n"
    ids = tok.encode(text, add_special_tokens=False)[:n_tokens]
    return tok.decode(ids)


def _chat_template(tok, messages: list[dict]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _chat_shared_system(tok, o: WorkloadOptions) -> list[BenchRequest]:
    if o.num_system_prompts < 1:
        raise ValueError(f"num_system_prompts must be >= 1, got {o.num_system_prompts}")
    # Several system prompts (tenants, apps) differ in their policy text, seeded apart.
    systems = [("You are the support assistant of Northwind Library Services. Follow the policy below "
                "exactly, answer briefly, and end with one next step.\n\nPolicy:\n"
                + _words(o.seed + 1 + i, o.system_tokens, tok)) for i in range(o.num_system_prompts)]
    # The system prompt is ~40 % of each prompt: user turns of ~1.5x its length.
    target = int(o.system_tokens * 1.5)
    turns = _human_turns(o, target // 3, target * 2, tok, o.num_prompts)
    # Each conversation picks its system prompt at random (seeded), not in turn: a fixed cycle
    # would line up with round-robin routing and hand it affinity by accident.
    pick = random.Random(o.seed + 3)
    out = []
    for q, out_len in turns:
        system = systems[pick.randrange(len(systems))]
        prompt = _chat_template(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        out.append(BenchRequest(prompt, _n_tokens(tok, prompt), out_len))
    return out


def _rag_doc_qa(tok, o: WorkloadOptions) -> list[BenchRequest]:
    doc = _words(o.seed + 2, o.doc_tokens, tok)
    rng = random.Random(o.seed)
    words = sorted({w.strip(".,:;()*#\"'").lower() for w in doc.split() if len(w) > 6})
    asks = ["What does the document say about {}?", "Summarize the part of the document about {}.",
            "Why does the document mention {}?", "List the facts the document gives about {}."]
    out = []
    for _ in range(o.num_prompts):
        q = rng.choice(asks).format(rng.choice(words) if words else "the topic")
        prompt = _chat_template(tok, [{"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {q}"}])
        out.append(BenchRequest(prompt, _n_tokens(tok, prompt), min(o.output_len, o.max_output_len)))
    return out


def _mcq(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    op, val = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
    options = {val}
    while len(options) < 4:
        options.add(val + rng.choice([-11, -10, -2, -1, 1, 2, 9, 10]))
    opts = list(options)
    rng.shuffle(opts)
    letters = "ABCD"
    text = f"Question: What is {a} {op} {b}?\n" + "".join(f"{letters[i]}. {v}\n" for i, v in enumerate(opts))
    return text + "Answer:", letters[opts.index(val)]


def _batch_eval(tok, o: WorkloadOptions) -> list[BenchRequest]:
    rng = random.Random(o.seed)
    prefix = "The following are multiple choice questions about arithmetic. Answer with the letter.\n\n"
    for _ in range(o.shots):
        q, ans = _mcq(rng)
        prefix += f"{q} {ans}\n\n"
    out = []
    for _ in range(o.num_prompts):
        q, _ = _mcq(rng)
        prompt = prefix + q
        out.append(BenchRequest(prompt, _n_tokens(tok, prompt), min(4, o.max_output_len)))
    return out


_BUILDERS: dict[str, Callable] = {
    "sharegpt": _sharegpt, "random": _random, "chat-shared-system": _chat_shared_system,
    "rag-doc-qa": _rag_doc_qa, "batch-eval": _batch_eval,
}
