"""The visualizer page in headless Chromium against a real `pagedllm serve`: live requests
(two sharing a prefix, one with n=2), numbers on the page against the manager's own, and the
library trace replayed in the page. Screenshots land in test-artifacts/."""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from tiny import TINY_NAME

from .conftest import start_server, stop_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("PAGEDLLM_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
# Without the background-networking flags Chromium keeps dialing out, which this closed network refuses.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
PREFIX = ("You are the help desk of the city library. Answer in one short sentence and always suggest "
          "a shelf where the reader can look next. The library has four floors and a reading garden. ")


def _browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (scripts/install.sh installs it when run as root)")
    return sync_playwright


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_flags):
    """The tiny model's: the page shows blocks, whose text does not matter here."""
    s = start_server(tmp_path_factory, *tiny_flags, "--num-gpu-blocks-override", "64", "--max-num-seqs", "8", name="viz")
    yield s
    stop_server(s)


def _stream(url: str, body: dict, first: threading.Event, errors: list, hang_up: threading.Event) -> None:
    """Streams until the request ends or `hang_up` is set: then the client goes away mid-stream,
    and the server aborts the request and frees its blocks."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "model": TINY_NAME, "stream": True},
                          timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first.set()
                if hang_up.is_set():
                    return
    except Exception as e:  # reported by the test, not lost in the thread
        errors.append(e)
        first.set()


def _text(page, sel: str) -> int:
    return int(page.text_content(sel))


@contextlib.contextmanager
def _page(**options):
    """A headless Chromium page (new_page's options); the page must raise no JavaScript error."""
    sync_playwright = _browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(**options)
        errors_js: list[str] = []
        page.on("pageerror", lambda e: errors_js.append(str(e)))
        yield page
        assert not errors_js, errors_js
        browser.close()


def _open_trace(page, scenario: str, speed: int) -> None:
    """Open the page offline and load a scenario's recorded trace into it (speed 0: step by hand)."""
    from pagedllm.viz.routes import PAGE
    from pagedllm.viz.scenarios import trace_path

    page.goto(PAGE.as_uri() + f"?speed={speed}")
    page.wait_for_function("document.getElementById('mode').textContent.includes('offline')", timeout=10_000)
    page.set_input_files("#trace-file", str(trace_path(scenario)))
    # the file is read asynchronously: the replay exists only once the reader has finished
    page.wait_for_function("source !== null && source.kind === 'replay'", timeout=10_000)


def _play_trace(page, scenario: str) -> None:
    """Open the page offline, load a scenario's recorded trace into it, and play it to its end."""
    _open_trace(page, scenario, 6)
    _settled(page, "document.getElementById('mode').textContent.includes('(end)')")


def _settled(page, condition: str, timeout: int = 30_000) -> None:
    """Wait for `condition` and for the frame that draws it: the page sets its mode at once but
    draws the pool, tables and log on the next animation frame (`dirty` until then)."""
    page.wait_for_function(f"({condition}) && !dirty", timeout=timeout)


def test_live_page_matches_block_manager(server, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sync_playwright = _browser()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    poem = "Write a short poem about a library at night"
    assert len(tok.encode(poem, add_special_tokens=False)) % 16, "n=2 must share a partial block to copy on write"
    ctl = lambda action, **kw: server.client().post("/viz/control", json={"action": action, **kw}).raise_for_status()  # noqa: E731

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors_js: list[str] = []
        page.on("pageerror", lambda e: errors_js.append(str(e)))
        page.goto(server.url + "/viz")
        page.wait_for_function("document.getElementById('mode').textContent === 'live engine'", timeout=30_000)
        ctl("delay", seconds=0.05)  # slow enough that requests are still running when we pause

        errors: list = []
        first_a, hang_up = threading.Event(), threading.Event()
        threads = [threading.Thread(target=_stream, args=(server.url, {
            "prompt": PREFIX + "When do you open on Sunday?", "max_tokens": 400, "ignore_eos": True}, first_a, errors,
            hang_up))]
        threads[0].start()
        assert first_a.wait(120), "request A produced nothing"
        for body in ({"prompt": PREFIX + "Can I renew a book online?", "max_tokens": 400, "ignore_eos": True},
                     {"prompt": poem, "n": 2, "temperature": 0.9, "seed": 3, "max_tokens": 400, "ignore_eos": True}):
            threads.append(threading.Thread(target=_stream, args=(server.url, body, threading.Event(), errors, hang_up)))
            threads[-1].start()

        # The page logs the prefix hit of B on A's blocks and the copy-on-write of the n=2 fork.
        page.wait_for_selector("#log li[data-type=cow]", timeout=120_000)
        page.wait_for_selector("#log li[data-type=hit]", timeout=60_000)
        ctl("pause")
        state = server.client().get("/viz/state", timeout=30).json()
        assert state["paused"]
        _settled(page, f"document.getElementById('fig-step').textContent === '{state['step']}'")
        fig = state["figures"]
        shown = {k: _text(page, f"#fig-{k}") for k in ("used", "shared", "free", "cached")}
        assert shown == {"used": fig["used"], "shared": fig["shared"], "free": fig["free"],
                         "cached": fig["cached_free"]}
        # A and B share the prefix's full blocks; the two samples share their prompt's full blocks.
        assert fig["shared"] >= 2 and fig["cow"] >= 1 and fig["used"] > 0
        assert fig["used"] < fig["without_sharing"] < fig["reserve_max"]
        assert page.locator("#pool .cell.shared").count() == fig["shared"]
        assert page.locator("#tables .trow").count() == len(state["tables"])
        page.screenshot(path=str(ARTIFACTS / "viz_live.png"), full_page=True)

        # Hovering a shared block names its holders and shows its text.
        page.hover("#pool .cell.shared >> nth=0")
        assert "shared" in page.text_content("#tip") and "tokens:" in page.text_content("#tip")

        # The clients hang up mid-stream (the rest of their 400 tokens would only cost time): every
        # block of the aborted requests, shared ones and copies included, goes back to the pool.
        hang_up.set()
        ctl("delay", seconds=0)
        ctl("resume")
        for t in threads:
            t.join(300)
        assert not errors, errors
        deadline = time.time() + 30
        while server.client().get("/viz/state").json()["figures"]["used"] and time.time() < deadline:
            time.sleep(0.2)
        assert server.client().get("/viz/state").json()["figures"]["used"] == 0, "KV blocks leaked"
        page.wait_for_function("document.getElementById('fig-used').textContent === '0'", timeout=10_000)

        # The library example replayed in the page, at full speed.
        page.goto(server.url + "/viz/?trace=library&speed=6")
        _settled(page, "document.getElementById('mode').textContent.includes('(end)')")
        assert _text(page, "#fig-used") == 5 and _text(page, "#fig-without") == 11
        assert _text(page, "#fig-shared") == 2
        assert page.locator("#log li[data-type=cow]").count() == 1
        page.screenshot(path=str(ARTIFACTS / "viz_library.png"), full_page=True)
        assert not errors_js, errors_js
        browser.close()


def test_page_from_disk_replays_a_trace_file():
    """No server at all: the page opened from disk replays a trace chosen in its file picker."""
    sync_playwright = _browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        _play_trace(page, "parallel-n4")
        assert page.locator("#log li[data-type=fork]").count() == 3
        assert page.locator("#log li[data-type=cow]").count() >= 1
        browser.close()


def test_beam_trace_replays_with_forked_beams():
    """The beam scenario in the page: beams the request never announced appear as they
    fork (with a label and their tokens), and the page raises no error."""
    import json

    from pagedllm.viz.scenarios import trace_path

    trace = json.loads(trace_path("beam").read_text())
    forks = sum(ev["type"] == "fork" for m in trace["messages"] for ev in m.get("kv", []))
    with _page() as page:  # and no JavaScript error
        _play_trace(page, "beam")
        assert page.locator("#log li[data-type=fork]").count() == forks
        assert page.locator("#log li[data-type=cow]").count() >= 1
        assert "·" in page.locator("#log li[data-type=fork]").first.text_content(), "a forked beam gets a label"


def test_sliding_window_trace_shows_released_entries():
    """The sliding-window scenario in the page: a table's entries the window released show
    as one cell, apart from the blocks it holds; each release is logged, and counted."""
    import json

    from pagedllm.viz.scenarios import trace_path

    from pagedllm.viz.state import KVReplay

    trace = json.loads(trace_path("sliding-window").read_text())
    replay = KVReplay.from_picture(trace["messages"][0])
    for ev in (ev for m in trace["messages"] for ev in m.get("kv", [])):
        replay.apply(ev)
    slides = sum(ev["type"] == "slide" for m in trace["messages"] for ev in m.get("kv", []))
    last = trace["messages"][-1]
    (table,) = [t.blocks for t in replay.tables.values()]
    gone = table.count(-1)
    assert gone >= 3
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with _page(viewport={"width": 1400, "height": 1000}) as page:  # and no JavaScript error
        _play_trace(page, "sliding-window")
        released = page.locator("#tables .tcell.released")
        assert released.count() == 1 and released.first.get_attribute("data-released") == str(gone)
        assert page.locator("#tables .tcell:not(.released)").count() == len(table) - gone
        assert _text(page, "#fig-used") == len(table) - gone
        assert page.locator("#log li[data-type=slide]").count() == slides
        assert page.is_visible("#fig-window-box") and _text(page, "#fig-window") == last["figures"]["window_released"]
        assert not page.is_visible("#tier-panel"), "no tier, no tier panel"
        page.screenshot(path=str(ARTIFACTS / "viz_sliding_window.png"), full_page=True)


def test_tier_trace_shows_blocks_going_to_disk_and_back():
    """The tier scenario in the page: at the step that loads the document back, the loaded
    blocks are marked in the pool, pinned ones carry the pin, and the tier panel lights the
    entries that come back; at the end the tier lists every block on disk and the figures."""
    import json

    from pagedllm.viz.scenarios import trace_path
    from pagedllm.viz.state import KVReplay

    trace = json.loads(trace_path("tier").read_text())
    msgs = trace["messages"]
    at = next(i for i, m in enumerate(msgs) if any(ev["type"] == "tier_load" for ev in m.get("kv", [])))
    replay = KVReplay.from_picture(msgs[0])
    for m in msgs[1:at + 1]:
        for ev in m.get("kv", []):
            replay.apply(ev)
    held = {}
    for t in replay.tables.values():
        for b in t.blocks:
            held[b] = held.get(b, 0) + 1
    pinned = sum(1 for b, r in enumerate(replay.refs) if r > held.get(b, 0))
    loads = [ev for ev in msgs[at]["kv"] if ev["type"] == "tier_load"]
    last = msgs[-1]["figures"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with _page(viewport={"width": 1400, "height": 1000}) as page:  # and no JavaScript error
        _open_trace(page, "tier", 0)  # the slowest pace: this test steps by hand
        page.evaluate("(n) => { source.playing = false; clearTimeout(source.timer);"
                      "  while (source.pos <= n) advance(); }", at)
        _settled(page, f"S.step === {msgs[at]['step']}")
        assert page.locator("#pool .cell.flash-load").count() == len(loads) > 0
        assert page.locator("#pool .cell.pinned").count() == pinned > 0
        assert page.locator("#tier .tier-cell.flash-out").count() == len(loads)
        assert _text(page, "#tier-out") == len(loads)
        assert page.locator("#log li[data-type=tier]", has_text=f"loads {len(loads)} blocks back from the tier").count() == 1
        page.screenshot(path=str(ARTIFACTS / "viz_tier_loads.png"), full_page=True)

        page.click("#play")
        page.evaluate("() => { $('speed').value = 6; speedLabel(); schedule(); }")
        _settled(page, "document.getElementById('mode').textContent.includes('(end)')")
        assert page.is_visible("#tier-panel")
        assert page.locator("#tier .tier-cell:not(.earlier)").count() == last["tier_blocks"] > 0
        assert page.locator("#tier .tier-cell .loads").count() == len(loads)
        assert page.text_content("#fig-tier-io") == f"{last['tier_loaded']} · {last['tier_offloaded']} · {last['swap_outs']}"
        assert page.text_content("#fig-tier-hit") == f"{100 * last['tier_hit_rate']:.1f}% ({last['tier_hits']} tok)"
        assert page.locator("#log li[data-type=tier]", has_text="swapped out: its blocks").count() == 1
        page.screenshot(path=str(ARTIFACTS / "viz_tier.png"), full_page=True)


def test_lora_trace_shows_adapter_pages_beside_kv_blocks():
    """The LoRA scenario in the page: at the step that pages an adapter in, its blocks show as
    adapter pages (labelled with its id) beside the KV blocks, as many as the replay says; idle
    ones are drawn apart; the log names each load and eviction."""
    import json

    from pagedllm.viz.scenarios import trace_path
    from pagedllm.viz.state import KVReplay

    msgs = json.loads(trace_path("lora").read_text())["messages"]
    at = next(i for i, m in enumerate(msgs) if sum(ev["type"] == "adapter_load" for ev in m.get("kv", [])) >= 2)
    replay = KVReplay.from_picture(msgs[0])
    for m in msgs[1:at + 1]:
        for ev in m.get("kv", []):
            replay.apply(ev)
    held = sum(len(b) for b in replay.adapters.values() if replay.refs[b[0]] > 0)
    idle = sum(len(b) for b in replay.adapters.values() if replay.refs[b[0]] == 0)
    kinds = [ev["type"] for m in msgs for ev in m.get("kv", [])]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with _page(viewport={"width": 1400, "height": 1000}) as page:  # and no JavaScript error
        _open_trace(page, "lora", 0)
        page.evaluate("(n) => { source.playing = false; clearTimeout(source.timer);"
                      "  while (source.pos <= n) advance(); }", at)
        _settled(page, f"S.step === {msgs[at]['step']}")
        assert page.locator("#pool .cell.adapter").count() == held > 0
        assert page.locator("#pool .cell.adapter-idle").count() == idle
        assert page.is_visible("#fig-adapter-box")
        page.screenshot(path=str(ARTIFACTS / "viz_lora.png"), full_page=True)
        page.click("#play")
        page.evaluate("() => { $('speed').value = 6; speedLabel(); schedule(); }")
        _settled(page, "document.getElementById('mode').textContent.includes('(end)')")
        assert page.locator("#log li[data-type=adapter]", has_text="paged in").count() == kinds.count("adapter_load")
        assert page.locator("#log li[data-type=evict]", has_text="LoRA adapter").count() == kinds.count("adapter_evict")
