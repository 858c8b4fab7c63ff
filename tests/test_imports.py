"""What a fresh interpreter imports, checked in processes of their own: the memory manager,
the scheduler and the step plan are plain Python (the simulator and the property tests run
them without a model), and the server's API never pulls in the visualizer (it mounts itself)."""
from __future__ import annotations

import subprocess
import sys


def imported(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_kv_and_scheduler_import_without_torch():
    imported("import sys; import pagedllm.kv, pagedllm.engine.scheduler, pagedllm.engine.step_update, pagedllm.plan, "
             "pagedllm.analysis.simulator; assert 'torch' not in sys.modules, 'torch imported'")


def test_kv_alone_imports_without_torch():
    imported("import sys; import pagedllm.kv, pagedllm.demo; assert 'torch' not in sys.modules")


def test_server_api_does_not_import_viz():
    """At run time too: the visualizer mounts itself on the server's app."""
    assert imported("import sys, pagedllm.server.api; "
                    "print(sorted(m for m in sys.modules if m.startswith('pagedllm.viz')))") == "[]"
