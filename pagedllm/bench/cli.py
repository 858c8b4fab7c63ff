"""`pagedllm bench ...` (what a user runs against their own engine), `pagedllm kv-calc`,
`pagedllm simulate`, `pagedllm project-parallel`. The repository's benchmarks/ adds the
comparisons with other engines (python -m benchmarks)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Callable

from ..kv_dtype import CHOICES as KV_CACHE_DTYPES
from .workloads import WORKLOADS, WorkloadOptions


def workload_args(p: argparse.ArgumentParser, num_prompts: int = 100, seed: bool = True) -> None:
    """seed=False where the engine flags already bring --seed (one seed for both)."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", "--dataset-name", dest="workload", choices=WORKLOADS, default="sharegpt",
                   help="(--dataset-name: vLLM's name for it)")
    g.add_argument("--num-prompts", type=int, default=num_prompts, help="requests in the workload")
    if seed:
        g.add_argument("--seed", type=int, default=0, help="workload seed")
    g.add_argument("--max-prompt-len", type=int, default=256,
                   help="sharegpt: skip longer prompts, or cut them with --truncate-prompts (vLLM: 1024)")
    g.add_argument("--truncate-prompts", action="store_true",
                   help="sharegpt: cut prompts longer than --max-prompt-len instead of dropping them")
    g.add_argument("--max-output-len", type=int, default=128, help="cap on every output length")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: every output exactly this long (vLLM's flag)")
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128, help="random")
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=64,
                   help="random, rag-doc-qa")
    g.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="random")
    g.add_argument("--system-tokens", type=int, default=160, help="chat-shared-system")
    g.add_argument("--num-system-prompts", type=int, default=1,
                   help="chat-shared-system: distinct system prompts, one picked at random per conversation")
    g.add_argument("--doc-tokens", type=int, default=1500, help="rag-doc-qa")


def warmup_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--warmup", type=int, default=1,
                   help=f"untimed passes of {what} before the timed one (0: time the cold pass alone)")


def workload_options(a: argparse.Namespace) -> WorkloadOptions:
    return WorkloadOptions(num_prompts=a.num_prompts, seed=a.seed, max_prompt_len=a.max_prompt_len,
                           max_output_len=a.max_output_len, input_len=a.input_len, output_len=a.output_len,
                           range_ratio=a.range_ratio, system_tokens=a.system_tokens,
                           num_system_prompts=a.num_system_prompts, doc_tokens=a.doc_tokens,
                           truncate=a.truncate_prompts, fixed_output_len=a.sharegpt_output_len)


def tokenizer_of(model: str | None):
    from ..loader import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(model))


def engine_kwargs(a: argparse.Namespace, engine_config) -> dict:
    """LLM(...) keyword arguments from the engine flags."""
    return {k: v for k, v in vars(engine_config(a)).items() if k != "tokenizer"}


def add_parsers(sub, add_engine_args, engine_config) -> None:
    # What a user runs against their own engine; the comparisons with other engines, the memory
    # analyses and the plots are in the repository's benchmarks/ (python -m benchmarks --help).
    b = sub.add_parser("bench", help="benchmarks of this engine: throughput, serve, latency, make-model")
    bs = b.add_subparsers(dest="bench_command", required=True)

    t = bs.add_parser("throughput", help="offline throughput of this engine on a workload")
    workload_args(t, seed=False)
    add_engine_args(t)
    t.add_argument("--n", type=int, default=1, help="samples per prompt (parallel sampling, temperature 0.8)")
    warmup_arg(t, "the workload")
    t.add_argument("--out", default="results/throughput.json", help="result JSON")
    t.set_defaults(func=lambda a: _throughput(a, engine_config))

    s = bs.add_parser("serve", help="drive a running server over HTTP")
    workload_args(s)
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to drive")
    s.add_argument("--model", default=None, help="tokenizer source for the workload (default model)")
    s.add_argument("--served-model-name", default=None, help="model field sent (default: the server's)")
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals; inf sends them all at once")
    s.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (None: no cap)")
    s.add_argument("--api-key", default=None, help="sent as Bearer token")
    s.add_argument("--host", default=None, help="with --port, instead of --base-url (vLLM's flags)")
    s.add_argument("--port", type=int, default=8000, help="with --host")
    s.add_argument("--metric-percentiles", default="99", help="comma list of percentiles to report (vLLM's flag)")
    s.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="which of ttft,tpot,itl,e2el the summary prints (vLLM's flag; the JSON has all)")
    s.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    s.add_argument("--label", default=None, help="name of this run in reports (None: workload and rate)")
    s.add_argument("--out", default="results/serve.json",
                   help="result JSON; vLLM's --result-dir / --result-filename override it")
    s.add_argument("--save-result", action="store_true", help="accepted for vLLM compatibility: we always save")
    s.add_argument("--result-dir", default=None, help="folder of the result JSON (None: that of --out)")
    s.add_argument("--result-filename", default=None, help="name of the result JSON (None: that of --out)")
    s.set_defaults(func=_serve)

    la = bs.add_parser("latency", help="latency of one batch, end to end, offline (vLLM's bench latency)")
    add_engine_args(la)
    la.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids)")
    la.add_argument("--output-len", type=int, default=128, help="tokens generated per sample (ignore_eos)")
    la.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    la.add_argument("--n", type=int, default=1, help="samples per prompt")
    la.add_argument("--num-iters-warmup", type=int, default=10, help="untimed runs first")
    la.add_argument("--num-iters", type=int, default=30, help="timed runs")
    la.add_argument("--out", "--output-json", dest="out", default="results/latency.json", help="result JSON")
    la.set_defaults(func=lambda a: _latency(a, engine_config))

    mk = bs.add_parser("make-model", help="a random-weight model of a real shape (HF layout), for speed where "
                       "matmuls dominate; every engine loads the same directory")
    mk.add_argument("--shape", required=True, help="tinyllama-1.1b, llama-3.2-1b or qwen2.5-0.5b")
    mk.add_argument("--out", required=True, help="model directory to write (kept if it already holds this shape)")
    mk.add_argument("--dtype", default="bfloat16", help="weights' dtype in the file")
    mk.add_argument("--seed", type=int, default=0, help="weights' seed")
    mk.add_argument("--tokenizer", default=None, help="model whose tokenizer it gets (default: SmolLM2-135M)")
    mk.set_defaults(func=_make_model)

    k = sub.add_parser("kv-calc", help="KV memory arithmetic for a model")
    _model_source(k)
    k.add_argument("--dtype", default="bfloat16", help="weights dtype (and KV's, unless --kv-cache-dtype)")
    k.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="how K/V are stored, as the engine's flag (auto: as --dtype)")
    k.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    k.add_argument("--batch", type=int, default=1, help="sequences")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    k.add_argument("--kv-cache-memory", default=None, help="KV budget (bytes or 4GiB)")
    k.add_argument("--gpu-memory", default=None, help="device memory (e.g. 40GiB): budget = util * it - weights")
    k.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of --gpu-memory used")
    k.add_argument("--max-model-len", type=int, default=None,
                   help="reservation per sequence in the reserve-max comparison, and whether one such sequence "
                   "fits the budget (default: the model's max_position_embeddings)")
    k.add_argument("--quantization", default=None, choices=["gguf"],
                   help="gguf: the weights are the --model GGUF file's own blocks (their real bytes), not "
                   "the parameters in --dtype")
    k.set_defaults(func=_kv_calc)

    sim = sub.add_parser("simulate", help="replay a length distribution through the allocator, no model")
    _model_source(sim)
    workload_args(sim, num_prompts=1000)
    sim.add_argument("--dtype", default="float16", help="weights and KV dtype")
    sim.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    sim.add_argument("--kv-cache-memory", default=None, help="KV budget, bytes or e.g. 4GiB "
                     "(default: from --gpu-memory)")
    sim.add_argument("--gpu-memory", default="40GiB", help="device memory: budget = util * it - weights")
    sim.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of --gpu-memory used")
    sim.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output")
    sim.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048, help="most tokens per step")
    sim.set_defaults(func=_simulate)

    pp = sub.add_parser("project-parallel", help="on paper: KV capacity and concurrency of TP x DP layouts "
                        "on 1-8 GPUs, replayed through the allocator, no model")
    _model_source(pp)
    workload_args(pp, num_prompts=1000)
    pp.add_argument("--dtype", default="float16", help="weights and KV dtype")
    pp.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    pp.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, a comma list (e.g. 80GiB,40GiB)")
    pp.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of --gpu-memory used")
    pp.add_argument("--activation-reserve", default="1.5GiB", help="per GPU, kept out of the KV budget")
    pp.add_argument("--gpus", default="1,2,4,8", help="comma list of GPU counts G")
    pp.add_argument("--tp", default=None, help="comma list of TP sizes (default: every t dividing G that "
                    "splits the heads, KV heads, MLP and vocab)")
    pp.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output")
    pp.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once per replica")
    pp.add_argument("--max-num-batched-tokens", type=int, default=2048, help="most tokens per step per replica")
    pp.add_argument("--out", default=None, help="also write the table to this file")
    pp.set_defaults(func=_project_parallel)


def _model_source(p) -> None:
    p.add_argument("--model", default=None, help="GGUF or HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--config", default=None, help="an HF config.json instead of a model")


def _model_cfg(a):
    from ..loader import load_config, resolve_model_dir
    from ..models import ModelConfig

    if a.config:
        with open(a.config) as f:
            return ModelConfig.from_hf(json.load(f)), a.config
    return ModelConfig.from_hf(load_config(resolve_model_dir(a.model))), a.model or "SmolLM2-135M-Instruct"


def _make_model(a) -> int:
    from ..loader import load_config
    from .shapes import make_model, parameter_count

    path = make_model(a.shape, a.out, a.dtype, a.seed, a.tokenizer)
    vocab = load_config(path)["vocab_size"]
    print(f"{a.shape}: {parameter_count(a.shape, vocab) / 1e9:.2f}B parameters (vocabulary {vocab}), random "
          f"weights, in {path}")
    return 0


def _throughput(a, engine_config) -> int:
    from .throughput import print_throughput, run_engine, save

    reqs = load_requests(a)
    r = run_engine(reqs, engine_kwargs(a, engine_config), n=a.n, temperature=0.8 if a.n > 1 else 0.0,
                   passes=a.warmup + 1)
    r["workload"], r["workload_options"] = a.workload, workload_options(a).as_dict()
    r["workload_summary"] = workload_summary(reqs)
    print_throughput(r)
    save(r, a.out)
    print(f"wrote {a.out}")
    return 0


def workload_summary(reqs) -> dict:
    p, o = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
    return {"num_requests": len(reqs), "mean_prompt_len": sum(p) / len(p), "max_prompt_len": max(p),
            "mean_output_len": sum(o) / len(o), "max_output_len": max(o)}


def load_requests(a):
    from .workloads import load_workload

    return load_workload(a.workload, tokenizer_of(a.model), workload_options(a))


def _serve(a) -> int:
    import httpx

    from .serve_client import print_serve, run_serve_bench
    from .throughput import save

    shown, percentiles = _percentile_args(a)
    base_url = f"http://{a.host}:{a.port}" if a.host else a.base_url
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    name = a.served_model_name or httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    r = run_serve_bench(base_url, name, load_requests(a), a.request_rate, a.max_concurrency, a.seed, a.api_key,
                        percentiles, progress=not a.disable_tqdm)
    r["label"] = a.label or f"{a.workload} rate={a.request_rate}"
    r["workload"] = a.workload
    print_serve(r, shown)
    out = _result_path(a)
    save(r, out)
    print(f"wrote {out}")
    return 0 if r["failed"] == 0 else 1


def _percentile_args(a) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """vLLM's --percentile-metrics and --metric-percentiles, checked before any request goes out."""
    shown = tuple(x for x in a.percentile_metrics.split(",") if x)
    if set(shown) - {"ttft", "tpot", "itl", "e2el"}:
        raise SystemExit(f"--percentile-metrics takes ttft,tpot,itl,e2el; got {a.percentile_metrics}")
    try:
        percentiles = tuple(float(x) for x in a.metric_percentiles.split(",") if x)
    except ValueError:
        raise SystemExit(f"--metric-percentiles takes numbers like 50,90,99; got {a.metric_percentiles}") from None
    if not all(0 < p <= 100 for p in percentiles):
        raise SystemExit(f"--metric-percentiles must be in (0, 100]; got {a.metric_percentiles}")
    return shown, percentiles


def _result_path(a) -> str:
    """vLLM's --result-dir / --result-filename, else --out."""
    if a.result_dir is None and a.result_filename is None:
        return a.out
    return os.path.join(a.result_dir or ".", a.result_filename or os.path.basename(a.out))


def _latency(a, engine_config) -> int:
    from .latency import print_latency, run_latency
    from .throughput import save

    r = run_latency(engine_kwargs(a, engine_config), a.input_len, a.output_len, a.batch_size, a.n,
                    a.num_iters_warmup, a.num_iters)
    print_latency(r)
    save(r, a.out)
    print(f"wrote {a.out}")
    return 0


def _refusals_as_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """The paper commands' refusals (a budget under a block, a block too small for a hybrid's
    state: what the engine would refuse) as one line on stderr and exit 2, not a traceback."""
    @functools.wraps(command)
    def run(a: argparse.Namespace) -> int:
        try:
            return command(a)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run


@_refusals_as_errors
def _kv_calc(a) -> int:
    from ..analysis.kv_calc import format_calc, kv_calc
    from ..config import parse_bytes

    cfg, name = _model_cfg(a)
    weights = None
    if a.quantization == "gguf":
        from ..loader.model_files import gguf_tensor_bytes

        weights = gguf_tensor_bytes(a.model)
    c = kv_calc(cfg, a.dtype, a.seq_len, a.batch, a.block_size,
                parse_bytes(a.kv_cache_memory) if a.kv_cache_memory else None, a.max_model_len,
                parse_bytes(a.gpu_memory) if a.gpu_memory else None, a.gpu_memory_utilization, a.kv_cache_dtype,
                weights)
    print(format_calc(name, c, a.seq_len, a.batch, a.block_size, a.dtype, a.max_model_len or cfg.max_position_embeddings))
    return 0


@_refusals_as_errors
def _simulate(a) -> int:
    from ..analysis.kv_calc import engine_groups, kv_calc
    from ..analysis.simulator import simulate
    from ..config import parse_bytes

    cfg, name = _model_cfg(a)
    c = kv_calc(cfg, a.dtype, block_size=a.block_size,
                budget_bytes=parse_bytes(a.kv_cache_memory) if a.kv_cache_memory else None,
                max_model_len=a.max_model_len, device_bytes=parse_bytes(a.gpu_memory),
                gpu_memory_utilization=a.gpu_memory_utilization)
    lengths = _sim_lengths(a)
    print(f"{name}: {c.num_blocks} blocks of {a.block_size} tokens ({c.budget_bytes / 2**30:.1f} GiB KV, "
          f"{c.bytes_per_token} bytes/token); {len(lengths)} {a.workload} requests")
    layout = engine_groups(cfg)
    if len(layout.groups) > 1:
        print(f"  layer groups: {', '.join(c.groups)} (a block holds one group's"
              + (f"; reserve-max keeps one table of every layer: {c.reserve_num_blocks} of its blocks)"
                 if c.reserve_num_blocks else ")"))
    for policy in ("paged", "reserve-max"):
        blocks = c.num_blocks if policy == "paged" else c.reserve_num_blocks
        if not blocks:
            print(f"  {policy:<12} not run: a recurrent state keeps block tables of its own")
            continue
        s = simulate(lengths, blocks, a.block_size, policy, a.max_num_seqs, a.max_num_batched_tokens,
                     a.max_model_len, a.seed, layout=layout)
        print(f"  {policy:<12} steps {s.steps:>6}  max batch {s.max_concurrent_seqs:>4}  mean batch "
              f"{s.mean_batch_seqs:7.1f}  mean usage {s.mean_usage:6.1%}  mean waste {s.mean_waste:6.1%}  "
              f"preemptions {s.preemptions}")
    return 0


def _sim_lengths(a) -> list[tuple[int, int]]:
    """(prompt, output) lengths of the workload, counted by the default tokenizer (a --config
    has none), dropping requests longer than --max-model-len."""
    reqs = load_requests(argparse.Namespace(**{**vars(a), "model": None}))
    return [(r.prompt_len, r.output_len) for r in reqs if r.prompt_len + r.output_len <= a.max_model_len]


@_refusals_as_errors
def _project_parallel(a) -> int:
    from ..analysis.parallel import ParallelAssumptions, format_projection, project_parallel
    from ..config import parse_bytes

    cfg, name = _model_cfg(a)
    assume = ParallelAssumptions(a.dtype, a.gpu_memory_utilization, parse_bytes(a.activation_reserve), a.block_size,
                                 a.max_model_len, a.max_num_seqs, a.max_num_batched_tokens)
    lengths = _sim_lengths(a)
    rows = project_parallel(cfg, lengths, [parse_bytes(m) for m in a.gpu_memory.split(",") if m],
                            tuple(int(g) for g in a.gpus.split(",") if g),
                            [int(t) for t in a.tp.split(",") if t] if a.tp else None, assume, a.seed)
    mean_p = sum(p for p, _ in lengths) / len(lengths)
    mean_o = sum(o for _, o in lengths) / len(lengths)
    workload = (f"{len(lengths)} {a.workload} requests (seed {a.seed}, prompt <= {a.max_prompt_len}, output <= "
                f"{a.max_output_len}; mean prompt {mean_p:.0f}, mean output {mean_o:.0f} tokens)")
    text = format_projection(name, rows, assume, workload)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {a.out}")
    return 0


