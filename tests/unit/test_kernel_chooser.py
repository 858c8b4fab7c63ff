"""The kernel chooser (kernels/chooser.py): routes taken from timings, real candidates timed,
verdicts cached per machine and thread count, and forced paths (tests/test_kernel_choice.py: a
busy machine's verdict, the engine and `pagedllm env`)."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from pagedllm.kernels.chooser import ROWS, SECOND_LAYOUT_GAIN, Candidate, KernelChooser, Route, route_of

NAMES = ("a", "b", "c")


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 3), data=st.data())
def test_a_route_runs_a_path_near_the_best_at_every_measured_row_count(n, data):
    times = st.floats(1e-6, 1e-2, allow_nan=False)
    seconds = {c: data.draw(st.lists(times, min_size=len(ROWS), max_size=len(ROWS))) for c in NAMES[:n]}
    route = route_of(ROWS, seconds)
    best = [min(s[i] for s in seconds.values()) for i in range(len(ROWS))]
    for i, m in enumerate(ROWS):
        assert seconds[route.pick(m)][i] <= SECOND_LAYOUT_GAIN * best[i] * (1 + 1e-12)
    assert len(route.paths) == len(route.bounds) + 1
    assert list(route.bounds) == sorted(set(route.bounds))
    assert all(a != b for a, b in zip(route.paths, route.paths[1:]))
    near = [c for c in seconds if all(seconds[c][i] <= SECOND_LAYOUT_GAIN * best[i] for i in range(len(ROWS)))]
    assert (len(route.paths) == 1) == bool(near)   # a second layout only where no one path is near enough


def test_routes_switch_between_measured_counts_and_describe_themselves():
    r = Route(("panels", "onednn"), (156,))
    assert [r.pick(m) for m in (1, 156, 157, 4096)] == ["panels", "panels", "onednn", "onednn"]
    assert r.describe() == "panels 1-156, onednn 157+" and Route(("onednn",)).describe() == "onednn"
    # ties and noise within the gain keep the path running
    seconds = {"x": [1.0, 1.0, 1.0, 1.0], "y": [2.0, 0.99, 1.02, 0.5]}
    assert route_of((1, 4, 16, 64), seconds) == Route(("x", "y"), (32,))


def _candidates(k: int) -> list[Candidate]:
    """The same product two ways: one matmul, or a row at a time through a product written out and
    summed (tens of times slower at many rows, whatever the CPU: a neighbour's burst during one
    timing does not flip it)."""
    whole = Candidate("whole", lambda w: w, lambda w, x: x @ w.t())
    by_row = Candidate("by_row", lambda w: w, lambda w, x: torch.stack([(w * r).sum(-1) for r in x]))
    return [whole, by_row]


def _choose(chooser: KernelChooser, k: int = 256, rows=(1, 256)):
    return chooser.choose("test-op", (128, k), 2 * 128 * k, _candidates(k),
                          lambda g: torch.randn(128, k, generator=g), 128 * k * 4, lambda m: torch.randn(m, k), rows)


def test_the_faster_path_is_chosen_and_cached_per_machine_and_thread_count(tmp_path):
    first = KernelChooser(tmp_path, "build-1", busy_cpus=float("inf"))
    v = _choose(first)
    assert v.source == "measured" and v.route.pick(256) == "whole"
    assert v.gflops("whole")[1] > v.gflops("by_row")[1] > 0
    assert first.take_measured() == [v] and first.take_measured() == []
    assert _choose(first) is v                           # this process remembers it
    again = KernelChooser(tmp_path, "build-1")
    cached = _choose(again)
    assert cached.source == "cache" and cached.route == v.route and cached.seconds == v.seconds
    assert again.take_measured() == []
    assert _choose(KernelChooser(tmp_path, "build-2", busy_cpus=float("inf"))).source == "measured"   # another build
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert _choose(KernelChooser(tmp_path, "build-1", busy_cpus=float("inf"))).source == "measured"
    finally:
        torch.set_num_threads(threads)
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_a_forced_path_wins_where_the_op_has_it(tmp_path):
    forced = KernelChooser(tmp_path, "b", forced="by_row")
    v = _choose(forced)
    assert v.route == Route(("by_row",)) and v.source == "forced" and not list(tmp_path.glob("*.json"))
    elsewhere = KernelChooser(tmp_path, "b", forced="panels", busy_cpus=float("inf"))   # no such candidate here
    assert _choose(elsewhere).source == "measured"
    one = KernelChooser(tmp_path, "b").choose("one", (1, 1), 2, _candidates(1)[:1], None, 0, None)
    assert one.route == Route(("whole",)) and one.source == "only"


def test_a_verdict_is_timed_again_when_its_own_kernel_sources_change_and_only_then(tmp_path, monkeypatch):
    import pagedllm.kernels.cpu as cpu

    src = tmp_path / "csrc"
    src.mkdir()
    (src / "mine.cpp").write_text('#include "shared.h"\n// the op\n')
    (src / "shared.h").write_text("// a header\n")
    (src / "other.cpp").write_text("// another op\n")
    monkeypatch.setattr(cpu, "CSRC", src)

    def choose(build: str = "config-1", legacy: str | None = None):
        chooser = KernelChooser(tmp_path / "verdicts", build, legacy, busy_cpus=float("inf"))
        v = chooser.choose("test-op", (128, 64), 2 * 128 * 64, _candidates(64),
                           lambda g: torch.randn(128, 64, generator=g), 128 * 64 * 4, lambda m: torch.randn(m, 64),
                           (1, 64), sources=("mine.cpp",))
        return v, len(chooser.take_measured())

    first, timed = choose()
    assert timed == 1
    (src / "other.cpp").write_text("// another op, edited\n")
    again, timed = choose()   # another kernel's edit: the verdict stands
    assert timed == 0 and again.source == "cache" and again.seconds == first.seconds
    (src / "shared.h").write_text("// a header, edited\n")
    assert choose()[1] == 1         # a header the kernel includes: timed again
    (src / "mine.cpp").write_text('#include "shared.h"\n// the op, edited\n')
    assert choose()[1] == 1
    assert choose(build="config-2")[1] == 1   # other flags, torch or CPU


def test_a_verdict_of_the_whole_builds_file_is_moved_over_not_timed_again(tmp_path):
    from pagedllm.kernels.chooser import _store, machine

    v = _choose(KernelChooser(tmp_path, "scratch", busy_cpus=float("inf")))
    # as verdicts were stored before they were keyed by their own sources: in the file of the
    # whole build's key, under the op's key alone
    old = KernelChooser(tmp_path, "whole-build-key")
    _store(old.path_for(machine("whole-build-key")), machine("whole-build-key"), "test-op/128x256/whole,by_row/1,256", v)
    moved = KernelChooser(tmp_path, "config-1", "whole-build-key")
    got = _choose(moved)
    assert got.seconds == v.seconds and moved.take_measured() == []
    old.path_for(machine("whole-build-key")).unlink()   # now in the new file
    again = KernelChooser(tmp_path, "config-1", "whole-build-key")
    assert _choose(again).seconds == v.seconds and again.take_measured() == []


def test_a_long_call_is_timed_in_one_pass_after_its_first(monkeypatch):
    """Candidates alternate over REPS passes, but a call over LONG_CALL runs once more only:
    passes of a big layer at many rows cost seconds and their spread is small beside them."""
    import time

    from pagedllm.kernels import chooser as ch

    monkeypatch.setattr(ch, "LONG_CALL", 0.05)
    calls = {"short": 0, "long": 0}

    def run(name: str, pause: float):
        def go(_w, _x) -> None:
            calls[name] += 1
            time.sleep(pause)
        return go

    cands = [Candidate("short", lambda w: w, run("short", 0.01)),
             Candidate("long", lambda w: w, run("long", 0.06))]   # under HOPELESS x: timed, not dropped
    seconds = ch.time_candidates(cands, lambda g: None, 1 << 40, lambda m: torch.zeros(m, 1), (1, 4))
    assert calls == {"short": 2 * (1 + ch.REPS), "long": 2 * 2}, calls
    assert all(t >= 0.06 for t in seconds["long"]) and all(t < 0.06 for t in seconds["short"])
