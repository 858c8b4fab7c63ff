"""`pagedllm` command line: generate, serve, demo."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from . import __version__
from .config import EngineConfig

# The first serving scenario: many chats sharing one system prompt.
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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def _flag_type(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse type that passes a parser's own ValueError message on (it names the field
    and the allowed form), where argparse would print only 'invalid value'."""
    if kind in (int, float, str):
        return kind

    def parse(text: str) -> Any:
        try:
            return kind(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = kind.__name__
    return parse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named after it; help, type and choices come from the
    field's metadata, so a new knob gets its flag by being declared once."""
    g = p.add_argument_group("engine (vLLM's flag names)")
    for f in dataclasses.fields(EngineConfig):
        meta = dict(f.metadata)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):  # off by default: a switch; on by default: --x / --no-x
            meta["action"] = "store_true" if not f.default else argparse.BooleanOptionalAction
        elif "type" in meta or isinstance(f.default, (int, float)):
            meta["type"] = _flag_type(meta.get("type", type(f.default)))
        g.add_argument(flag, dest=f.name, default=f.default, **meta)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def engine_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The defaults of a parser's flags by dest, to tell a flag given from one left alone."""
    return {a.dest: a.default for a in parser._actions}


def _quantized(kv_cache_dtype: str) -> bool:
    from .kv_dtype import KV_DTYPES
    return KV_DTYPES[kv_cache_dtype].quantized


def tier_report(kv, tier_dir: str | None = None) -> str:
    """The second tier's line of the KV report (kv: a KVStats with a tier)."""
    c, t = kv.tier, kv.tier.store
    return (f"  tier: {t.blocks} blocks ({t.bytes / 2**20:.1f} MiB of {t.capacity_bytes / 2**30:.1f} GiB)"
            f"{f' in {tier_dir}' if tier_dir else ''}, {c.hits}/{kv.prefix_queries} prompt tokens from the "
            f"tier (tier hit rate {kv.tier_hit_rate:.1%}), loaded {c.loaded_blocks}, offloaded "
            f"{c.offloaded_blocks} (backlog {c.backlog}), evicted {t.evicted_blocks} (tier LRU), swap-outs "
            f"{c.swap_outs} ({c.swap_out_blocks} blocks), read failures {t.read_failures}, "
            f"write errors {t.write_errors}")


def groups_report(kv) -> list[str]:
    """A line per KV layer group, for a model whose layers mix attention types."""
    if len(kv.groups) < 2:
        return []
    held = ", ".join(f"{g.kind} {g.held_blocks if g.held_blocks is not None else '?'} held"
                     + (f" ({g.released} released)" if g.window else "") for g in kv.groups)
    return [f"  layer groups ({len(kv.groups)}, a block holds one group's layers): {held}"]


def adapters_report(kv) -> list[str]:
    """The LoRA adapters' pages in the pool (kv.adapter_pages), when any were placed."""
    a = kv.adapters
    if a is None or not a.loads:
        return []
    return [f"  LoRA adapters in the pool: {a.resident} resident ({a.held} in use: {a.held_pages} blocks; idle: "
            f"{a.idle_pages} blocks, free to take), {a.loads} paged in, {a.evictions} evicted"]


def weights_report(s) -> list[str]:
    """The weights beside the pool: held, and read a token where that is less (a mixture of experts)."""
    if not s.weights_bytes:
        return []
    active = s.active_weights_bytes
    return [f"  weights beside the pool: {s.weights_bytes / 2**30:.2f} GiB held"
            + (f", {active / 2**30:.2f} GiB read a token (its top k experts a layer)" if active != s.weights_bytes
               else "")]


def kv_report(stats, tier_dir: str | None = None) -> str:
    """The KV figures `pagedllm generate` prints; `tier_dir`: the --kv-offload-dir it names."""
    s, kv = stats, stats.kv
    return "\n".join([
        "KV cache report",
        f"  pool: {kv.num_blocks} blocks x {kv.block_size} tokens, KV {s.kv_cache_dtype}, {s.bytes_per_token} "
        f"bytes/token (2*L*d_kv*bytes{', scales included' if _quantized(s.kv_cache_dtype) else ''}), "
        f"{s.blocks_per_gib} blocks per GiB, {kv.num_blocks * (s.bytes_per_block or kv.block_size * s.bytes_per_token) / 2**20:.0f} MiB",
        f"  peak blocks used: {s.peak_used_blocks} (peak U_kv {s.peak_kv_usage:.1%}); "
        f"now used {kv.used_blocks}, cached-free {kv.cached_free_blocks}, free {kv.free_blocks}",
        f"  waste at peak (allocated slots holding no token): {s.peak_waste:.1%}",
    ] + weights_report(s) + [
        f"  prefix cache: {kv.prefix_hits}/{kv.prefix_queries} prompt tokens hit (H = {kv.hit_rate:.1%})",
    ] + groups_report(kv) + adapters_report(kv) + ([] if kv.tier is None else [tier_report(kv, tier_dir)]) + (
        [] if not kv.scores.queries else [
            f"  prompt logprobs from the cache: {kv.scores.hits}/{kv.scores.queries} prompt tokens "
            f"({kv.scores.hit_rate:.1%}; {kv.scores.entries} blocks keep theirs, {kv.scores.bytes / 2**20:.1f} of "
            f"{kv.scores.cap_bytes / 2**20:.0f} MiB outside the pool, {kv.scores.dropped} dropped at the cap)",
        ]) + [
        f"  forks {kv.forks}, copy-on-write copies {kv.cow_copies}, evictions {kv.pool.evictions}, "
        f"preemptions {s.preemptions}",
        f"  tokens: {s.prompt_tokens} prompt ({s.computed_prompt_tokens} computed), {s.generation_tokens} generated, "
        f"in {s.steps} steps",
    ] + ([] if s.spec is None else [
        f"  speculative decoding: {s.spec.num_accepted_tokens}/{s.spec.num_draft_tokens} draft tokens accepted "
        f"(acceptance {s.spec.acceptance_rate:.1%}) over {s.spec.num_drafts} verifications, "
        f"{s.spec.mean_accepted_length:.2f} tokens per verifying step; accepted by draft position "
        f"{s.spec.accepted_per_position}",
    ]))


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
    print(kv_report(st, args.kv_offload_dir))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_library_demo

    run_library_demo()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            print(f"error: two models given: {args.model_tag!r} and --model {args.model!r}", file=sys.stderr)
            return 2
        args.model = args.model_tag
    try:
        cfg = engine_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run_server(args, cfg)


def preflight(args: argparse.Namespace) -> None:
    """The cheap checks (the port free, the device there), before the model loads; the
    engine flags' own ranges were checked when EngineConfig was built."""
    from .preflight import check_device, check_port

    check_port(args.host, args.port)
    check_device(args.device)


def _run_server(args: argparse.Namespace, cfg, step_delay: float = 0.0, on_start=None) -> int:
    """Serve the engine (server/launch.py puts the server together); on_start(state, viz)
    runs as a task once serving."""
    try:  # before the imports below too: torch and the server stack take seconds
        preflight(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .server.launch import ServerOptions, serve

    opts = ServerOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)})
    if getattr(args, "ray", False):
        return _run_on_ray(args, cfg, opts)
    return serve(cfg, opts, _viz_attach(args, cfg, step_delay), on_start)


def _run_on_ray(args: argparse.Namespace, cfg, opts) -> int:
    """Engine replicas on Ray Serve (deploy/ray_serve.py), the ingress on --host:--port."""
    if cfg.data_parallel_size > 1:
        print("error: --ray runs its own replicas: give --replicas, not --data-parallel-size", file=sys.stderr)
        return 2
    try:
        from .deploy import ray_serve
    except ImportError:
        print("error: --ray needs Ray Serve: pip install 'pagedllm[ray]'", file=sys.stderr)
        return 2
    try:
        scaling = ray_serve.scaling_of(args)
        scaling.options()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return ray_serve.run(cfg, opts, scaling)


def _viz_attach(args: argparse.Namespace, cfg, step_delay: float):
    """The visualizer's hook for the server, or None. It watches one engine's blocks from
    inside its process, so data parallelism turns it off (said once in the log)."""
    if not args.viz:
        return None
    if cfg.data_parallel_size > 1:
        logging.getLogger(__name__).info("visualizer off: it shows a single engine, and --data-parallel-size "
                                         "is %d (pagedllm viz runs one)", cfg.data_parallel_size)
        return None
    from .viz.mount import VizMount

    return lambda engine: VizMount.on(engine, step_delay)


def cmd_viz(args: argparse.Namespace) -> int:
    """Serve the engine with the visualizer and play a scenario on it."""
    import asyncio

    from .viz.routes import run_scenario
    from .viz.scenarios import SCENARIOS

    sc = SCENARIOS[args.scenario]
    fields = sc.engine_fields(args.kv_offload_dir)
    if sc.tier and args.kv_offload_dir is None:  # the scenario's own tier folder lives as long as the server
        import atexit
        import shutil
        atexit.register(shutil.rmtree, fields["kv_offload_dir"], True)
    # The scenario's pool size etc., unless given as flags.
    try:
        cfg = dataclasses.replace(engine_config(args), **{k: v for k, v in fields.items()
                                                          if getattr(args, k) == args.engine_defaults[k]})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.data_parallel_size > 1:
        print("error: data_parallel_size: the visualizer shows one engine; run `pagedllm serve "
              f"--data-parallel-size {cfg.data_parallel_size}` to serve replicas", file=sys.stderr)
        return 2
    base = f"http://{args.host}:{args.port}/viz/"
    url = f"{base}?trace={sc.name}" if not sc.requests else base

    async def start(state, viz) -> None:
        print(f"\nPagedLLM visualizer: open {url}\n  scenario {sc.name}: {sc.description}", flush=True)
        if not sc.requests:
            print("  (replayed in the page from its trace; the live engine is idle)", flush=True)
            return
        if args.wait_for_viewer:
            print("  it starts when the page connects; run it again from the page or with "
                  f"POST {base}scenarios/{sc.name}/run", flush=True)
            while viz.hub.num_subscribers == 0:
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # let the page draw its snapshot first
        await run_scenario(state, sc.name)

    return _run_server(args, cfg, args.step_delay, start)


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)} (any case), got {text!r}")
    return text.upper()


def _every_parser(parser: argparse.ArgumentParser):
    """The parser and all its subcommands' parsers, however deep (bench has its own)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield from _every_parser(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedLLM: PagedAttention inference engine",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--log-level", type=_log_level, default="INFO", help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete prompts and print a KV report")
    g.add_argument("prompts", nargs="*", help="prompts (none: a batch of chat questions sharing a system prompt)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--system", default=None, help="system prompt for --chat")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per answer")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set of tokens with "
                   "this much probability")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--n", type=int, default=1, help="answers per prompt (they share the prompt's blocks)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed "
                   "(default: from the engine's --seed)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    sv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="model to serve, as in `vllm serve MODEL` (same as --model)")
    add_server_args(sv)
    add_engine_args(sv)
    sv.set_defaults(func=cmd_serve)

    from .viz.scenarios import SCENARIOS

    vz = sub.add_parser("viz", help="serve the engine with the live KV visualizer and play a scenario")
    vz.add_argument("--scenario", choices=list(SCENARIOS), default="chat", help="what the engine plays")
    vz.add_argument("--step-delay", type=float, default=0.3, help="seconds the engine waits after each step, "
                    "so the eye can follow (the page's speed control changes it)")
    vz.add_argument("--no-wait", dest="wait_for_viewer", action="store_false",
                    help="start the scenario at once, not when the page connects")
    add_server_args(vz)
    add_engine_args(vz)
    vz.set_defaults(func=cmd_viz, engine_defaults=engine_defaults(vz))

    e = sub.add_parser("env", help="this machine's CPU, its measured GEMM peaks, and the kernel chosen for each "
                       "matmul shape of a model (paste it into a bug report)")
    e.add_argument("--model", default=None, help="model whose matmul shapes to show (default: SmolLM2-135M-Instruct)")
    e.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="the matmuls' dtype (auto: bf16 where the CPU has it natively, as the engine's)")
    e.add_argument("--quantization", choices=["w8a8"], default=None, help="show W8A8's int8 paths instead")
    e.add_argument("--no-peaks", dest="peaks", action="store_false", help="skip measuring the GEMM peaks (~5 s)")
    e.add_argument("--json", action="store_true", help="print it as JSON")
    e.set_defaults(func=cmd_env)

    d = sub.add_parser("demo", help="worked examples on the real block manager")
    d.add_argument("name", choices=["library"], help="which example")
    d.set_defaults(func=cmd_demo)

    from .bench.cli import add_parsers

    add_parsers(sub, add_engine_args, engine_config)
    for p in _every_parser(parser):
        p.formatter_class = HelpFormatter
        if p is not parser:
            # SUPPRESS: a subcommand leaves the level given before it alone unless given again after it.
            p.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS,
                           help="logging level (default: as given before the subcommand, else INFO)")
    return parser


def cmd_env(args: argparse.Namespace) -> int:
    from .env_report import main as env_main

    return env_main(args.model, args.dtype, args.quantization, args.peaks, args.json)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on")
    sv.add_argument("--api-key", action="append", help="accepted key (repeatable; or PAGEDLLM_API_KEY=k1,k2; "
                    "default: none, no key needed)")
    sv.add_argument("--admin-key", default=None,
                    help="key for the visualizer's engine controls (pause, step, delay, scenarios) and for "
                         "seeing every tenant's text in it (or PAGEDLLM_ADMIN_KEY); with API keys and no admin "
                         "key the controls are off")
    sv.add_argument("--served-model-name", default=None, help="model name clients send (default: from the model)")
    sv.add_argument("--max-queue-len", type=int, default=1024, help="waiting requests beyond this get 503")
    sv.add_argument("--prefix-cache-isolation", choices=["none", "per-key"], default=None,
                    help="per-key (default when keys are set): tenants never share cached blocks")
    sv.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get 413")
    sv.add_argument("--metrics-prefix", default="pagedllm",
                    help="name prefix of the /metrics series; 'vllm' serves vllm:* so vLLM's Grafana "
                         "dashboards work unchanged (default: %(default)s)")
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
    from .server.parsers.tool_calls import TOOL_PARSERS  # a plain module: no server stack at parse time

    sv.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='serve tool_choice "auto" (the default when a chat request has tools): the model '
                         "writes free text, the --tool-call-parser reads its calls (vLLM's flag)")
    sv.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None, metavar="NAME",
                    help="what reads tool calls from the model's text under --enable-auto-tool-choice: "
                         f"{', '.join(sorted(TOOL_PARSERS))} (hermes: Hermes and Qwen's <tool_call> JSON; "
                         "llama3_json: Llama 3.1's JSON; mistral: [TOOL_CALLS]; pythonic: Llama 3.2/4's "
                         "[f(x=1)]; qwen3_coder: Qwen3-Coder's <function=...> XML)")
    sv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="PEFT LoRA adapters served under their own model names (needs --enable-lora; vLLM's "
                         "flag): name=path, or '{\"name\": ..., \"path\": ...}'; a request's model field picks one")
    from .server.parsers.reasoning import REASONING_PARSERS

    sv.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None, metavar="NAME",
                    help="split a reasoning model's <think>...</think> from its answer into chat's reasoning_content, "
                         "and start a structured output's grammar after it (vLLM's flag): "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    sv.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="send an OpenTelemetry trace of each request (an llm_request span with vLLM's gen_ai.* "
                         "attributes, and its queue, prefill and decode) to this OTLP/HTTP endpoint, e.g. "
                         "http://localhost:4318/v1/traces; a request's traceparent header joins the caller's trace "
                         "(default: no tracing)")
    sv.add_argument("--max-stored-responses", type=_number(int, 0), default=256, metavar="N",
                    help="Responses API: the responses kept per tenant (API key) for previous_response_id, least "
                         "recently used out, at most 64 MiB of them; 0 keeps none (default: %(default)s)")
    ray = sv.add_argument_group("replicas on Ray Serve (--ray)")
    ray.add_argument("--ray", action="store_true",
                     help="serve engine replicas on Ray Serve (on the cluster RAY_ADDRESS names, else a local one): "
                          "placed and restarted by Serve, a prefix-aware request router in front")
    ray.add_argument("--replicas", type=_number(int, 1), default=1, metavar="N",
                     help="engine replicas (--ray; the initial number when autoscaled)")
    ray.add_argument("--min-replicas", type=_number(int, 0), default=None, metavar="N",
                     help="autoscale (--ray) between --min-replicas and --max-replicas on the requests each "
                          "replica has in flight")
    ray.add_argument("--max-replicas", type=_number(int, 1), default=None, metavar="N", help="see --min-replicas")
    ray.add_argument("--target-ongoing-requests", type=_number(float, 0, strict=True), default=8.0, metavar="N",
                     help="autoscaling's target of requests in flight per replica (Serve's; default %(default)g)")
    ray.add_argument("--cpus-per-replica", type=_number(float, 0), default=1.0, metavar="N",
                     help="CPUs Ray reserves for each replica (default %(default)g)")
    sv.add_argument("--viz", action=argparse.BooleanOptionalAction, default=True,
                    help="serve the KV visualizer at /viz/ (with API keys, each key sees its own requests' text "
                         "and only anonymous block ownership of others')")


if __name__ == "__main__":
    sys.exit(main())
