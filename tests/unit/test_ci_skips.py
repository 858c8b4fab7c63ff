"""Skips are failures in CI: the hook in tests/conftest.py, tested on a tiny test file of its own."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parents[1] / "conftest.py").read_text()

TESTS = '''
import pytest

def test_skips():
    pytest.skip("nothing to test here")

@pytest.mark.skipif(True, reason="marked off")
def test_marked():
    pass

@pytest.mark.xfail(strict=True, reason="known bug")
def test_expected_failure():
    assert False

def test_passes():
    pass
'''


@pytest.fixture(autouse=True)
def no_outside_plugins(monkeypatch):
    # The inner runs need no installed plugin, and some (pytest-benchmark) spawn git at load,
    # which this tier refuses: keep whatever the machine has installed out of them.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture
def tiny(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_tiny=TESTS)
    return pytester


def test_skips_fail_under_ci(tiny, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = tiny.runpytest("-p", "no:cacheprovider")
    # a skip from a mark happens in setup, so it reports as an error; a skip in the test body as a failure
    result.assert_outcomes(failed=1, errors=1, passed=1, xfailed=1)
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*skipped under CI=true*nothing to test here*"])
    result.stdout.fnmatch_lines(["*skipped under CI=true*marked off*"])


def test_skips_skip_without_ci(tiny, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    tiny.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=2, passed=1, xfailed=1)
    monkeypatch.setenv("CI", "false")
    tiny.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=2, passed=1, xfailed=1)


def test_module_level_skip_fails_under_ci(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_mod='import pytest\npytest.skip("no kernel", allow_module_level=True)\n'
                                 'def test_never():\n    pass\n')
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*module skipped under CI=true*no kernel*"])
    monkeypatch.delenv("CI")
    assert pytester.runpytest("-p", "no:cacheprovider").ret == 5  # nothing collected, nothing failed


def test_strict_xfail_that_passes_still_fails(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x='import pytest\n@pytest.mark.xfail(strict=True)\ndef test_fixed():\n    pass\n')
    for ci in ("true", ""):
        monkeypatch.setenv("CI", ci)
        pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(failed=1)


def test_a_test_for_instructions_this_cpu_lacks_skips_in_ci_too(pytester, monkeypatch):
    """needs_cpu: no install brings a CPU's instructions, so CI keeps that one skip, and only where
    /proc/cpuinfo shows the CPU lacks them: where it has them, the same test skipping fails."""
    from pagedllm.util import cpu_flags

    had = sorted(cpu_flags() or {"fpu"})[0]   # a flag of this CPU's
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_cpu=f'''
import pytest

@pytest.mark.needs_cpu("no_such_flag", "nor_this_one")
def test_lacking():
    assert False, "never runs"

@pytest.mark.needs_cpu("no_such_flag", "{had}")
def test_has_one_but_skips():
    pytest.skip("the kernel was not built")

@pytest.mark.needs_cpu("{had}")
def test_has_it():
    pass
''')
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1, failed=1, passed=1)
    result.stdout.fnmatch_lines(["*this CPU has none of no_such_flag, nor_this_one*"])
    result.stdout.fnmatch_lines(["*skipped under CI=true*the kernel was not built*"])
    monkeypatch.delenv("CI")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=2, passed=1)
