"""lm-evaluation-harness (PyPI lm-eval, the bench extra) for the benchmarks: a multiple-choice task
written without a download, and one timed lm-eval run in a process of its own.

    python -m pagedllm.bench.harness SPEC.json OUT.json

SPEC: {"model": "local-completions" or "hf", "model_args": {...}, "batch_size": 1, "task": name,
"include_path": the task's folder, "metrics_url": the server's address or null, "metrics_prefix":
"pagedllm" or "vllm"}. The run builds lm-eval's model, sends it one unrelated warm-up request, then
times lm_eval.simple_evaluate alone, and reads the server's counters just before and after it.
OUT: the task's metrics, each question's four loglikelihoods, the prompt tokens lm-eval sent (the
contexts and continuations it asked about), and the counters' changes (for `hf`: the tokens its
forward passes ran, padding included).
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

TASK = "pagedllm_mc_bench"
SUBJECT = "general science"
LETTERS = ["A", "B", "C", "D"]

# Word banks for questions of MMLU's shape: a few sentences of setting, a question line, four
# answers of 4-12 words. The text means little; its lengths and its ordinary English words
# (so ordinary BPE tokens) are what the engines see.
_NOUNS = ["cell", "membrane", "enzyme", "protein", "molecule", "reaction", "catalyst", "solution", "particle",
          "electron", "current", "circuit", "magnet", "orbit", "planet", "glacier", "sediment", "mineral",
          "crystal", "population", "habitat", "predator", "nutrient", "hormone", "neuron", "signal", "gene",
          "mutation", "vaccine", "market", "price", "contract", "treaty", "empire", "council", "algorithm",
          "network", "memory", "compiler", "river", "forest", "soil", "engine", "turbine", "battery", "lens"]
_ADJECTIVES = ["stable", "rapid", "gradual", "dense", "acidic", "neutral", "isolated", "complex", "fragile",
               "dominant", "recessive", "constant", "variable", "thermal", "electrical", "coastal", "ancient",
               "modern", "efficient", "unusual", "shallow", "narrow", "frequent", "seasonal", "marginal"]
_VERBS = ["increased", "reduced", "altered", "stabilised", "released", "absorbed", "transferred", "blocked",
          "doubled", "reversed", "triggered", "limited", "delayed", "protected", "weakened", "measured"]
_ROLES = ["researcher", "student", "engineer", "historian", "chemist", "biologist", "economist", "geologist",
          "physician", "teacher", "surveyor", "farmer"]
_SETTINGS = ["in a laboratory", "during a field survey", "over several months", "in a controlled trial",
             "at high altitude", "near the coast", "in a small town", "under low pressure", "during a dry summer",
             "across three regions"]
_SENTENCES = [
    "A {role} {setting} measured how the {a} {n} {v} the {n2} of a {a2} {n3}.",
    "The results showed that the {n} {v} only when the {n2} was kept {a}.",
    "Earlier work had suggested that {ns} and {n2s} respond in the same way to a {a} {n3}.",
    "In a second test, the {n} was replaced by a {a} {n2}, and the {n3} changed by about {pct} percent.",
    "Over the same period the {a} {n} {v} the {n2}, although the {n3} itself stayed {a2}.",
    "A colleague repeated the experiment with a {a2} {n2} and reported that the {n} {v} the {n3} again.",
    "Records from the previous decade show that {ns} were rarely {a} before the {n2} {v} the {n3}.",
]
_QUESTIONS = [
    "Which of the following statements is best supported by these observations?",
    "Which of the following most likely explains the change in the {n}?",
    "What would the {role} most likely conclude about the {n}?",
    "Which of the following would best test the explanation offered for the {n}?",
]
_ANSWERS = [
    "The {a} {n} {v} the {n2} in every trial",
    "The {n} {v} the {n2} only at first",
    "The {n2} {v} the {n} because of the {a} {n3}",
    "The {n} changed only when the {n3} was {a}",
    "Neither the {n} nor the {n2} changed",
    "The {a} {n3} {v} the {n} more than the {role} expected",
    "A {a2} {n2} would have {v} the {n} just as much",
]


def _plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"


def _fill(template: str, rng: random.Random) -> str:
    n, n2, n3 = rng.sample(_NOUNS, 3)
    a, a2 = rng.sample(_ADJECTIVES, 2)
    return template.format(n=n, n2=n2, n3=n3, ns=_plural(n), n2s=_plural(n2), a=a, a2=a2, v=rng.choice(_VERBS),
                           role=rng.choice(_ROLES), setting=rng.choice(_SETTINGS), pct=rng.randrange(5, 95, 5))


def mc_questions(count: int, seed: int = 0) -> list[dict]:
    """`count` questions in MMLU's fields (question, choices, answer): 2-4 sentences of setting and a
    question line (~50-110 tokens with SmolLM2's tokenizer), four answers, the right one drawn evenly."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        body = [_fill(t, rng) for t in rng.sample(_SENTENCES, rng.randint(2, 4))]
        choices = [_fill(t, rng) for t in rng.sample(_ANSWERS, 4)]
        out.append({"question": " ".join([*body, _fill(rng.choice(_QUESTIONS), rng)]), "choices": choices,
                    "answer": rng.randrange(4)})
    return out


def write_mc_task(out_dir: Path, num_questions: int, num_shots: int, seed: int = 0) -> str:
    """The task's data (dev: the few shots, test: the questions) and YAML in out_dir, loaded by
    lm-eval's TaskManager(include_path=out_dir): MMLU's template (lettered answers, continuations
    " A" to " D") behind one fixed few-shot prefix (sampler first_n). Returns the task's name."""
    import yaml

    out_dir.mkdir(parents=True, exist_ok=True)
    docs = mc_questions(num_shots + num_questions, seed)
    files = {"dev": docs[:num_shots], "test": docs[num_shots:]}
    for split, rows in files.items():
        (out_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "task": TASK, "dataset_path": "json",
        "dataset_kwargs": {"data_files": {s: str(out_dir / f"{s}.jsonl") for s in files},
                           "cache_dir": str(out_dir / "datasets")},
        "output_type": "multiple_choice", "test_split": "test", "fewshot_split": "dev", "num_fewshot": num_shots,
        "fewshot_config": {"sampler": "first_n"},
        "description": f"The following are multiple choice questions (with answers) about {SUBJECT}.\n\n",
        "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\n"
                       "D. {{choices[3]}}\nAnswer:",
        "doc_to_choice": LETTERS, "doc_to_target": "answer",
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")],
        "metadata": {"version": 1.0, "seed": seed},
    }
    (out_dir / f"{TASK}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return TASK


def server_counters(url: str, prefix: str) -> dict[str, float]:
    """The prompt and prefix-cache counters of a server's /metrics, summed over their labels:
    ours (pagedllm:) or vLLM's (vllm:). `computed` is ours; vLLM's is prompt - hits."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {f"{prefix}:prompt_tokens_total": "prompt", f"{prefix}:computed_prompt_tokens_total": "computed",
             f"{prefix}:prefix_cache_queries_total": "queries", f"{prefix}:prefix_cache_hits_total": "hits",
             f"{prefix}:request_success_total": "requests",
             # ours alone: prompt logprobs served from the prefix cache, counted apart from its KV hits
             f"{prefix}:prompt_logprobs_cache_queries_total": "logprob_queries",
             f"{prefix}:prompt_logprobs_cache_hits_total": "logprob_hits"}
    out = dict.fromkeys(names.values(), 0.0)
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


def _count_sent(lm) -> dict[str, int]:
    """Counts what lm-eval asks the model: each loglikelihood request's context + continuation tokens
    (TemplateAPI and HFLM both go through _loglikelihood_tokens)."""
    seen = {"requests": 0, "tokens": 0}
    inner = lm._loglikelihood_tokens

    def counted(requests, *a, **kw):
        seen["requests"] += len(requests)
        seen["tokens"] += sum(len(ctx) + len(cont) for _, ctx, cont in requests)
        return inner(requests, *a, **kw)

    lm._loglikelihood_tokens = counted
    return seen


def _count_forward(lm) -> dict[str, int]:
    """Tokens through the HF model's forward passes (padding included: it is computed)."""
    ran = {"tokens": 0}

    def hook(_module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        ran["tokens"] += int(ids.numel()) if ids is not None else 0

    lm.model.register_forward_pre_hook(hook, with_kwargs=True)
    return ran


def run(spec: dict) -> dict:
    import lm_eval
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    extra = {"batch_size": spec.get("batch_size", 1)} | ({"device": "cpu"} if spec["model"] == "hf" else {})
    lm = get_model(spec["model"]).create_from_arg_obj(spec["model_args"], extra)
    load_s = time.perf_counter() - t0
    # Warm-up: one request about unrelated text (no prefix the task shares), outside the timing.
    lm.loglikelihood([Instance("loglikelihood", {}, ("Warm-up text, unrelated to the task. " * 20, " Done"), 0)])
    sent = _count_sent(lm)
    ran = _count_forward(lm) if spec["model"] == "hf" else None
    tm = TaskManager(include_path=spec["include_path"], include_defaults=False)
    url, prefix = spec.get("metrics_url"), spec.get("metrics_prefix", "pagedllm")
    before = server_counters(url, prefix) if url else None
    t0 = time.perf_counter()
    res = lm_eval.simple_evaluate(model=lm, tasks=[spec["task"]], task_manager=tm, log_samples=True)
    wall = time.perf_counter() - t0
    after = server_counters(url, prefix) if url else None
    docs = sorted(res["samples"][spec["task"]], key=lambda s: s["doc_id"])
    metrics = {k.split(",")[0]: v for k, v in res["results"][spec["task"]].items() if k.endswith(",none")}
    return {"wall_s": wall, "load_s": load_s, "metrics": metrics, "questions": len(docs),
            "loglikelihoods": [[ll for ll, _ in s["filtered_resps"]] for s in docs],
            "requests": sent["requests"], "prompt_tokens_sent": sent["tokens"],
            "server": None if before is None else {k: after[k] - before[k] for k in after},
            "forward_tokens": None if ran is None else ran["tokens"], "client_threads": torch.get_num_threads(),
            "lm_eval": lm_eval.__version__}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))


if __name__ == "__main__":
    main()
