"""Prompt logprobs over the API (issue 25): /v1/completions `echo` with `logprobs` as
lm-evaluation-harness's local-completions reads it (the prompt's tokens first, positions
lined up with the ids it sent), `max_tokens: 0`, vLLM's `prompt_logprobs` field on both
endpoints, and the 400s, against HF transformers' log_softmax of the same weights."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from hw import FAST_DTYPE

from .conftest import MODEL

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Name a colour."}]


def post(server, path: str, body: dict) -> httpx.Response:
    return server.client().post(path, json=body, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(None))


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """Row j: log P(next token | ids[:j + 1])."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def lm_eval_score(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval 0.4's local-completions computes of a choice (its parse_logprobs)."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(tok == max(top.values()) for tok, top in zip(lps, tops))


def check_against_hf(lp: dict, ids: list[int], ref: torch.Tensor, k: int, text_of) -> None:
    """The echoed prompt's part of a logprobs object: one position per sent id, each the
    logprob of that id after the ids before it, and the top k with it."""
    assert lp["tokens"][:len(ids)] == [text_of(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert lp["token_logprobs"][j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-3), j
        top = lp["top_logprobs"][j]
        assert top[lp["tokens"][j]] == lp["token_logprobs"][j] and len(top) in (k, k + 1)
        assert max(top.values()) == pytest.approx(float(ref[j - 1].max()), abs=1e-3)


def check_offsets(text: str, lp: dict) -> None:
    assert lp["text_offset"][0] == 0
    ends = lp["text_offset"][1:] + [len(text)]
    assert [text[a:b] for a, b in zip(lp["text_offset"], ends)] == lp["tokens"]


def text_of(tokenizer):
    return lambda t: tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(t)])


def test_echo_logprobs_of_token_id_prompts_as_lm_eval_reads_them(fp32_server, tokenizer, hf_model):
    """A batch of [context + continuation] id lists: each its own choice, its prompt echoed
    as the decoded ids, the logprob of each sent id at its own position (HF's, in float32);
    lm-eval's greedy check is right both ways."""
    server = fp32_server
    ctx = tokenizer.encode("The capital of France is", add_special_tokens=False)
    ref = hf_logprobs(hf_model, ctx)
    greedy = ctx + [int(ref[-1].argmax())]                 # the model's own next token
    other = ctx + tokenizer.encode(" green", add_special_tokens=False)
    r = post(server, COMP, {"model": MODEL, "prompt": [greedy, other], "max_tokens": 1, "temperature": 0,
                            "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == len(greedy) + len(other) and body["usage"]["completion_tokens"] == 2
    scores = []
    for ids, choice in zip((greedy, other), body["choices"]):
        lp = choice["logprobs"]
        assert choice["text"].startswith(tokenizer.decode(ids)) and len(lp["tokens"]) == len(ids) + 1
        check_against_hf(lp, ids, hf_logprobs(hf_model, ids), 2, text_of(tokenizer))
        check_offsets(choice["text"], lp)
        scores.append(lm_eval_score(choice, len(ctx)))
    assert scores[0][1] and not scores[1][1]
    assert scores[0][0] == pytest.approx(float(ref[-1].max()), abs=1e-3) and scores[1][0] < scores[0][0]


def test_max_tokens_zero_with_echo_is_the_prompt_alone_through_the_openai_client(server, tokenizer):
    client = server.openai(api_key="unused", max_retries=0, timeout=120)
    ids = tokenizer.encode("One, two, three", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=0)
    c = r.choices[0]
    assert c.text == tokenizer.decode(ids) and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    assert all(x < 0 for x in c.logprobs.token_logprobs[1:]) and c.logprobs.top_logprobs[0] is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    # n > 1: every choice echoes (vLLM's); a text prompt too, without logprobs.
    r = client.completions.create(model=MODEL, prompt="One, two", echo=True, max_tokens=0, n=2)
    assert [(c.index, c.text, c.logprobs) for c in r.choices] == [(0, "One, two", None), (1, "One, two", None)]


def test_streamed_echo_equals_the_response(server):
    """The echoed prompt comes first, with its logprobs; the output's offsets go on after it."""
    body = {"model": MODEL, "prompt": "Red, green, blue,", "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 1}
    whole = post(server, COMP, body).json()["choices"][0]
    for max_tokens in (3, 0):
        text, lp, finish = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, None
        with server.client().stream("POST", COMP, json={**body, "max_tokens": max_tokens, "stream": True},
                          timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        text += c["text"]
                        finish = c["finish_reason"] or finish
                        for key in lp:
                            lp[key] += (c["logprobs"] or {}).get(key, [])
        n = len(lp["tokens"])
        assert same_logprobs(lp, {key: v[:n] for key, v in whole["logprobs"].items()})
        if max_tokens:
            assert text == whole["text"] and n == len(whole["logprobs"]["tokens"])
        else:
            assert text == "Red, green, blue," and finish == "length" and n == 6


def same_logprobs(a: dict, b: dict) -> bool:
    """Equal, but for float rounding between two runs of the same prompt."""
    if (a["tokens"], a["text_offset"]) != (b["tokens"], b["text_offset"]):
        return False
    if [x is None for x in a["token_logprobs"]] != [x is None for x in b["token_logprobs"]]:
        return False
    close = all(x == pytest.approx(y, abs=1e-5) for x, y in zip(a["token_logprobs"], b["token_logprobs"])
                if x is not None)
    tops = all((x is None and y is None) or (x.keys() == y.keys() and all(
        x[t] == pytest.approx(y[t], abs=1e-5) for t in x)) for x, y in zip(a["top_logprobs"], b["top_logprobs"]))
    return close and tops


def test_vllm_prompt_logprobs_field_on_both_endpoints(server, tokenizer):
    """Completions: per choice; chat: on the response (vLLM's places). Each entry: null first,
    then {token id: {logprob, rank, decoded_token}}, the prompt token first, then its top k."""
    r = post(server, COMP, {"model": MODEL, "prompt": "Blue sky", "max_tokens": 2, "prompt_logprobs": 3,
                            "echo": True, "logprobs": 1}).json()
    ids = tokenizer.encode("Blue sky")
    choice = r["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        entry = plp[j]
        assert next(iter(entry)) == str(ids[j]) and len(entry) in (3, 4)
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert sorted(v["rank"] for v in entry.values())[:3] == [1, 2, 3]
        assert entry[str(ids[j])]["logprob"] == choice["logprobs"]["token_logprobs"][j]  # one computation
    assert "prompt_logprobs" not in post(server, COMP, {"prompt": "Blue sky", "max_tokens": 1}).json()["choices"][0]
    chat = post(server, CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 1, "prompt_logprobs": 0}).json()
    ids = post(server, "/tokenize", {"messages": MSGS}).json()["tokens"]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(ids)
    assert [next(iter(e)) for e in chat["prompt_logprobs"][1:]] == [str(t) for t in ids[1:]]
    assert "prompt_logprobs" not in chat["choices"][0]


def test_prompt_at_max_model_len_is_scored_whole(tiny_server, tokenizer, make_llm, tiny_model):
    """A prompt of max_model_len - 1 ids and its one token: every position answered, as the
    offline engine scores them (HF's forward at this length would cost seconds more). On the
    tiny model: the subject is the length limit and the echo, which the model does not change."""
    from tiny import TINY_NAME

    from pagedllm import SamplingParams

    ids = (tokenizer.encode("Pages are lent to readers, and shared. ", add_special_tokens=False) * 200)[:1023]
    r = post(tiny_server, COMP, {"model": TINY_NAME, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0,
                                 "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 1024 and lp["tokens"][:1023] == [text_of(tokenizer)(t) for t in ids]
    offline = make_llm(model=tiny_model, dtype=FAST_DTYPE, kv_cache_memory="160MiB", max_model_len=1024)
    want = offline.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)[0].prompt_logprobs
    assert max(abs(lp["token_logprobs"][j] - want[j][ids[j]].logprob) for j in range(1, 1023)) < 1e-3
    r = post(tiny_server, COMP, {"model": TINY_NAME, "prompt": ids + [ids[0]], "max_tokens": 0, "echo": True,
                                 "logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


@pytest.mark.parametrize("path,extra,param", [
    (COMP, {"echo": True, "logprobs": 21}, "logprobs"),                # above --max-logprobs (20)
    (COMP, {"prompt_logprobs": 21}, "prompt_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"prompt_logprobs": 21}, "prompt_logprobs"),
    (COMP, {"prompt_logprobs": -1}, "prompt_logprobs"),
    (COMP, {"max_tokens": 0}, "max_tokens"),                           # no echo: nothing to answer
    (COMP, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM's rule
    (CHAT, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_logprob_requests_name_their_field(server, path, extra, param):
    body = {"model": MODEL, "max_tokens": 1, **({"messages": MSGS} if path == CHAT else {"prompt": "Hi"}), **extra}
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"], r.text


def test_beam_search_with_echo_and_logprobs_is_refused(server):
    r = post(server, COMP, {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2, "use_beam_search": True,
                            "echo": True, "logprobs": 1})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"], r.text
