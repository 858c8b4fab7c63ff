"""kv-calc and the allocation simulator against the real engine; the TP x DP projection on top of them."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from pagedllm.analysis.kv_calc import kv_calc, param_count
from pagedllm.analysis.parallel import ParallelAssumptions, format_projection, layouts, project_parallel
from pagedllm.analysis.simulator import simulate
from pagedllm.loader import load_config
from pagedllm.models import ModelConfig


def test_kv_calc_rejects_bad_input(model_dir):
    cfg = ModelConfig.from_hf(load_config(model_dir))
    with pytest.raises(ValueError, match="dtype"):
        kv_calc(cfg, "float64")
    with pytest.raises(ValueError, match="smaller than one block"):
        kv_calc(cfg, budget_bytes=10)


def test_kv_calc_of_a_mixture_and_max_model_len():
    """A mixture's weights hold every expert and a token reads its top k; a GGUF's real bytes replace the
    parameters' (the active share scales with them); whether one max_model_len sequence fits the budget."""
    from pagedllm.analysis.kv_calc import format_calc

    cfg = ModelConfig.from_hf({"model_type": "qwen3_moe", "hidden_size": 1024, "num_hidden_layers": 24,
                               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
                               "vocab_size": 49152, "intermediate_size": 3072, "moe_intermediate_size": 384,
                               "num_experts": 64, "num_experts_per_tok": 8, "max_position_embeddings": 4096})
    c = kv_calc(cfg, "bfloat16", budget_bytes=2**30, max_model_len=4096)
    assert c.weights_bytes == 2 * param_count(cfg) and c.active_weights_bytes == 2 * param_count(cfg, active=True)
    assert c.active_weights_bytes < c.weights_bytes / 5
    assert "fits" in format_calc("m", c, 2048, 1, 16, "bfloat16", 4096)
    q8 = kv_calc(cfg, "bfloat16", budget_bytes=2**30, weights_bytes=c.weights_bytes // 2)
    assert q8.weights_bytes == c.weights_bytes // 2 and abs(q8.active_weights_bytes - c.active_weights_bytes / 2) < 2
    # a budget of 100 blocks holds no 4096-token sequence (256 blocks of 16)
    small = kv_calc(cfg, "bfloat16", budget_bytes=c.bytes_per_block * 100, max_model_len=4096)
    assert small.max_model_len_blocks == 256 and "does NOT fit the 100 blocks" in \
        format_calc("m", small, 2048, 1, 16, "bfloat16", 4096)


GRANITE_H = {"model_type": "granitemoehybrid", "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
             "num_key_value_heads": 4, "vocab_size": 49152, "intermediate_size": 4096, "max_position_embeddings": 4096,
             "num_local_experts": 0, "shared_intermediate_size": 4096, "mamba_n_heads": 32, "mamba_d_head": 64,
             "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
             "layer_types": ["mamba"] * 3 + ["attention"] + ["mamba"] * 5 + ["attention"] + ["mamba"] * 2}


def test_kv_calc_counts_a_hybrids_state_blocks():
    """Granite 4.0-H's shape: 2 attention layers and 10 Mamba-2 ones make 6 groups of 2 layer slots
    (kv.groups); a sequence holds its K/V blocks and one state block in each of 5 state groups, so
    4 GiB holds 292 sequences of 2,048 tokens, not the 1,024 its K/V alone would say; a block too
    small for the state is refused naming the size its larger (V) rows need."""
    from pagedllm.analysis.kv_calc import format_calc

    cfg = ModelConfig.from_hf(GRANITE_H)
    c = kv_calc(cfg, "bfloat16", seq_len=2048, block_size=1024, budget_bytes=4 * 2**30)
    assert c.bytes_per_token == 2 * 2 * 4 * 64 * 2                 # M_KV's: the attention layers'
    assert c.bytes_per_block == 2 * 2 * 4 * 64 * 2 * 1024          # g = 2 layer slots of 1,024 tokens
    assert c.groups == ("full",) + ("state",) * 5
    assert (c.num_blocks, c.blocks_per_seq, c.state_blocks_per_seq) == (2048, 7, 5)
    assert c.paged_max_seqs == 292 and c.reserve_max_seqs == 0
    text = format_calc("granite", c, 2048, 1, 1024, "bfloat16", 4096)
    assert "7 over 6 layer groups (1 full, 5 state" in text and "reserve-max: not run" in text
    with pytest.raises(ValueError, match=r"too small .* V rows, which hold 4096\): use block_size >= 1024"):
        kv_calc(cfg, block_size=16)


def test_kv_calc_counts_a_windowed_models_groups():
    """Gemma 3's pattern (5 windowed layers to 1 full): a block holds 2 layer slots, and a
    sequence of 2,048 tokens keeps 128 blocks in its full group and 32 (its 512-token window
    and the block it writes in) in each of 5 windowed ones, as the engine keeps them."""
    cfg = ModelConfig.from_hf({"model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 12,
                               "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                               "sliding_window": 512, "vocab_size": 262144, "intermediate_size": 2048,
                               "max_position_embeddings": 32768,
                               "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2})
    c = kv_calc(cfg, "bfloat16", seq_len=2048, block_size=16, budget_bytes=2**30)
    assert c.bytes_per_block == 2 * 2 * 256 * 2 * 16 and c.num_blocks == 2**30 // c.bytes_per_block
    assert c.blocks_per_seq == 128 + 5 * 32 and c.paged_max_seqs == c.num_blocks // 288
    # reserve-max keeps one table of every layer's K/V for max_model_len
    assert c.reserve_max_seqs == 2**30 // (12 * 2 * 256 * 2 * 16) // (32768 // 16)


def test_the_simulator_holds_a_hybrids_state_blocks():
    """Replayed over Granite 4.0-H's groups (kv_calc.engine_groups), every running sequence holds a
    block in each of the 5 state groups beside its K/V; one group of every layer would not."""
    from pagedllm.analysis.kv_calc import engine_groups

    layout = engine_groups(ModelConfig.from_hf(GRANITE_H))
    lengths = [(300, 40)] * 6
    grouped = simulate(lengths, 200, 1024, "paged", max_num_batched_tokens=2048, max_model_len=2048, layout=layout)
    alone = simulate(lengths, 200, 1024, "paged", max_num_batched_tokens=2048, max_model_len=2048)
    assert grouped.max_concurrent_seqs == alone.max_concurrent_seqs == 6
    assert grouped.peak_used_blocks >= 6 * (1 + 5) and alone.peak_used_blocks == 6


def test_project_parallel_fits_a_hybrids_sequence_with_its_state_blocks():
    """A replica fits when one max_model_len sequence does, counted as the engine keeps it: for
    Granite 4.0-H's shape at 4,096 tokens in blocks of 1,024, 4 K/V blocks and one in each of 5
    state groups (18 MiB), not 4,096 tokens of M_KV (8 MiB)."""
    from pagedllm.analysis.kv_calc import param_count
    from pagedllm.analysis.parallel import _replica

    cfg = ModelConfig.from_hf(GRANITE_H)
    a = ParallelAssumptions("bfloat16", 1.0, 0, 1024, 4096)
    weights = 2 * param_count(cfg)
    short = _replica(cfg, 1, weights + 12 * 2**20, a)
    assert not short["fits"] and "(0.02 GiB)" in short["reason"], short["reason"]
    assert _replica(cfg, 1, weights + 18 * 2**20, a)["fits"]


def test_simulator_paged_beats_reserve_max():
    rng = random.Random(0)
    lengths = [(rng.randint(20, 200), rng.randint(20, 200)) for _ in range(64)]
    paged = simulate(lengths, 400, 16, "paged", max_model_len=1024)
    reserve = simulate(lengths, 400, 16, "reserve-max", max_model_len=1024)
    assert reserve.max_concurrent_seqs == 400 // 64
    assert paged.max_concurrent_seqs >= 3 * reserve.max_concurrent_seqs
    assert reserve.mean_waste > 0.5 > paged.mean_waste


# --- TP x DP projection (pagedllm/analysis/parallel.py) ---

GIB = 2**30
LLAMA_13B = ModelConfig.from_hf(json.loads((Path(__file__).parents[2] / "benchmarks/configs/llama-13b.json").read_text()))


def _lengths(n: int = 24, seed: int = 1) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(20, 400), rng.randint(20, 300)) for _ in range(n)]


def _rows(mem_gib: float, gpus=(1, 2, 4, 8), **kw):
    return project_parallel(LLAMA_13B, _lengths(), [int(mem_gib * GIB)], gpus, **kw)


def test_parallel_tp_shards_kv_and_weights():
    a = ParallelAssumptions()
    weights = param_count(LLAMA_13B) * 2
    norm_bytes = (2 * LLAMA_13B.num_layers + 1) * LLAMA_13B.hidden_size * 2  # replicated on every rank
    rows = _rows(80, gpus=(8,))
    assert [r.tp for r in rows] == [1, 2, 4, 8] and [r.dp for r in rows] == [8, 4, 2, 1]
    for r in rows:
        assert r.kv_bytes_per_token_rank * r.tp == 2 * 40 * 40 * 128 * 2  # 2 L d_kv bytes, split t ways
        assert r.weights_per_gpu * r.tp == weights + (r.tp - 1) * norm_bytes
        assert r.kv_budget_per_gpu == int(80 * GIB * 0.9) - r.weights_per_gpu - a.activation_reserve_bytes
        assert r.kv_blocks_per_replica == r.kv_budget_per_gpu // (r.kv_bytes_per_token_rank * 16)
        assert r.kv_tokens_per_replica == 16 * r.kv_blocks_per_replica
    assert rows[0].kv_blocks_per_replica == kv_calc(LLAMA_13B, "float16", block_size=16,
                                                    budget_bytes=rows[0].kv_budget_per_gpu).num_blocks


def test_parallel_capacity_superlinear_in_tp_when_weights_dominate():
    rows = {r.tp: r for r in _rows(40, gpus=(8,))}
    # Splitting 24 GiB of weights frees memory on each rank on top of the per-rank KV saving.
    for t in (2, 4, 8):
        assert rows[t].kv_tokens_per_replica > t * rows[1].kv_tokens_per_replica
    # Same 8 GPUs: fewer weight copies, more KV for the cluster as t grows.
    cluster = [rows[t].cluster_kv_tokens for t in (1, 2, 4, 8)]
    assert cluster == sorted(cluster) and cluster[-1] > 2 * cluster[0]


def test_parallel_dp_replicas_multiply_concurrency():
    lengths = _lengths(64)
    a = ParallelAssumptions(max_num_seqs=8)  # a replica holds at most 8, so DP is what adds more
    rows = project_parallel(LLAMA_13B, lengths, [80 * GIB], (1, 2, 4, 8), tp_sizes=[1], a=a)
    for r in rows:  # the cluster serves the 64 requests, each replica every DP-th of them
        one = simulate(lengths[::r.dp], r.kv_blocks_per_replica, 16, "paged", 8, 2048, 2048)
        assert (r.max_seqs_per_replica, r.mean_seqs_per_replica) == (one.max_concurrent_seqs, one.mean_batch_seqs)
        assert r.cluster_max_seqs == r.dp * 8 and r.cluster_mean_seqs == pytest.approx(r.dp * one.mean_batch_seqs)
        assert r.bound == "max_num_seqs"
    assert [r.cluster_max_seqs for r in rows] == [8, 16, 32, 64]


def test_parallel_memory_bound_replica_gains_from_tp():
    # A small pool (40 GiB at TP=1: 840 blocks) with long requests fills up and preempts; TP=2 holds more.
    rng = random.Random(2)
    lengths = [(rng.randint(600, 1000), rng.randint(400, 900)) for _ in range(40)]
    rows = {r.tp: r for r in project_parallel(LLAMA_13B, lengths, [40 * GIB], (2,))}
    assert rows[1].bound == "memory" and rows[1].preemptions_per_replica > 0
    assert rows[2].max_seqs_per_replica > rows[1].max_seqs_per_replica


def test_parallel_rejects_tp_not_dividing_the_model():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's attention heads \(40\), "
                                         r"KV heads \(40\), vocab size \(32000\); this model allows \[1, 2, 4, 8\]"):
        project_parallel(LLAMA_13B, _lengths(), [80 * GIB], (6,), tp_sizes=[3])
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        project_parallel(LLAMA_13B, _lengths(), [80 * GIB], (8,), tp_sizes=[0])
    # The default sweep keeps only the layouts that split: 36 heads do not split 8 ways.
    assert layouts(dataclasses.replace(LLAMA_13B, num_heads=36), 8) == [1, 2, 4]
    assert layouts(LLAMA_13B, 8) == [1, 2, 4, 8]


def test_parallel_reports_does_not_fit():
    a = ParallelAssumptions()
    rows = {r.tp: r for r in _rows(24, gpus=(2,))}
    assert not rows[1].fits and rows[1].bound == "does not fit" and rows[1].kv_budget_per_gpu < 0
    assert rows[1].max_seqs_per_replica == rows[1].cluster_kv_tokens == 0
    assert "weights 24.2 GiB" in rows[1].reason
    assert rows[2].fits and rows[2].max_seqs_per_replica > 0
    text = format_projection("llama-13b", list(rows.values()), a, "test")
    assert "DOES NOT FIT" in text and "1.50 GiB activation reserve" in text and "all-reduce" in text
    # Fitting the weights is not enough: the pool must hold one max_model_len sequence.
    tight = ParallelAssumptions(max_model_len=2048, activation_reserve_bytes=int(0.9 * 26 * GIB)
                                - param_count(LLAMA_13B) * 2 - 2047 * 819200)
    (row,) = project_parallel(LLAMA_13B, _lengths(), [26 * GIB], (1,), a=tight)
    assert not row.fits and 0 < row.kv_budget_per_gpu < 2048 * 819200


def test_project_parallel_cli(tmp_path, capsys):
    from pagedllm.cli import main

    out = tmp_path / "proj.txt"
    assert main(["project-parallel", "--config", str(Path(__file__).parents[2] / "benchmarks/configs/llama-13b.json"),
                 "--workload", "random", "--num-prompts", "8", "--input-len", "64", "--output-len", "32",
                 "--gpu-memory", "80GiB,24GiB", "--gpus", "1,2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TP x DP projection" in text and "assumptions:" in text and "DOES NOT FIT" in text
    assert out.read_text().strip() == text.split(f"wrote {out}")[0].strip()
    assert len([ln for ln in text.splitlines() if "GiB  " in ln and ln.strip()[0].isdigit()]) == 6
