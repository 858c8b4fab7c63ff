"""The documentation site builds with `mkdocs build --strict` (a broken link between pages, a
missing page or a docstring mkdocstrings cannot read fails it), its generated reference pages
hold every CLI flag and every route, and the README stays a short front page."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocstrings", reason="the docs extra (mkdocstrings needs Python >= 3.11)")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                          **__import__("os").environ})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def test_every_serve_flag_and_route_is_in_the_reference(site):
    from pagedllm.cli import build_parser

    cli = (site / "reference" / "cli" / "index.html").read_text()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = [f for a in serve._actions for f in a.option_strings if f.startswith("--") and f != "--help"]
    assert len(flags) > 50 and not [f for f in flags if f"<code>{f}</code>" not in cli]
    http = (site / "reference" / "http" / "index.html").read_text()
    for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings", "/rerank", "/metrics"):
        assert f"<code>{route}</code>" in http, route
    python = (site / "reference" / "python" / "index.html").read_text()
    assert "embed" in python and "SamplingParams" in python and "EngineConfig" in python


def test_benchmarks_page_has_every_plot(site):
    page = (site / "benchmarks" / "index.html").read_text()
    plots = sorted((ROOT / "benchmarks" / "results" / "report").glob("*.png"))
    referenced = [p for p in plots if p.name in page]
    assert referenced and all((site / "benchmarks" / "results" / "report" / p.name).exists() for p in referenced)


def test_readme_is_a_short_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "docs/index.md" in readme and "mkdocs serve" in readme
