"""What a new machine gets from the set-up: scripts/install.sh, pyproject's pins, the licence."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "scripts" / "install.sh"


def test_install_script_uses_this_python_and_asks_before_the_browser():
    text = INSTALL.read_text()
    commands = [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
    assert not [c for c in commands if re.match(r"(\|\|\s*)?pip3? ", c)], "bare pip: use python -m pip"
    assert "python -m pip install" in text
    # apt-get runs only inside the --with-browser branch
    branch_at = next(i for i, c in enumerate(commands) if c.startswith('if [ "$with_browser" = 1 ]'))
    assert not [c for c in commands[:branch_at] if "apt-get" in c]
    assert any("apt-get install" in c for c in commands[branch_at:])
    assert "triton" not in " ".join(commands), "triton is an extra (CI installs it, see .ci/run)"
    # an unknown option stops before anything is installed
    r = subprocess.run(["bash", str(INSTALL), "--with-brwoser"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr


def test_ci_installs_the_browser_and_the_triton_extra():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "--with-browser" in ci and "triton" in ci and "python -m pytest" in ci


def test_pyproject_pins_and_extras_and_licence():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=!~ ;]", d)[0].lower(): d for d in project["dependencies"]}
    assert deps["transformers"].replace(" ", "") == "transformers>=4.56"  # from_pretrained(dtype=)
    assert "triton" not in deps and any(d.startswith("triton") for d in project["optional-dependencies"]["triton"])
    assert project["license"] == {"text": "Apache-2.0"}
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence  # the full text, not a pointer to it


def test_readme_quick_start_is_two_commands_and_states_test_time():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in quick.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert commands == ["bash scripts/install.sh && pagedllm generate", "bash scripts/install.sh && python -m pytest -q"]
    assert "--with-browser" in readme and re.search(r"test suite about [\d½]+ minutes", readme)
