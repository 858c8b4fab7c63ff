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
