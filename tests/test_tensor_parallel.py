"""Tensor parallelism on gloo: TP=N gives TP=1's greedy tokens in fp32 through a prefix
hit, n=2 with copy-on-write and a preemption; bad sizes and a dead rank are clear errors.

Each TP engine starts N-1 worker processes; they share this machine's cores, so the
workloads are small."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.distributed import WorkerDiedError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir) -> str:
    """4 heads / 2 KV heads: TP=2 splits both."""
    import transformers as tf

    tmp_path = tmp_path_factory.mktemp("tp")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    out = tmp_path / "tiny-llama"
    tf.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, out / f)
    return str(out)


def scenario(llm: LLM) -> tuple[list[list[int]], dict]:
    """Tokens of: a batch, a prompt that hits the prefix cache, n=2 (the samples copy the
    shared last block before writing), and a burst that outgrows the pool (preemption)."""
    shared = list(range(1000, 1040))
    outs = [o.outputs[0].token_ids for o in
            llm.generate([[5, 17, 300, 4000, 12], list(range(100, 150))], GREEDY, use_tqdm=False)]
    outs += [o.outputs[0].token_ids for o in llm.generate([shared + [7]], GREEDY, use_tqdm=False)]
    outs += [o.outputs[0].token_ids for o in llm.generate([shared + [8, 9]], GREEDY, use_tqdm=False)]
    pair = llm.generate([list(range(2000, 2021))], SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0]
    outs += [c.token_ids for c in pair.outputs]
    # Structured outputs: the matcher lives on rank 0, where sampling is.
    regex = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,9}"))
    outs += [o.outputs[0].token_ids for o in llm.generate([[5, 17, 300]], regex, use_tqdm=False)]
    burst = [list(range(3000 + 50 * i, 3030 + 50 * i)) for i in range(5)]
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs += [o.outputs[0].token_ids for o in llm.generate(burst, long, use_tqdm=False)]
    s = llm.engine.stats()
    return outs, {"hits": s.kv.prefix_hits, "cow": s.kv.cow_copies, "preemptions": s.preemptions}


def run(model: str | None, tp: int) -> tuple[list[list[int]], dict]:
    # 16 blocks of 16: the burst (5 x 60 tokens = 20 blocks) cannot all stay resident.
    llm = LLM(model=model, tensor_parallel_size=tp, dtype="float32", num_gpu_blocks_override=16,
              max_model_len=256, num_threads=1)
    try:
        return scenario(llm)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny_tp1(tiny) -> tuple[list[list[int]], dict]:
    want, events = run(tiny, 1)
    assert events["hits"] > 0 and events["cow"] > 0 and events["preemptions"] > 0, events
    return want, events


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_tp2_tiny_llama_matches_tp1(tiny, tiny_tp1, shm, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_TP_SHM", shm)  # the all-reduce of local ranks: shared memory, or gloo
    got, events = run(tiny, 2)
    assert got == tiny_tp1[0]
    assert events == tiny_tp1[1]  # one scheduler on rank 0: the same decisions


def test_tp1_through_a_process_group_matches(tiny, tiny_tp1, monkeypatch):
    """What the GPU check runs on its one device: the collectives' path with one rank."""
    monkeypatch.setenv("PAGEDLLM_TP_GROUP", "1")
    got, events = run(tiny, 1)
    assert got == tiny_tp1[0] and events == tiny_tp1[1]


def test_tp3_on_smollm2s_head_layout_matches_tp1(tmp_path, model_dir):
    """Three ranks over SmolLM2-135M's layout: 9 query heads and 3 KV heads (3 and 1 a rank),
    tied embeddings, its tokenizer; 2 layers of random weights (the mechanism, not the model:
    the 30-layer original took 34 s of the suite for the same split)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=72, intermediate_size=192, num_hidden_layers=2, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=True, initializer_range=0.1)
    out = tmp_path / "smollm2-layout"
    tf.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, out / f)
    want, events = run(str(out), 1)
    assert events["hits"] > 0 and events["cow"] > 0 and events["preemptions"] > 0, events
    got, _ = run(str(out), 3)
    assert got == want


def test_tp_size_must_divide_the_model(make_llm):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide .*attention heads \(9\).*"
                                         r"allows \[1, 3\]"):
        make_llm(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        make_llm(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="batch_invariant with tensor_parallel_size > 1 is not supported"):
        make_llm(tensor_parallel_size=3, batch_invariant=True)


def test_dead_worker_is_a_clear_error_not_a_hang(make_llm, tiny):
    llm = make_llm(model=tiny, tensor_parallel_size=2, dtype="float32", num_gpu_blocks_override=16, num_threads=1)
    try:
        proc = llm.engine._launcher.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {proc.pid}\) exited with code -9"):
            llm.generate(["Hello"], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        with pytest.raises(WorkerDiedError):  # and every later step: the engine is done
            llm.generate(["Hello"], GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_torchrun_launch_matches_tp1(tmp_path, tiny):
    """Every rank runs the same command under torchrun (env:// rendezvous, as across
    nodes); rank 0 goes on past LLM(...), the other serves it and exits."""
    script = tmp_path / "run.py"
    script.write_text(
        "import json, sys\n"
        "from pagedllm import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1], tensor_parallel_size=int(sys.argv[2]), dtype='float32', "
        "num_gpu_blocks_override=32, num_threads=1)\n"
        "out = llm.generate([[5, 17, 300, 4000, 12]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "
        "use_tqdm=False)\n"
        "print('TOKENS', json.dumps(out[0].outputs[0].token_ids), flush=True)\n"
        "llm.close()\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), tiny, "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("TOKENS")]
    assert len(lines) == 1  # only rank 0 runs the engine past LLM(...)
    alone = subprocess.run([sys.executable, str(script), tiny, "1"], capture_output=True, text=True, timeout=300)
    assert lines == [x for x in alone.stdout.splitlines() if x.startswith("TOKENS")]


def test_serve_with_tp_ends_when_a_rank_dies(tmp_path_factory, tiny):
    """`pagedllm serve --tensor-parallel-size 2` answers; once a rank dies, the request in
    its way fails with the rank named and the server exits 1, rather than 503 for ever."""
    import httpx

    from server.conftest import start_server

    server = start_server(tmp_path_factory, "--model", tiny, "--tensor-parallel-size", "2", "--num-threads", "1",
                          "--max-model-len", "512", name="tp-serve")
    try:
        body = {"model": "tiny-llama", "prompt": [5, 17, 300], "max_tokens": 4, "temperature": 0}
        ok = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        worker = subprocess.run(["pgrep", "-f", "pagedllm.runtime.launch", "-P", str(server.proc.pid)],
                                capture_output=True, text=True).stdout.split()
        assert len(worker) == 1
        os.kill(int(worker[0]), signal.SIGKILL)
        time.sleep(1)
        failed = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert failed.status_code == 503 and "tensor-parallel rank 1" in failed.text
        assert server.proc.wait(timeout=60) == 1
        assert "error: the engine failed: tensor-parallel rank 1" in server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_visualizer_sees_the_same_blocks_under_tp(tiny):
    """The visualizer watches rank 0's KV manager: under TP=2 its event stream (allocations,
    prefix hits, forks, copy-on-write) is TP=1's, event for event."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.engine import LLMEngine
    from pagedllm.viz.hub import VizHub

    events = []
    for tp in (1, 2):
        engine = LLMEngine(EngineConfig(model=tiny, tensor_parallel_size=tp, dtype="float32",
                                        num_gpu_blocks_override=16, max_model_len=256, num_threads=1))
        try:
            hub = VizHub(engine)
            engine.observers.append(hub)
            hub.start_recording()
            shared = list(range(1000, 1040))
            engine.add_request("a", shared + [7], SamplingParams(max_tokens=20, ignore_eos=True, temperature=0))
            engine.add_request("b", shared + [8], SamplingParams(n=2, max_tokens=20, ignore_eos=True, temperature=0))
            while engine.has_unfinished_requests():
                engine.step()
            events.append([ev for m in hub.stop_recording() for ev in m.get("kv", [])])
        finally:
            engine.close()
    assert events[0] == events[1]
    assert {"alloc", "fork", "cow", "free"} <= {ev["type"] for ev in events[0]}

