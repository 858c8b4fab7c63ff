"""lm-evaluation-harness (PyPI lm-eval) against `pagedllm serve` (issue 25), as evaluators run it:
`--model local-completions` (loglikelihood as echo + logprobs over token-id prompts, greedy
generate_until) and `local-chat-completions`, each beside lm-eval's own `hf` model on the same
weights in float32. The tasks ship in tests/data/lm_eval/ and load offline, from JSONL."""
from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import MODEL

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
MC, PPL, GEN = "pagedllm_mc", "pagedllm_ppl", "pagedllm_gen"
TOL = 1e-3  # per loglikelihood, float32 on both sides


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    """The tasks of tests/data/lm_eval. lm-eval resolves no path against a task's YAML, so a copy
    names the data from that folder (datasets' data_dir) and keeps datasets' cache in a temporary one."""
    import yaml
    from lm_eval.tasks import TaskManager

    out = tmp_path_factory.mktemp("lm_eval_tasks")
    for path in DATA.glob("*.yaml"):
        cfg = yaml.safe_load(path.read_text())
        cfg["dataset_kwargs"].update(data_dir=str(DATA), cache_dir=str(out / "datasets"))
        (out / path.name).write_text(yaml.safe_dump(cfg))
    return TaskManager(include_path=str(out), include_defaults=False)


@pytest.fixture(scope="module")
def model_paths(socket_server) -> dict:
    """The directories the server read its weights and tokenizer from (its /model_info)."""
    return socket_server.client().get("/model_info", timeout=30).json()


def evaluate(task_manager, model: str, model_args: dict, tasks: list[str], **kw) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=task_manager,
                                   log_samples=True, **kw)


@pytest.fixture(scope="module")
def hf(task_manager, model_paths) -> dict:
    """lm-eval's own `hf` model on the server's weights, in float32: every task."""
    args = {"pretrained": model_paths["model_path"], "dtype": "float32", "device": "cpu"}
    return evaluate(task_manager, "hf", args, [MC, PPL, GEN], batch_size=4)


def completions(socket_server, model_paths) -> dict:
    """What an evaluator passes `--model local-completions` (the HF tokenizer counts each context's tokens)."""
    return {"model": MODEL, "base_url": socket_server.url + "/v1/completions",
            "tokenizer": model_paths["tokenizer_path"],
            "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1}


def samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_loglikelihood_tasks_match_hf(socket_server, task_manager, model_paths, hf):
    """Multiple choice behind a shared 3-shot prefix, and rolling perplexity: echo + logprobs=1 +
    max_tokens=1, four token-id prompts per request (batch_size 4), two requests in flight."""
    ours = evaluate(task_manager, "local-completions", completions(socket_server, model_paths), [MC, PPL], batch_size=4)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][MC][metric] == hf["results"][MC][metric], metric
    mine, theirs = samples(ours, MC), samples(hf, MC)
    assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs] and len(mine) == 10
    for a, b in zip(mine, theirs):
        assert a["arguments"] == b["arguments"]
        got, want = ([ll for ll, _ in s["filtered_resps"]] for s in (a, b))
        assert got == pytest.approx(want, abs=TOL), f"doc {a['doc_id']}"
        # is_greedy: lm-eval compares each continuation token's logprob with the top of its top_logprobs
        assert [g for _, g in a["filtered_resps"]] == [g for _, g in b["filtered_resps"]], f"doc {a['doc_id']}"
    for a, b in zip(samples(ours, PPL), samples(hf, PPL)):
        assert a["filtered_resps"] == pytest.approx(b["filtered_resps"], abs=TOL), f"doc {a['doc_id']}"
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"][PPL][metric] == pytest.approx(hf["results"][PPL][metric], rel=1e-4), metric


def test_generate_until_matches_hf(socket_server, task_manager, model_paths, hf):
    """Greedy answers under `until`, sent as token ids: the same text, the same exact match."""
    ours = evaluate(task_manager, "local-completions", completions(socket_server, model_paths), [GEN])
    assert [s["resps"] for s in samples(ours, GEN)] == [s["resps"] for s in samples(hf, GEN)]
    assert ours["results"][GEN]["exact_match,strip"] == hf["results"][GEN]["exact_match,strip"]


def test_chat_completions_generate_until(socket_server, task_manager):
    """`local-chat-completions` with apply_chat_template: the few shots go as turns of /v1/chat/completions."""
    args = {"model": MODEL, "base_url": socket_server.url + "/v1/chat/completions", "num_concurrent": 2,
            "max_retries": 1}
    ours = evaluate(task_manager, "local-chat-completions", args, [GEN], apply_chat_template=True)
    answers = [s["filtered_resps"][0] for s in samples(ours, GEN)]
    assert len(answers) == 4 and all(isinstance(a, str) and a for a in answers), answers
    assert 0 <= ours["results"][GEN]["exact_match,strip"] <= 1
