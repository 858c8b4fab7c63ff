"""kv-calc and the allocation simulator against the real engine; the TP x DP projection on top of them."""
from __future__ import annotations

import random

import pytest

from pagedllm import SamplingParams
from pagedllm.analysis.kv_calc import kv_calc, param_count
from pagedllm.analysis.simulator import simulate
from pagedllm.loader import load_config
from pagedllm.models import ModelConfig


def test_kv_calc_matches_formula_and_engine(model_dir, llm_fp32):
    cfg = ModelConfig.from_hf(load_config(model_dir))
    c = kv_calc(cfg, "float32", seq_len=1000, batch=3, block_size=16, budget_bytes=256 * 2**20)
    # M_KV = 2 * L * d_kv * S * b * bytes, for SmolLM2: L=30, d_kv = 3 heads * 64.
    assert c.m_kv_bytes == 2 * 30 * 192 * 1000 * 3 * 4
    assert c.bytes_per_token == llm_fp32.engine.runner.kv_cache.bytes_per_token == 46080
    assert c.num_blocks == llm_fp32.get_stats().kv.num_blocks  # the engine sized 256MiB the same way
    assert c.blocks_per_seq == 63 and c.paged_max_seqs == c.num_blocks // 63
    assert abs(param_count(cfg) - 134_515_008) < 1e6


def test_simulator_matches_engine_counters(make_llm):
    rng = random.Random(3)
    lengths = [(rng.randint(5, 60), rng.randint(3, 30)) for _ in range(12)]
    prompts = [[rng.randrange(100, 40000) for _ in range(p)] for p, _ in lengths]
    kw = dict(num_gpu_blocks_override=20, max_model_len=256, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    llm = make_llm(dtype="float32", **kw)
    llm.engine.step_log = []
    llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in lengths], use_tqdm=False)
    log = llm.engine.step_log
    st = llm.get_stats()
    sim = simulate(lengths, 20, 16, "paged", max_num_batched_tokens=64, max_model_len=256, prompts=prompts)
    assert st.preemptions > 0, "the replay should exercise preemption"
    assert sim.steps == pytest.approx(len(log), rel=0.05)
    assert sim.preemptions == pytest.approx(st.preemptions, rel=0.05)
    assert sim.peak_used_blocks == pytest.approx(st.peak_used_blocks, rel=0.05)
    assert sim.mean_usage == pytest.approx(sum(s["usage"] for s in log) / len(log), rel=0.05)
    assert sim.mean_waste == pytest.approx(sum(s["waste"] for s in log) / len(log), rel=0.05)
    assert sim.max_concurrent_seqs == max(s["batch_seqs"] for s in log)


# --- TP x DP projection (pagedllm/analysis/parallel.py) ---
