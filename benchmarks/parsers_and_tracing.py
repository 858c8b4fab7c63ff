"""What the reasoning parser and tracing cost a streaming chat server, in one command: the same
server three ways, each a fresh `pagedllm serve` process, in alternating order for --rounds:

- plain: no reasoning parser, no tracing (tracing off is this: the server has no tracer, one
  `is None` check a request);
- reasoning parser: --reasoning-parser deepseek_r1, which reads every streamed piece (SmolLM2
  never closes the block, so every piece goes through the splitter and out as reasoning_content);
- tracing on: --otlp-traces-endpoint, to an OTLP/HTTP collector in this process (every request
  an llm_request span and three children, exported in batches).

    python -m benchmarks parsers_and_tracing --rounds 3 --out benchmarks/results/parsers_and_tracing.json

Workload: the first user turns of ShareGPT conversations (cut to --max-prompt-len tokens, long
ones kept), each a streamed chat request of exactly --output-len tokens (greedy, ignore_eos), all
sent at once up to --concurrency. Output tokens are counted from the stream's usage chunk.
The ratios are of the medians over the rounds; tracing on bounds what tracing off could cost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from benchmarks.lib.data_parallel import ServeProcess
from pagedllm.bench.provenance import provenance, save_result
from pagedllm.bench.workloads import WorkloadOptions, load_workload
from pagedllm.loader import load_tokenizer, resolve_model_dir
from pagedllm.util import free_port

PLAIN, REASONING, TRACING = "plain", "reasoning parser (deepseek_r1)", "tracing on (OTLP/HTTP)"


class Collector:
    """Counts the spans OTLP/HTTP exports bring (their bodies are not decoded: its cost is the server's)."""

    def __init__(self) -> None:
        self.posts = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                outer.posts += 1
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1/traces"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


async def one(client: httpx.AsyncClient, prompt: str, output_len: int, sem: asyncio.Semaphore) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with sem:
        t0, first, pieces, tokens = time.perf_counter(), None, 0, 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    d = c.get("delta") or {}
                    if d.get("content") or d.get("reasoning_content"):
                        pieces += 1
                        first = first or time.perf_counter()
        return {"tokens": tokens, "pieces": pieces, "ttft": (first or time.perf_counter()) - t0}


async def drive(url: str, prompts: list[str], output_len: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(client, p, output_len, sem) for p in prompts))
        took = time.perf_counter() - t0
    return {"duration": took, "output_tokens": sum(r["tokens"] for r in rows),
            "output_throughput": sum(r["tokens"] for r in rows) / took, "pieces": sum(r["pieces"] for r in rows),
            "median_ttft_ms": 1000 * statistics.median(r["ttft"] for r in rows)}


def run(label: str, args, prompts: list[str], collector: Collector) -> dict:
    extra = {PLAIN: [], REASONING: ["--reasoning-parser", "deepseek_r1"],
             TRACING: ["--otlp-traces-endpoint", collector.url]}[label]
    server = ServeProcess(label.split()[0], [*shlex.split(args.server_args), *extra])
    try:
        r = drive(server.url, prompts, args.output_len, args.concurrency)
        result = asyncio.run(r)
    finally:
        server.stop()
    return {"label": label, **result}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-args", default="--dtype bfloat16 --max-model-len 2048 --kv-cache-memory 512MiB")
    p.add_argument("--out", default="benchmarks/results/parsers_and_tracing.json")
    args = p.parse_args()
    tok = load_tokenizer(resolve_model_dir(None))
    opts = WorkloadOptions(num_prompts=args.num_prompts, seed=0, max_prompt_len=args.max_prompt_len,
                           truncate=True)
    prompts = [tok.decode(r.prompt, skip_special_tokens=True) for r in load_workload("sharegpt", tok, opts)]
    collector = Collector()
    order = [PLAIN, REASONING, TRACING]
    rows = []
    for k in range(args.rounds):
        for label in order if k % 2 == 0 else order[::-1]:
            rows.append({**run(label, args, prompts, collector), "round": k})
            r = rows[-1]
            print(f"{label}, round {k}: {r['output_throughput']:.1f} out tok/s, {r['pieces']} streamed pieces, "
                  f"TTFT median {r['median_ttft_ms']:.0f} ms", flush=True)
    med = {label: statistics.median(r["output_throughput"] for r in rows if r["label"] == label) for label in order}
    ratios = {label: med[label] / med[PLAIN] for label in (REASONING, TRACING)}
    lines = [f"{label}: median {med[label]:.1f} out tok/s, {ratios.get(label, 1.0):.3f}x plain" for label in order]
    print("\n".join(lines))
    command = "python " + " ".join(shlex.quote(x) for x in sys.argv)
    save_result({"benchmark": "parsers_and_tracing", "command": command, "workload_options": opts.as_dict(),
                 "output_len": args.output_len, "concurrency": args.concurrency, "server_args": args.server_args,
                 "rounds": args.rounds, "results": rows, "median_output_throughput": med, "over_plain": ratios,
                 "spans_posts": collector.posts}, args.out)
    Path(args.out).with_suffix(".txt").write_text("\n".join([f"$ {command}", json.dumps(provenance()), *lines]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
