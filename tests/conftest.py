from __future__ import annotations

import os

import pytest


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true (set by .ci/run) a skip is a failure: CI installs everything, so a test that skips there
    tests nothing. An expected failure (xfail) is not a skip and is left as it is."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and _ci():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (skips are failures in CI): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips at import (pytest.skip(allow_module_level=True), importorskip) fails too."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _ci():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"module skipped under CI=true (skips are failures in CI): {reason}"


@pytest.fixture(scope="session")
def model_dir():
    from pagedllm.loader import resolve_model_dir

    return resolve_model_dir(None)  # the default SmolLM2 GGUF, converted once into the cache


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def llm_fp32():
    from pagedllm import LLM

    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)
