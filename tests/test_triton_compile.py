"""The Triton kernels compiled for real NVIDIA targets (sm_80, sm_90) on this GPU-less
machine, through the engine's attention backend: they must compile with no register
spills, use tensor cores for bf16 (over fp8 KV too), read K/V with 128-bit loads, and not
recompile as batch sizes and context lengths change (scripts/triton_compile_check.py does the work)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


def _why_not() -> str | None:
    spec = importlib.util.find_spec("triton")
    if spec is None:
        return "triton is not installed"
    if not (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        return "this triton build bundles no ptxas for NVIDIA targets"
    return None


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_kernels_compile_for_sm80_and_sm90(triton_compile_check):
    # The check runs in the background from the start of the run (tests/conftest.py, BackgroundRun).
    code, output, folder = triton_compile_check
    assert code == 0, output[-8000:]
    assert "OK: every kernel compiles cleanly" in output
    recs = json.loads((folder / "kernels.json").read_text())
    decode = [r for r in recs if r["kernel"] == "_decode_partition" and r["dtype"] == "bf16"]
    assert {r["arch"] for r in decode} == {80, 90}
    assert all(r["sass"].get("HMMA", 0) + r["sass"].get("HGMMA", 0) > 0 for r in decode)
    assert {r["kernel"] for r in recs} == {"_reshape_and_cache", "_decode_partition", "_decode_reduce", "_prefill"}
    # fp8 KV (bf16 queries over e4m3 rows): its own variants, on tensor cores, on both targets
    fp8 = [r for r in recs if r["kernel"] in ("_decode_partition", "_prefill") and r["constants"].get("FP8")]
    assert {(r["kernel"], r["arch"]) for r in fp8} == {(k, a) for k in ("_decode_partition", "_prefill")
                                                      for a in (80, 90)}
    assert all(r["sass"].get("HMMA", 0) + r["sass"].get("HGMMA", 0) > 0 for r in fp8)
