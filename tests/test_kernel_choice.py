"""The kernel chooser beside other processes and in the engine: a verdict measured while a
neighbour spins is not cached; an engine records how each matmul runs; `pagedllm env` prints the
machine and the choice for each shape of the default model."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from pagedllm.kernels.chooser import KernelChooser
from pagedllm.models.prepack import layer_path
from pagedllm.util import allowed_cpus

from unit.test_kernel_chooser import _choose


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/stat tells whether others use our CPUs")
def test_a_verdict_measured_beside_a_busy_neighbour_is_not_cached(tmp_path):
    # One spinner per CPU we may use, each saying when it spins (a fixed sleep was shorter than
    # Python's start-up on a loaded machine). A single spinner went unseen once in CI: beside the
    # suite's other worker and our own threads it can be left a sliver of a short measurement, so
    # the neighbours fill every CPU and the chooser gets three tries to see them; it must see them
    # at least once, and every verdict it kept must be one that saw no one.
    spinners = [subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                                 stdout=subprocess.PIPE, text=True) for _ in allowed_cpus()]
    verdicts = []
    try:
        assert all(s.stdout.readline().strip() == "spinning" for s in spinners)
        time.sleep(0.2)
        for i in range(3):
            verdicts.append(_choose(KernelChooser(tmp_path / str(i), "b"), k=1024, rows=(1, 64, 256)))
            if verdicts[-1].source == "measured-busy":
                break
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    busy = verdicts[-1]
    assert busy.source == "measured-busy" and busy.measure_s > 0.05, [v.source for v in verdicts]
    assert not list((tmp_path / str(len(verdicts) - 1)).rglob("*.json"))   # the busy verdict was not stored
    assert all(v.source == "measured" for v in verdicts[:-1])


def test_the_engine_runs_each_matmul_on_the_path_chosen_for_its_shape(tiny_model):
    from pagedllm import LLM
    from pagedllm.kernels.chooser import chooser
    from pagedllm.models.prepack import linear_verdict

    llm = LLM(model=tiny_model, dtype="bfloat16", kv_cache_memory="32MiB", max_model_len=256)
    model = llm.engine.runner.model
    kernels = model.ops.k
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and m.weight is None:
            v = linear_verdict(m.out_features, m.in_features, torch.bfloat16, kernels, head=m is model.lm_head)
            assert layer_path(m) == v.route.describe(), name   # the engine's layer, the chooser's verdict
    assert chooser().forced is None
    llm.engine.close()


def test_env_prints_the_machine_and_the_choice_for_each_shape(capsys):
    out = subprocess.run([sys.executable, "-m", "pagedllm", "env", "--no-peaks", "--json"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    r = json.loads(out)
    assert r["machine"]["cpu"] and r["machine"]["threads"] >= 1 and r["machine"]["torch"] == torch.__version__
    ops = {(c["op"], c["n"], c["k"]) for c in r["choices"]}
    assert ("linear", 960, 576) in ops and ("linear", 49152, 576) in ops   # SmolLM2's qkv and LM head
    assert all(c["route"] for c in r["choices"]) and sum(c["layers"] for c in r["choices"] if c["op"] == "linear") == 121
    from pagedllm.env_report import print_report

    print_report(r)   # the text form of the same report
    text = capsys.readouterr().out
    assert "CPU:" in text and "kernel choice for" in text and "960 x 576" in text and "prefill attn" in text
