"""Weights on 2 MiB pages (runtime/host_pages.py) against 4 KiB pages, paired in one process, so
that the machine's drift (a shared host's memory bandwidth moved ±30 % within minutes here) falls
on both sides of every ratio.

- kernels: a mixture's bf16 experts at DeepSeek-V3/Moonlight's widths (64 of 1,408 x 2,048, top 6,
  packed in panels, 1.1 GB) and a dense 8,192 x 4,096 panel matmul, each placed twice (one copy
  advised to huge pages, one against them), the calls alternating, at 1 / 3 / 32 rows; the
  median of the paired ratios of 17 calls after 3 dropped.
- engines (--families): two engines of one model in one process, one with its weights moved at
  load as the engine does, one with them left where loading put them (4 KiB pages); their KV
  pools both on huge pages, as before the change. 32 ShareGPT prompts cut to 256, 64 new tokens,
  greedy, EOS ignored, as the issue-61 batch benchmarks; passes alternate for --rounds rounds.

    python -m benchmarks huge_pages --families v3,lfm2,granite --out benchmarks/results/huge_pages.json
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.bench.throughput import save

ROWS = (1, 3, 32)


def _place(t, huge: bool):
    """A copy of t in a mapping of its own, advised to huge pages or against them."""
    from pagedllm.runtime import host_pages

    m = host_pages.mapped(tuple(t.shape), t.dtype, huge=huge)
    host_pages.populate_all([m])
    return m.copy_(t)


def kernels() -> dict:
    import torch

    from pagedllm.kernels import load_ops
    from pagedllm.models.prepack import to_panels

    k = load_ops()
    if not k.has_panel_linear():
        raise SystemExit("kernels: the panels need AVX512-BF16")
    e, inter, hid, top = 64, 1408, 2048, 6
    g = torch.Generator().manual_seed(0)
    w13 = to_panels((torch.randn(e, 2 * inter, hid, generator=g) * 0.02).bfloat16()).view(e, 2 * inter, hid)
    w2 = to_panels((torch.randn(e, hid, inter, generator=g) * 0.02).bfloat16()).view(e, hid, inter)
    moe = {h: (_place(w13, h), _place(w2, h)) for h in (False, True)}
    del w13, w2
    n, kk = 8192, 4096
    wd = to_panels((torch.randn(n, kk, generator=g) * 0.02).bfloat16())
    dense = {h: _place(wd, h) for h in (False, True)}
    del wd

    def once(f) -> float:
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    out: dict = {}
    for m in ROWS:
        x, xd = torch.randn(m, hid, generator=g).bfloat16(), torch.randn(m, kk, generator=g).bfloat16()
        ws, ex = torch.softmax(torch.rand(m, e, generator=g), -1).topk(top, -1)
        ws, ex = ws.float().contiguous(), ex.contiguous()
        y, yd = torch.empty_like(x), torch.empty(m, n, dtype=torch.bfloat16)
        calls = {"experts": lambda h: k.moe_experts(y, x, *moe[h], ws, ex, 0, 0, e, True),
                 "dense": lambda h: k.panel_linear(yd, xd, dense[h], None)}
        for name, call in calls.items():
            ms = {h: [] for h in (False, True)}
            for _ in range(20):
                for h in (False, True):
                    ms[h].append(once(lambda: call(h)) * 1e3)
            ratios = [a / b for a, b in zip(ms[False][3:], ms[True][3:])]
            out[f"{name} {m} rows"] = {"ms_4k": statistics.median(ms[False][3:]),
                                        "ms_huge": statistics.median(ms[True][3:]),
                                        "huge_speedup": statistics.median(ratios)}
            r = out[f"{name} {m} rows"]
            print(f"{name} at {m} rows: 4 KiB {r['ms_4k']:.2f} ms, 2 MiB {r['ms_huge']:.2f} ms: "
                  f"{r['huge_speedup']:.2f}x (paired)", flush=True)
    return out


def model_path(family: str) -> tuple[str, dict]:
    if family in ("v2_lite", "v3"):
        from benchmarks.mla import model_dir
        return str(model_dir(family)), {}
    from benchmarks.hybrid_state import FAMILIES, model_dir
    return str(model_dir(family)), dict(FAMILIES[family][3])


def engines(family: str, rounds: int) -> dict:
    """Paired batch passes of the family's model, weights moved or not (in this process)."""
    from pagedllm.runtime import prepare
    from benchmarks.moe import requests
    from pagedllm import LLM, SamplingParams

    path, kw = model_path(family)
    reqs = requests(32, 256, 64)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    llms = {"huge": LLM(model=path, dtype="bfloat16", max_model_len=2048, kv_cache_memory="1GiB", **kw)}
    moving = prepare.weights_to_huge_pages
    prepare.weights_to_huge_pages = lambda model: 0   # the second engine keeps its weights where they were loaded
    try:
        llms["4k"] = LLM(model=path, dtype="bfloat16", max_model_len=2048, kv_cache_memory="1GiB", **kw)
    finally:
        prepare.weights_to_huge_pages = moving
    passes: dict[str, list[dict]] = {k: [] for k in llms}
    for llm in llms.values():   # a cold pass each, not counted
        llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    for _ in range(rounds):
        for name, llm in llms.items():
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
            dt = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            passes[name].append({"elapsed_s": dt, "output_tok_s": tokens / dt})
            print(f"{family} {name}: {tokens / dt:.1f} tok/s", flush=True)
    ratios = [a["elapsed_s"] / b["elapsed_s"] for a, b in zip(passes["4k"], passes["huge"])]
    res = {"model": path, "passes": passes, "huge_speedup": statistics.median(ratios), "paired": ratios,
           "output_tok_s": statistics.median(p["output_tok_s"] for p in passes["huge"])}
    print(f"{family}: weights on huge pages {res['huge_speedup']:.3f}x (paired passes {[round(r, 3) for r in ratios]})")
    for llm in llms.values():
        llm.engine.close()
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="kernels,engines", help="comma list: kernels, engines")
    p.add_argument("--families", default="v3", help="engines: comma list of v3, v2_lite, lfm2, granite, qwen3_next")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    res: dict = {"benchmark": "huge_pages", "workload": "32 ShareGPT prompts cut to 256, 64 out"}
    if "kernels" in parts:
        res["kernels"] = kernels()
    if "engines" in parts:
        res["engines"] = {f: engines(f, a.rounds) for f in a.families.split(",")}
    if a.out:
        save(res, a.out)


if __name__ == "__main__":
    main()
