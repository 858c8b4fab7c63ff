"""Benchmark workloads, report and baselines (small and fast; the real runs are scripts)."""
from __future__ import annotations

import builtins
import json
import re
from pathlib import Path

import pytest

from benchmarks.lib.report import write_report
from pagedllm.bench.throughput import save
from pagedllm.bench.workloads import WorkloadOptions, load_workload


@pytest.fixture(scope="module")
def tok(model_dir):
    from pagedllm.loader import load_tokenizer

    return load_tokenizer(model_dir)


def test_report_regenerates_every_committed_plot(tmp_path):
    """`pagedllm bench report` on the committed results draws one PNG per experiment, the
    ones BENCHMARKS.md embeds, without re-running anything."""
    root = Path(__file__).resolve().parents[1]
    results = sorted(str(p) for p in (root / "benchmarks" / "results").glob("*.json"))
    written = {p.name for p in write_report(results, str(tmp_path))}
    text = (root / "BENCHMARKS.md").read_text()
    embedded = set(re.findall(r"\]\(benchmarks/results/report/([\w-]+\.png)\)", text))
    assert len(embedded) >= 10 and embedded <= written, embedded - written
    for name in embedded:
        assert (root / "benchmarks" / "results" / "report" / name).is_file(), f"{name} embedded, not committed"
    # every result file gets its plot (the serving runs share one); gpu_smoke is one ratio, no plot
    stems = {Path(p).stem for p in results} - {"gpu_smoke_h200"}
    serve = {s for s in stems if s.startswith("serve_chat")}
    assert {f"{s}.png" for s in stems - serve} | {"serving_ttft_cdf.png"} <= written


def test_llama_cpp_skipped_cleanly_without_the_extra(monkeypatch, tok):
    from benchmarks.lib import baselines
    from benchmarks.lib.compare import run_compare

    real_import = builtins.__import__

    def no_llama(name, *a, **kw):
        if name.startswith("llama_cpp"):
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    assert "not installed" in baselines.llama_cpp_available()
    reqs = load_workload("random", tok, WorkloadOptions(num_prompts=2, input_len=8, output_len=4))
    results = run_compare(reqs, "random", {"dtype": "float32"}, [], 4, 1,
                          skip={"pagedllm", "variants", "vllm", "openvino", "openvino-u8", "hf", "hf-batch"})
    assert results == [{"engine": "llama.cpp", "workload": "random", "round": 1, "skipped": results[0]["skipped"]}]
    json.dumps(results)


def test_provenance_names_commit_torch_threads_and_cpu():
    from pagedllm.bench.provenance import provenance

    p = provenance()
    assert len(p["commit"]) == 40 and p["torch"] and p["threads"] >= 1 and p["cpu"]
    assert isinstance(p["cpu_flags"], list)


def test_lm_eval_mc_workload_shares_one_few_shot_prefix_and_plots(tmp_path, tok):
    """benchmarks/lm_eval_mc.py's task: the same questions from the same seed, loaded by lm-eval from
    the folder it is written to, every request behind one 5-shot prefix of MMLU-like length; a result
    file of that benchmark gets its plot."""
    import os.path

    from lm_eval.tasks import TaskManager

    from benchmarks.lib.harness import mc_questions, write_mc_task

    assert mc_questions(6, 1) == mc_questions(6, 1) != mc_questions(6, 2)
    name = write_mc_task(tmp_path / "task", 3, 5)
    task = TaskManager(include_path=str(tmp_path / "task"), include_defaults=False).load([name])["tasks"][name]
    task.build_all_requests()
    contexts = [i.args[0] for i in task.instances]
    assert len(contexts) == 12 and [i.args[1] for i in task.instances[:4]] == [" A", " B", " C", " D"]
    assert 500 <= len(tok(os.path.commonprefix(contexts)).input_ids) <= 800
    run = {"label": "pagedllm serve, prefix caching", "wall_s": 2.0, "computed_tokens": 900, "prompt_tokens_sent": 3000,
           "metrics": {"acc": 0.25}}
    save({"benchmark": "lm_eval_mc", "workload": "mc 3x4, 5-shot",
          "results": [run, {**run, "label": "pagedllm serve, no prefix caching", "computed_tokens": 3000},
                      {"engine": "vllm", "label": "vllm serve", "skipped": "no venv"}]}, str(tmp_path / "lm_eval_mc.json"))
    written = write_report([str(tmp_path / "lm_eval_mc.json")], str(tmp_path / "out"))
    assert (tmp_path / "out" / "lm_eval_mc.png") in written


def test_bench_latency_cli(tmp_path, capsys):
    from pagedllm.cli import main

    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--dtype", "float32", "--kv-cache-memory", "32MiB", "--input-len", "8",
                 "--output-len", "3", "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3",
                 "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Avg latency: " in text and "99% percentile latency: " in text and "10% percentile latency: " in text
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 3 and r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3)
    assert min(r["latencies"]) <= r["percentiles"]["50"] <= max(r["latencies"])
    assert set(r["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert r["batch_size"] == 2 and r["output_len"] == 3 and len(r["provenance"]["commit"]) == 40


def test_a_random_model_of_a_shape_loads_in_both_engines(make_llm, tmp_path, monkeypatch):
    """`pagedllm bench make-model`: HF's layout, the tokenizer's vocabulary when the shape's is
    smaller, the same greedy tokens from HF transformers and from us (fp32), and a second
    call keeps the directory."""
    import torch
    import transformers as tf

    from pagedllm import SamplingParams
    from pagedllm.bench import shapes

    monkeypatch.setitem(shapes.SHAPES, "toy", shapes.Shape("llama", 64, 2, 4, 2, 128, 32000, False, 10000.0, 512))
    monkeypatch.setitem(shapes.SHAPES, "toy-qwen", shapes.Shape("qwen2", 64, 2, 4, 2, 128, 50000, True, 1e6, 512,
                                                                attention_bias=True))
    for shape in ("toy", "toy-qwen"):
        out = shapes.make_model(shape, tmp_path / shape, dtype="float32")
        stamp = (out / "model.safetensors").stat().st_mtime_ns
        assert shapes.make_model(shape, out, dtype="float32") == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["vocab_size"] == max(shapes.SHAPES[shape].vocab_size, 49152)
        prompt = [1, 500, 42, 7000, 12]
        hf = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, 5:].tolist()
        llm = make_llm(model=str(out), dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
        got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        llm.close()
        assert got == want, shape
    with pytest.raises(ValueError, match="shape must be one of"):
        shapes.make_model("gpt-5", tmp_path / "x")


def test_a_compressed_tensors_w8a8_copy_holds_int8_weights_and_their_scales(tmp_path, monkeypatch):
    """The checkpoint vLLM's own W8A8 runs from (benchmarks/w8a8_vs_vllm.py): every decoder
    matmul int8 with a scale per output channel that brings it back within half a step, the
    rest as it was, and the quantization config vLLM's compressed-tensors loader reads."""
    import torch
    from safetensors.torch import load_file

    from pagedllm.bench import shapes
    from benchmarks.lib.int8_checkpoint import is_matmul_weight, write_w8a8

    monkeypatch.setitem(shapes.SHAPES, "toy", shapes.Shape("llama", 64, 2, 4, 2, 128, 32000, False, 10000.0, 512))
    src = shapes.make_model("toy", tmp_path / "toy", dtype="float32")
    dst = write_w8a8(src, tmp_path / "toy-w8a8")
    before, after = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    matmuls = [n for n in before if is_matmul_weight(n)]
    assert len(matmuls) == 2 * 7
    for name, w in before.items():
        if name in matmuls:
            q, s = after[name], after[name.replace(".weight", ".weight_scale")]
            assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (w.shape[0], 1)
            assert ((q.float() * s - w).abs() <= s / 2 + 1e-7).all(), name
            assert q.abs().amax(dim=1).eq(127).all()  # each row's largest weight is the top step
        else:
            assert torch.equal(after[name], w), name
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    group = cfg["config_groups"]["group_0"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    assert (group["weights"]["strategy"], group["input_activations"]["strategy"]) == ("channel", "token")
    assert group["input_activations"]["dynamic"] and cfg["ignore"] == ["lm_head"]
    assert (dst / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="no model.safetensors"):
        write_w8a8(tmp_path, tmp_path / "nothing")


def test_report_reads_serve_results_saved_before_the_flat_keys(tmp_path):
    """Committed benchmarks/results/serve_*.json nest their latencies (ttft_ms.mean, ttft_all_ms):
    they still report, beside a baseline that was skipped. Reports from fresh runs: test_bench_e2e.py
    (compare, memory) and tests/server/test_bench_serve.py (serve)."""
    legacy = {"label": "old serve", "request_throughput": 1.0, "output_throughput": 10.0, "prefix_hit_rate": 0.5,
              "ttft_ms": {"mean": 7.5, "median": 4, "p99": 9}, "tpot_ms": {"mean": 1, "median": 1, "p99": 2},
              "itl_ms": {"mean": 1, "median": 1, "p99": 2}, "ttft_all_ms": [3, 4, 9]}
    save({"results": [{"engine": "llama.cpp", "workload": "random", "skipped": "not installed"}]},
         str(tmp_path / "a.json"))
    save(legacy, str(tmp_path / "c.json"))
    files = write_report([str(tmp_path / n) for n in ("a.json", "c.json")], str(tmp_path / "out"))
    assert {p.name for p in files} == {"report.md", "serving_ttft_cdf.png"}, "no engine ran in a.json: no plot"
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| random | llama.cpp | skipped: not installed |" in md
    assert "| old serve | 1.00 | 10.0 | 7.5 | 4.0 | 9.0 | 1.0 | 1.0 | 50.0% |" in md
    assert (tmp_path / "out" / "serving_ttft_cdf.png").stat().st_size > 1000
