"""`pagedllm` command line: generate, serve, demo."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from .config import EngineConfig

# The seed's first scenario: many chats sharing one system prompt.
EXAMPLE_SYSTEM = ("You are a patient support agent for a public library. Answer in two or three short "
                  "sentences, be friendly, and suggest one next step the reader can take.")
EXAMPLE_QUESTIONS = [
    "How do I renew a book I borrowed last week?",
    "Can I reserve a study room for Saturday morning?",
    "What is the fine for returning a DVD three days late?",
    "Do you have audiobooks for children?",
    "How can I get a library card if I just moved here?",
    "Is there free wifi in the reading hall?",
    "Can I donate old magazines to the library?",
    "What time does the library close on Sundays?",
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (vLLM's flag names)")
    g.add_argument("--model", default=None, help="GGUF file or HF model dir (default: SmolLM2-135M-Instruct)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None, help="KV pool size, bytes or e.g. 2GiB")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="exact number of KV blocks")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--allocation", choices=["paged", "reserve-max"], default="paged")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--attention-backend", choices=["auto", "cpu", "torch", "triton"], default="auto",
                   help="auto: Triton paged-attention kernels on CUDA, the compiled CPU kernel elsewhere "
                        "(torch: the reference, gathers blocks for SDPA)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="a prompt with more uncomputed tokens than this is prefilled this many tokens a step, "
                        "leaving room for decodes and short prompts (0: a quarter of --max-num-batched-tokens)")
    g.add_argument("--max-num-partial-prefills", type=int, default=1,
                   help="long prompts prefilled at once; shorter ones are admitted past those that wait")
    g.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads (default: OMP_NUM_THREADS, else one per physical core); fewer are used "
                        "while other processes keep cores busy")
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens the same alone, in any batch and after preemption (vLLM's "
                        "VLLM_BATCH_INVARIANT): matmuls in a fixed reduction order (bf16 on AMX CPUs: our own "
                        "kernel, measured 1.1-1.2x oneDNN's throughput; otherwise oneDNN on 32-row tiles, "
                        "0.5-0.8x) and attention without split-K (a long context decoding alone uses fewer "
                        "threads); CPU attention backend only")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, allocation=args.allocation,
        dtype=args.dtype, device=args.device, seed=args.seed, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager, num_threads=args.num_threads,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills, batch_invariant=args.batch_invariant)


def kv_report(stats) -> str:
    s = stats
    return "\n".join([
        "KV cache report",
        f"  pool: {s.num_blocks} blocks x {s.block_size} tokens, {s.bytes_per_token} bytes/token "
        f"(2*L*d_kv*bytes), {s.num_blocks * s.block_size * s.bytes_per_token / 2**20:.0f} MiB",
        f"  peak blocks used: {s.peak_used_blocks} (peak U_kv {s.peak_kv_usage:.1%}); "
        f"now used {s.used_blocks}, cached-free {s.cached_free_blocks}, free {s.free_blocks}",
        f"  waste at peak (allocated slots holding no token): {s.peak_waste:.1%}",
        f"  prefix cache: {s.prefix_hits}/{s.prefix_queries} prompt tokens hit (H = {s.prefix_hit_rate:.1%})",
        f"  forks {s.forks}, copy-on-write copies {s.cow_copies}, evictions {s.evictions}, "
        f"preemptions {s.preemptions}",
        f"  tokens: {s.prompt_tokens} prompt ({s.computed_prompt_tokens} computed), {s.generation_tokens} generated, "
        f"in {s.steps} steps",
    ])


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import LLM
    from .sampling_params import SamplingParams

    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.sampling_seed, stop=args.stop or None,
                                ignore_eos=args.ignore_eos)
        llm = LLM(**vars(engine_config(args)))
        t0 = time.perf_counter()
        if args.chat or not args.prompts:
            questions = args.prompts or EXAMPLE_QUESTIONS
            system = args.system if args.system is not None else (None if args.prompts else EXAMPLE_SYSTEM)
            convs = [([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
                     for q in questions]
            outputs = llm.chat(convs, params)
            shown = questions
        else:
            outputs = llm.generate(args.prompts, params)
            shown = args.prompts
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    for q, out in zip(shown, outputs):
        print(f"\n>>> {q}")
        for c in out.outputs:
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{tag}{c.text.strip()}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    st = llm.get_stats()
    gen = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"\n{len(outputs)} requests, {gen} tokens generated in {elapsed:.2f} s "
          f"({gen / elapsed:.1f} tok/s, {llm.engine.runner.describe()})")
    print(kv_report(st))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_library_demo

    run_library_demo()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    return _run_server(args, engine_config(args))


def _run_server(args: argparse.Namespace, cfg, step_delay: float = 0.0, on_start=None) -> int:
    """Build the engine and serve it; on_start(state, hub) runs as a task once serving."""
    import asyncio
    import os
    import signal
    from contextlib import asynccontextmanager

    import uvicorn

    from .engine.async_engine import AsyncLLMEngine
    from .engine.engine import LLMEngine
    from .server.api import ServerState, create_app
    from .server.http import ConcurrencyLimit, GracefulShutdown, timed_h11
    from .viz.hub import VizHub

    keys = list(args.api_key or [])
    if not keys and os.environ.get("PAGEDLLM_API_KEY"):
        keys = [k for k in os.environ["PAGEDLLM_API_KEY"].split(",") if k]
    isolation = args.prefix_cache_isolation or ("per-key" if keys else "none")
    try:
        engine = LLMEngine(cfg)
        name = args.served_model_name or engine.model_name
        async_engine = AsyncLLMEngine(engine, args.max_queue_len, args.log_interval)
        async_engine.step_delay = step_delay
        hub = VizHub(engine, wake=async_engine.wake) if args.viz else None
        state = ServerState(async_engine, name, keys, isolation, args.max_body_bytes,
                            admin_key=args.admin_key or os.environ.get("PAGEDLLM_ADMIN_KEY") or None,
                            body_timeout=args.body_timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(state, hub)

    @asynccontextmanager
    async def lifespan(_app):
        task = asyncio.get_running_loop().create_task(on_start(state, hub)) if on_start else None
        yield
        if task is not None:
            task.cancel()
        async_engine.shutdown()  # after uvicorn drained (or gave up on) in-flight requests

    app.router.lifespan_context = lifespan
    logging.getLogger(__name__).info(
        "serving %s on http://%s:%d (API keys: %d, prefix-cache isolation: %s, visualizer: %s)",
        name, args.host, args.port, len(keys), isolation,
        f"http://{args.host}:{args.port}/viz/" if hub else "off")
    asgi = ConcurrencyLimit(app, args.limit_concurrency) if args.limit_concurrency else app
    shutdown = GracefulShutdown(asgi, state.closing, args.graceful_shutdown_timeout)
    # uvicorn's own graceful timeout is the backstop: it cancels what is left, tearing
    # streams. It starts a moment after the signal; ours ends them cleanly first, and
    # the margin lets their last events go out and their connections close.
    config = uvicorn.Config(shutdown, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=args.graceful_shutdown_timeout + 5, access_log=False,
                            http=timed_h11(args.header_timeout, args.body_timeout))
    # uvicorn drains in-flight requests on SIGTERM, then re-raises the signal against the
    # handler it found installed; a no-op one here lets a graceful shutdown exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = uvicorn.Server(config)
    exit_handler = server.handle_exit

    def handle_exit(sig, frame) -> None:
        if hub is not None:  # open /viz pages hold event streams: end them first, or shutdown waits on them
            hub.close_all()
        shutdown.begin()
        exit_handler(sig, frame)
    server.handle_exit = handle_exit
    server.run()
    logging.getLogger(__name__).info("server stopped")
    return 0


def cmd_viz(args: argparse.Namespace) -> int:
    """Serve the engine with the visualizer and play a scenario on it."""
    import asyncio
    import dataclasses

    from .viz.routes import run_scenario
    from .viz.scenarios import SCENARIOS

    sc = SCENARIOS[args.scenario]
    # The scenario's pool size etc., unless given as flags.
    cfg = dataclasses.replace(engine_config(args), **{k: v for k, v in sc.engine.items()
                                                      if getattr(args, k) == args.engine_defaults[k]})
    base = f"http://{args.host}:{args.port}/viz/"
    url = f"{base}?trace={sc.name}" if not sc.requests else base

    async def start(state, hub) -> None:
        print(f"\nPagedLLM visualizer: open {url}\n  scenario {sc.name}: {sc.description}", flush=True)
        if not sc.requests:
            print("  (replayed in the page from its trace; the live engine is idle)", flush=True)
            return
        if args.wait_for_viewer:
            print("  it starts when the page connects; run it again from the page or with "
                  f"POST {base}scenarios/{sc.name}/run", flush=True)
            while hub.num_subscribers == 0:
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # let the page draw its snapshot first
        await run_scenario(state, sc.name)

    return _run_server(args, cfg, args.step_delay, start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedLLM: PagedAttention inference engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete prompts and print a KV report")
    g.add_argument("prompts", nargs="*", help="prompts (none: a batch of chat questions sharing a system prompt)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--system", default=None, help="system prompt for --chat")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append")
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    add_server_args(sv)
    add_engine_args(sv)
    sv.set_defaults(func=cmd_serve)

    from .viz.scenarios import SCENARIOS

    vz = sub.add_parser("viz", help="serve the engine with the live KV visualizer and play a scenario")
    vz.add_argument("--scenario", choices=list(SCENARIOS), default="chat")
    vz.add_argument("--step-delay", type=float, default=0.3, help="seconds the engine waits after each step, "
                    "so the eye can follow (the page's speed control changes it)")
    vz.add_argument("--no-wait", dest="wait_for_viewer", action="store_false",
                    help="start the scenario at once, not when the page connects")
    add_server_args(vz)
    add_engine_args(vz)
    vz.set_defaults(func=cmd_viz, engine_defaults={a.dest: a.default for a in vz._actions})

    d = sub.add_parser("demo", help="worked examples on the real block manager")
    d.add_argument("name", choices=["library"])
    d.set_defaults(func=cmd_demo)

    from .bench.cli import add_parsers

    add_parsers(sub, add_engine_args, engine_config)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


def _number(kind: type, low: float, strict: bool = False):
    """argparse type: a `kind` number >= low (> low if strict), so a bad flag fails
    before the model loads."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n' if kind is int else ''} {kind.__name__}: {text!r}") \
                from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        return value
    return parse


def add_server_args(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", action="append", help="accepted key (repeatable; or PAGEDLLM_API_KEY=k1,k2)")
    sv.add_argument("--admin-key", default=None,
                    help="key for the visualizer's engine controls (pause, step, delay, scenarios) and for "
                         "seeing every tenant's text in it (or PAGEDLLM_ADMIN_KEY); with API keys and no admin "
                         "key the controls are off")
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--max-queue-len", type=int, default=1024, help="waiting requests beyond this get 503")
    sv.add_argument("--prefix-cache-isolation", choices=["none", "per-key"], default=None,
                    help="per-key (default when keys are set): tenants never share cached blocks")
    sv.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    sv.add_argument("--log-interval", type=float, default=10.0, help="seconds between status lines")
    sv.add_argument("--graceful-shutdown-timeout", "--shutdown-timeout", dest="graceful_shutdown_timeout",
                    type=_number(float, 0), default=30.0, metavar="SECONDS",
                    help="on SIGTERM, stop accepting and give in-flight requests this long to finish; then "
                         "streams end with an error event and data: [DONE], other requests get 503 "
                         "(default: %(default)g; vLLM's --shutdown-timeout defaults to 0)")
    sv.add_argument("--header-timeout", type=_number(float, 0, strict=True), default=10.0, metavar="SECONDS",
                    help="a connection must send complete request headers this soon, else 408 and closed "
                         "(default: %(default)g)")
    sv.add_argument("--body-timeout", type=_number(float, 0, strict=True), default=30.0, metavar="SECONDS",
                    help="a request body must arrive this soon after its headers, else 408 "
                         "(default: %(default)g)")
    sv.add_argument("--limit-concurrency", type=_number(int, 1), default=None, metavar="N",
                    help="API requests (/v1/...) in flight beyond N get 503 at once (default: no limit)")
    sv.add_argument("--viz", action=argparse.BooleanOptionalAction, default=True,
                    help="serve the KV visualizer at /viz/ (with API keys, each key sees its own requests' text "
                         "and only anonymous block ownership of others')")


if __name__ == "__main__":
    sys.exit(main())
