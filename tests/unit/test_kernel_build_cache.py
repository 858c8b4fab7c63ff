"""The kernels' build cache (kernels/cpu.py): an edit of the sources gives another library key
but the same working folder, and the sources are mirrored into it writing only the files whose
bytes changed, so ninja (which goes by file times) compiles only what the edit touches; and a
build that did not run leaves no library under the new key."""
from __future__ import annotations

import os

import pytest
import torch.utils.cpp_extension as ext

import pagedllm.kernels.cpu as cpu


def test_only_changed_files_are_written_and_removed_ones_go(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    src.mkdir()
    for name in ("a.cpp", "b.cpp", "vec.h"):
        (src / name).write_text(f"// {name}\n")
    monkeypatch.setattr(cpu, "CSRC", src)
    into = tmp_path / "work" / "src"
    assert sorted(cpu.mirror_sources(into)) == ["a.cpp", "b.cpp", "vec.h"]
    for p in into.iterdir():   # as if compiled long ago: a rewrite would show as a newer time
        os.utime(p, ns=(1, 1))
    key_before, config_before = cpu.build_key(), cpu.config_key()
    (src / "b.cpp").write_text("// b.cpp, edited\n")
    (src / "a.cpp").touch()   # a fresh clone: a new time, the same bytes
    (src / "vec.h").unlink()
    assert cpu.mirror_sources(into) == ["b.cpp"]
    assert sorted(p.name for p in into.iterdir()) == ["a.cpp", "b.cpp"]
    assert (into / "a.cpp").stat().st_mtime_ns == 1 and (into / "b.cpp").stat().st_mtime_ns > 1
    assert (into / "b.cpp").read_text() == "// b.cpp, edited\n"
    # another library (its own key), built in the same folder of objects
    assert cpu.build_key() != key_before and cpu.config_key() == config_before
    assert cpu.mirror_sources(into) == []


def test_the_working_folder_follows_flags_not_sources(monkeypatch):
    before = cpu.config_key()
    monkeypatch.setattr(cpu, "CFLAGS", [*cpu.CFLAGS, "-DPAGEDLLM_HEAD_DIMS=64"])
    assert cpu.config_key() != before


def test_a_build_that_did_not_run_is_not_kept(tmp_path, monkeypatch):
    """torch's builder skips a process's second build after a failed first one and loads the
    library already in the folder: copied, that older library would stand for the new sources
    (a unit test's refused build did this, and later runs loaded the stale copy)."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "a.cpp").write_text("// a.cpp\n")
    monkeypatch.setattr(cpu, "CSRC", src)
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "cache" / "ext" / f"work_{cpu.config_key()}"
    work.mkdir(parents=True)
    built = work / "pagedllm_cpu.so"
    built.write_bytes(b"older sources")
    os.utime(built, ns=(1, 1))
    lib = tmp_path / "lib.so"
    monkeypatch.setattr(ext, "load", lambda **kw: None)   # skipped: nothing compiled
    with pytest.raises(RuntimeError, match="older than the sources"):
        cpu._build(lib)
    assert not lib.exists()
    monkeypatch.setattr(ext, "load", lambda **kw: built.write_bytes(b"these sources"))
    cpu._build(lib)
    assert lib.read_bytes() == b"these sources"
