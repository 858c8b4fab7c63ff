"""The official openai client against a real server."""
from __future__ import annotations

import openai
import pytest

from .conftest import MODEL

SYSTEM = ("You are the reference desk of the city library. The library opens at nine and closes at six on "
          "weekdays, lends books for three weeks, renews them twice online, and charges no fines on "
          "children's books. Study rooms are booked at the front desk, up to a week ahead.")


@pytest.fixture(scope="module")
def client(server):
    return server.openai(api_key="unused", max_retries=0, timeout=120)


def test_completion_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.choices[0].finish_reason in ("length", "stop")
    u = r.usage
    assert u.prompt_tokens == 5 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_completion_batch_of_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]


def test_chat_stream_equals_non_stream(client):
    msgs = [{"role": "user", "content": "Name three animals that live in the sea."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert text
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_n2_and_seed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a word."}], max_tokens=12,
              temperature=1.0, n=2, seed=42)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 24, "usage counts both choices"


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0)
    stop = base.choices[0].text[3:6]
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text and base.choices[0].text.startswith(r.choices[0].text)
    s = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop],
                                  stream=True)
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text


def test_shared_system_prompt_is_cached(client):
    def ask(q):
        return client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
    first = ask("When do you open?")
    second = ask("Can I renew a book?")
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens_details.cached_tokens


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-4  # greedy picks the top token
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == 3


def test_vllm_sampling_fields(client):
    """logit_bias (OpenAI's), and vLLM's extra fields through extra_body, reach the sampler."""
    tok = 28  # ","
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logit_bias={str(tok): 100}, logprobs=1)
    assert r.choices[0].text == "," * 4 and r.choices[0].logprobs.tokens == [","] * 4
    plain = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0)
    penalized = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.5, "min_p": 0.1, "min_tokens": 12})
    assert penalized.usage.completion_tokens == 12 and penalized.choices[0].text != plain.choices[0].text


def test_models_and_errors_through_client(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100000)
    assert "max_model_len" in str(e.value)
