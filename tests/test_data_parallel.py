"""`pagedllm serve --data-parallel-size 2`: real servers with replica processes, driven by
the official openai client; prefix-aware routing measured against one replica and against
round-robin; a replica killed under load. On the tiny model: the subject is the processes,
the routing and the pipes, not the text."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server.conftest import metric_sample, metrics, start_server, stop_server
from server.inproc import serve_in_process
from tiny import TINY_NAME as MODEL

# Two system prompts, each well past the router's first blocks; user turns that share no
# first word, so two prompts share exactly their system prompt (and the template around it).
SYSTEMS = {
    "A": "You are the archivist of a mountain observatory. Answer every question about telescopes, weather "
         "logs and star charts with care, cite the logbook page when you can, and keep answers short.",
    "B": "Ahoy, you are the quartermaster of a river ferry. Speak plainly about tickets, cargo limits, "
         "timetables and lost luggage, and always end by naming the next departure from the north pier.",
}
QUESTIONS = ["When does the dome open?", "Which lens is cleanest?", "Could ice damage mirrors?",
             "How heavy can crates be?", "Why was Tuesday cancelled?", "Are bicycles allowed aboard?"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory, tiny_flags):
    s = start_server(tmp_path_factory, *tiny_flags, "--data-parallel-size", "2", "--router-policy", "prefix", "--max-logprobs", "24",
                     name="dp2")
    yield s
    stop_server(s)


def test_completions_and_chat_streaming_and_not(dp_server):
    client = _client(dp_server.url)
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    msgs = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    streamed = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                                   stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert text == chat.choices[0].message.content and text
    assert dp_server.client().get("/health").json() == {"status": "ok"}
    # What a gateway reads: the server's totals over its replicas (SGLang's over its DP ranks).
    info, listed = (dp_server.client().get(p).json() for p in ("/server_info", "/v1/models"))
    assert (info["dp_size"], info["max_running_requests"]) == (2, 2 * 256)
    assert info["max_total_num_tokens"] == listed["data"][0]["kv_cache_blocks"] * 16
    assert dp_server.client().get("/model_info").json()["model_type"] == "llama"
    # Structured outputs: the front compiles to check, the replica that runs it compiles its own.
    pick = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                                     extra_body={"guided_choice": ["blue", "green"]})
    assert pick.choices[0].text in ("blue", "green")
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"guided_regex": "(abc"})
    # Validated in the server process by the engine's own rules: a 400 naming the limit.
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)


def test_echo_logprobs_come_back_from_the_replicas(dp_server):
    """Prompt logprobs cross the replica's pipe whole, streamed or not; --max-logprobs is the
    front's limit too (24 here: past the request models' old fixed 20)."""
    body = {"model": MODEL, "prompt": [[504, 3575, 282, 4649], [19556, 905]], "max_tokens": 0, "echo": True,
            "logprobs": 24, "temperature": 0}
    r = dp_server.client().post("/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [4, 2]
    for c in choices:
        assert c["logprobs"]["top_logprobs"][0] is None and len(c["logprobs"]["top_logprobs"][1]) in (24, 25)
    streamed = []
    with dp_server.client().stream("POST", "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {") and (c := json.loads(line[6:])["choices"]) and c[0]["logprobs"]:
                streamed.append((c[0]["index"], c[0]["logprobs"]["tokens"]))
    assert sorted(streamed) == [(i, c["logprobs"]["tokens"]) for i, c in enumerate(choices)]
    r = dp_server.client().post("/v1/completions", json={**body, "logprobs": 25}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def _replay(server) -> tuple[float, float]:
    """Three chats behind system prompt A, then three behind B, one at a time; the
    change in (prefix-cache hits, queries) they caused."""
    before = metrics(server)
    client = server.openai(max_retries=0, timeout=120)
    for k, name in enumerate("AAABBB"):
        client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": SYSTEMS[name]}, {"role": "user", "content": QUESTIONS[k]}])
    after = metrics(server)
    key = "pagedllm:prefix_cache_{}_total"
    return tuple(after[key.format(x)] - before[key.format(x)] for x in ("hits", "queries"))


def test_affinity_keeps_the_one_replica_hit_rate_round_robin_halves_it(dp_server, tmp_path_factory, tiny_flags):
    routed0 = [metric_sample(dp_server, "pagedllm:replica_routed_requests_total", replica=str(i))
               for i in range(2)]
    hits_dp, queries_dp = _replay(dp_server)
    routed = [metric_sample(dp_server, "pagedllm:replica_routed_requests_total", replica=str(i)) - routed0[i]
              for i in range(2)]
    # Per replica series add up to the totals.
    total = metrics(dp_server)
    assert sum(metric_sample(dp_server, "pagedllm:replica_prefix_cache_hits_total", replica=str(i))
               for i in range(2)) == total["pagedllm:prefix_cache_hits_total"]
    one = serve_in_process(*tiny_flags)   # one replica: the engine in this process
    try:
        hits_one, queries_one = _replay(one)
    finally:
        one.close()
    rr = start_server(tmp_path_factory, *tiny_flags, "--data-parallel-size", "2", "--router-policy", "round-robin",
                      name="rr")
    try:
        hits_rr, queries_rr = _replay(rr)
    finally:
        stop_server(rr)
    assert queries_dp == queries_one == queries_rr > 0
    assert hits_one > 0
    assert hits_dp == hits_one  # each system prompt found where it was computed
    # Round-robin puts two of each three on one replica and one on the other: one hit of two.
    assert hits_rr * 2 == hits_one
    assert sorted(routed) in ([0, 6], [3, 3])  # one system prompt's three chats together


async def _stream_until_done(url: str, prompt: str, max_tokens: int) -> str:
    """'ok', or the error the server sent (an error event, or an HTTP error)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        finish = None
        async for ch in stream:
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        return "ok" if finish == "length" else f"no finish ({finish})"
    except openai.APIError as e:
        return f"error: {e}"
    finally:
        await client.close()


async def _plain(url: str, prompt: str, max_tokens: int) -> str:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    return "ok" if r.status_code == 200 else f"error: {r.status_code} {r.text}"


def _pids(server) -> list[int]:
    m = re.search(r"data parallel: 2 replicas \(pids (\d+), (\d+)\)", server.log())
    return [int(m.group(1)), int(m.group(2))]


def test_killed_replica_fails_its_requests_cleanly_and_comes_back(dp_server):
    url = dp_server.url
    pid0 = _pids(dp_server)[0]
    prompts = [f"{w} " * 70 for w in ("river", "mountain", "forest", "desert", "ocean", "valley", "island", "canyon")]

    async def load() -> list[str]:
        # 800 tokens each: on the tiny model, still running when the kill lands
        tasks = [asyncio.create_task(_stream_until_done(url, p, 800) if i % 2 else _plain(url, p, 800))
                 for i, p in enumerate(prompts)]
        deadline = time.time() + 60
        while time.time() < deadline:  # kill once both replicas are generating
            running = [metric_sample(dp_server, "pagedllm:replica_num_requests_running", replica=str(i)) for i in (0, 1)]
            if min(running) > 0:
                break
            await asyncio.sleep(0.2)
        os.kill(pid0, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 300)  # nothing hangs

    results = asyncio.run(load())
    failed = [r for r in results if r != "ok"]
    assert failed, results
    assert all("replica 0 died" in r for r in failed), failed  # a clear error, streaming or not
    assert len(failed) < len(results)  # the other replica finished its own
    deadline = time.time() + 120
    while metric_sample(dp_server, "pagedllm:replica_up", replica="0") != 1.0:
        assert time.time() < deadline, dp_server.log()[-3000:]
        time.sleep(0.5)
    assert metric_sample(dp_server, "pagedllm:replica_restarts_total", replica="0") == 1.0
    assert re.search(r"replica 0 is back \(pid (\d+)\)", dp_server.log())
    # Both serve again: the restarted replica takes its share of new requests.
    before = metric_sample(dp_server, "pagedllm:replica_routed_requests_total", replica="0")
    assert all(r == "ok" for r in asyncio.run(_all(url, prompts)))
    assert metric_sample(dp_server, "pagedllm:replica_routed_requests_total", replica="0") > before


async def _all(url: str, prompts: list[str]) -> list[str]:
    return await asyncio.gather(*(_plain(url, p, 2) for p in prompts))


def test_data_parallel_size_zero_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--data-parallel-size", "0"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert "data_parallel_size must be an integer >= 1, got 0" in r.stderr
    assert "Traceback" not in r.stderr


def test_totals_add_replicas_up_and_keep_a_dead_ones_counters():
    from dataclasses import replace

    from pagedllm.dp.stats import counters_only, sum_stats, zero_stats

    def replica(hits: int, used: int, running: int):
        z = zero_stats(16, 100)
        kv = replace(z.kv, pool=replace(z.kv.pool, num_blocks=100, used_blocks=used), prefix_queries=2 * hits,
                     prefix_hits=hits, used_slots=used * 16 - 4)
        return replace(z, kv=kv, num_running=running, generation_tokens=10 * hits, steps=hits)

    a, b = replica(10, 50, 3), replica(30, 10, 1)
    total = sum_stats([a, b])
    assert (total.kv.prefix_hits, total.kv.num_blocks, total.num_running) == (40, 200, 4)
    assert total.kv.usage == 60 / 200 and total.kv.waste == 8 / (60 * 16)
    # b dies and a fresh b starts from zero: the counters go on, its gauges are gone.
    after = sum_stats([counters_only(b), a, replica(0, 0, 0)])
    assert after.kv.prefix_hits == 40 and after.generation_tokens == total.generation_tokens
    assert after.num_running == 3 and after.kv.used_blocks == 50



def test_bench_workload_spreads_over_several_system_prompts_and_layouts_parse():
    from benchmarks.lib.data_parallel import Layout, parse_layouts
    from pagedllm.bench.workloads import WorkloadOptions, load_workload
    from pagedllm.dp.router import prefix_key
    from pagedllm.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    reqs = load_workload("chat-shared-system", tok, WorkloadOptions(num_prompts=24, num_system_prompts=4))
    keys = [prefix_key(tok.encode(r.prompt), 16) for r in reqs]
    assert len(set(keys)) == 4  # the router tells the system prompts apart by their first blocks
    assert keys != [keys[i % 4] for i in range(len(keys))]  # picked at random, not in a cycle
    one = load_workload("chat-shared-system", tok, WorkloadOptions(num_prompts=4))
    assert len({prefix_key(tok.encode(r.prompt), 16) for r in one}) == 1
    assert parse_layouts("1:prefix,2,2:round-robin") == [Layout(1, "prefix"), Layout(2, "prefix"),
                                                         Layout(2, "round-robin")]
    with pytest.raises(ValueError, match="REPLICAS:POLICY"):
        parse_layouts("0:prefix")
