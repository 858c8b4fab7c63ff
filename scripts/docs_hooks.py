"""mkdocs hooks (mkdocs.yml): the pages written from the code when the site is built, so they
cannot go stale, and BENCHMARKS.md with its plots as the benchmarks page.

- reference/cli.md: every subcommand and flag, from pagedllm.cli.build_parser(), which builds
  the engine's and the server's flags from the knob() fields of EngineConfig and ServerOptions;
- reference/http.md: every route of the server, from the @app.<method>(path) decorators in
  pagedllm/server/ (its rooms too) and each handler's docstring or its request body model;
- benchmarks.md: BENCHMARKS.md, its plots (benchmarks/results/report/*.png) added as files.
A link from these pages to a file of the repository outside docs/ is shown as its path;
links between pages are left to mkdocs, which fails a --strict build on a broken one.
"""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- generated: (\w+) -->")


def on_files(files, config):
    files.append(File.generated(config, "benchmarks.md", content=_benchmarks()))
    for png in sorted((ROOT / "benchmarks" / "results" / "report").glob("*.png")):
        files.append(File(str(png.relative_to(ROOT)), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    return MARKER.sub(lambda m: {"cli": _cli, "http": _http}[m.group(1)](), markdown)


# -- benchmarks ---------------------------------------------------------------------------
def _benchmarks() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text()
    return re.sub(r"(?<!!)\[([^\]]+)\]\((?!https?:|#)([^)]+)\)", _repo_link, text)


def _repo_link(m: re.Match) -> str:
    target = m.group(2).split("#")[0]
    if (ROOT / target).exists() and not target.startswith("docs/"):
        return f"{m.group(1)} (`{target}`)"
    return m.group(0)


# -- the CLI -----------------------------------------------------------------------------
def _cli() -> str:
    from pagedllm.cli import build_parser

    parser = build_parser()
    out = ["```text", parser.format_usage().strip(), "```", ""]
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in subs._choices_actions}
    for name, sub in subs.choices.items():
        out += [f"## `pagedllm {name}`", "", helps.get(name) or sub.description or "", ""]
        out += _arguments(sub)
    return "\n".join(out)


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments", "positional arguments"):
            out += [f"**{group.title}**", ""]
        out += ["| flag | what it does |", "|---|---|"]
        for a in actions:
            flags = ", ".join(f"`{f}`" for f in a.option_strings) or f"`{a.dest}`"
            text = (a.help or "") % {**vars(a), "default": a.default, "prog": parser.prog} if a.help else ""
            if a.choices and "choices" not in text:
                text += f" (one of {', '.join(map(str, a.choices))})"
            out.append(f"| {flags} | {_cell(text)} |")
        out.append("")
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# -- the HTTP routes ---------------------------------------------------------------------
def _http() -> str:
    rows = []
    for path in sorted((ROOT / "pagedllm" / "server").rglob("*.py")) + [ROOT / "pagedllm" / "viz" / "routes.py"]:
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for d in fn.decorator_list:
                route = _route(d)
                if route is not None:
                    rows.append((route[1], route[0], _summary(fn, d), path.relative_to(ROOT)))
    out = ["| method | path | what | where |", "|---|---|---|---|"]
    for path, method, what, where in sorted(set(rows)):
        out.append(f"| {method} | `{path}` | {_cell(what)} | `{where}` |")
    return "\n".join(out)


def _route(d: ast.expr) -> tuple[str, str] | None:
    if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in ("get", "post", "delete") \
            and isinstance(d.func.value, ast.Name) and d.func.value.id == "app" and d.args \
            and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str):
        return d.func.attr.upper(), d.args[0].value
    return None


def _summary(fn, decorator: ast.Call) -> str:
    doc = ast.get_docstring(fn)
    if doc:
        return doc.split("\n\n")[0]
    for kw in decorator.keywords:   # openapi_extra=_body(Model, ...): the body it reads
        if kw.arg == "openapi_extra" and isinstance(kw.value, ast.Call):
            return "body: " + ", ".join(a.id for a in kw.value.args if isinstance(a, ast.Name))
    return ""
