"""Arrows run one way: the visualizer mounts itself on the server's app; the server
never imports the visualizer."""
from __future__ import annotations

import subprocess
import sys


def test_server_api_does_not_import_viz():
    code = ("import sys, pagedllm.server.api; "
            "print(sorted(m for m in sys.modules if m.startswith('pagedllm.viz')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
