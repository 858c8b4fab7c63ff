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
from .knobs import Spec, spec_of

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


def add_knob_args(group: argparse._ActionsContainer, config: type, checked: bool = False) -> None:
    """One flag per knob() of the dataclass `config`, named after its field; help, type,
    choices and argparse's other options come from the field's metadata, so a new knob gets
    its flag by being declared once. `checked`: the flag checks the knob's range as it is read."""
    for f in dataclasses.fields(config):
        if spec_of(f) is not None:
            flag = dict(f.metadata["flag"])
            names = ["--" + f.name.replace("_", "-"), *flag.pop("aliases", ())]
            group.add_argument(*names, dest=f.name, default=f.default, help=f.metadata["help"],
                               **_flag_options(f.name, spec_of(f), f.default, checked), **flag)


def _flag_options(name: str, spec: Spec, default: Any, checked: bool) -> dict[str, Any]:
    if spec.kind is bool:  # off by default: a switch; on by default: --x / --no-x
        return {"action": "store_true" if not default else argparse.BooleanOptionalAction}
    options: dict[str, Any] = {} if spec.choices is None else {"choices": list(spec.choices)}
    if spec.parse is not None or spec.kind is not None:
        options["type"] = _flag_type(name, spec, checked)
    return options


def _flag_type(name: str, spec: Spec, checked: bool) -> Callable[[str], Any]:
    """argparse type that reads the text, passing a parser's own ValueError message on (it
    names the field and the allowed form, where argparse would print only 'invalid value');
    `checked`: the knob's check too (its range, its choices)."""
    read = spec.parse or spec.kind
    if read in (int, float) and not checked:
        return read

    def parse(text: str) -> Any:
        value = read(text) if read in (int, float) else _message_kept(read, text)  # int: argparse's own message
        return _message_kept(lambda v: spec.check(name, v), value) if checked else value
    parse.__name__ = read.__name__
    return parse


def _message_kept(function: Callable[[Any], Any], value: Any) -> Any:
    try:
        return function(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The EngineConfig's flags, checked when the config is built (its error names the field
    in one line, before the model loads)."""
    add_knob_args(p.add_argument_group("engine (vLLM's flag names)"), EngineConfig)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def engine_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The defaults of a parser's flags by dest, to tell a flag given from one left alone."""
    return {a.dest: a.default for a in parser._actions}


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import LLM
    from .engine.kv_report import kv_report
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
    from .server.launch import serve
    from .server.options import ServerOptions

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


def add_server_args(sv: argparse.ArgumentParser) -> None:
    """ServerOptions' flags, checked as they are read (the options are built only once the
    port is found free), then the Ray front's and the visualizer's switch."""
    from .server.options import ServerOptions  # a plain module: no server stack at parse time

    add_knob_args(sv, ServerOptions, checked=True)
    ray = sv.add_argument_group("replicas on Ray Serve (--ray)")
    ray.add_argument("--ray", action="store_true",
                     help="serve engine replicas on Ray Serve (on the cluster RAY_ADDRESS names, else a local one): "
                          "placed and restarted by Serve, a prefix-aware request router in front")
    ray.add_argument("--replicas", type=_at_least(int, "replicas", ge=1), default=1, metavar="N",
                     help="engine replicas (--ray; the initial number when autoscaled)")
    ray.add_argument("--min-replicas", type=_at_least(int, "min_replicas", ge=0), default=None, metavar="N",
                     help="autoscale (--ray) between --min-replicas and --max-replicas on the requests each "
                          "replica has in flight")
    ray.add_argument("--max-replicas", type=_at_least(int, "max_replicas", ge=1), default=None, metavar="N",
                     help="see --min-replicas")
    ray.add_argument("--target-ongoing-requests", type=_at_least(float, "target_ongoing_requests", gt=0),
                     default=8.0, metavar="N",
                     help="autoscaling's target of requests in flight per replica (Serve's; default %(default)g)")
    ray.add_argument("--cpus-per-replica", type=_at_least(float, "cpus_per_replica", ge=0), default=1.0, metavar="N",
                     help="CPUs Ray reserves for each replica (default %(default)g)")
    sv.add_argument("--viz", action=argparse.BooleanOptionalAction, default=True,
                    help="serve the KV visualizer at /viz/ (with API keys, each key sees its own requests' text "
                         "and only anonymous block ownership of others')")


def _at_least(kind: type, name: str, **bound: float) -> Callable[[str], Any]:
    """The flag type of a number with a lower bound that is no knob (the Ray front's scaling)."""
    return _flag_type(name, Spec(kind, **bound), checked=True)


def run() -> int:
    """The `pagedllm` command: main(), then the process ends (util.spare_final_collections)."""
    from .util import spare_final_collections

    try:
        return main()
    finally:
        spare_final_collections()


if __name__ == "__main__":
    sys.exit(run())
