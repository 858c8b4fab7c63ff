"""Adapters served under their own names (--enable-lora --lora-modules, vLLM's flags): /v1/models
lists them with the base as parent, a request's `model` picks one and gets the tokens the
offline engine gives under it, and /v1/load_lora_adapter and /v1/unload_lora_adapter change them
at run time only under VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, behind the admin key (with API keys
and no admin key: nobody), never the operator's --lora-modules. A bad adapter (a setting, a shape,
a NaN, an absurd lora_alpha) is refused by name: at start, or with a 400 at run time."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.lora import LoRARequest

from lora_adapters import make_adapter

from .inproc import serve_in_process

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def paths(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-loras")
    return [str(make_adapter(model_dir, root / f"s{i}", 10 + i, 8, 16, ALL, False)) for i in range(2)]


@pytest.fixture(scope="module")
def lora_server(paths):
    s = serve_in_process(*LORA, "--lora-modules", f"sql={paths[0]}", '{"name": "fr", "path": "%s"}' % paths[1],
                         "--admin-key", "root")
    yield s
    s.close()


def completion(server, model: str, prompt: list[int], **kw):
    return server.client().post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 10,
                                                         "temperature": 0, "ignore_eos": True},
                                timeout=120, **kw)


def test_adapters_are_models_and_answer_as_offline(lora_server, paths, make_llm, monkeypatch):
    models = {m["id"]: m for m in lora_server.client().get("/v1/models", timeout=30).json()["data"]}
    base = next(m["id"] for m in models.values() if "parent" not in m)
    assert models["sql"]["parent"] == base and models["sql"]["root"] == "sql" and "fr" in models  # no path
    admin = lora_server.client().get("/v1/models", headers={"Authorization": "Bearer root"}, timeout=30).json()
    assert {m["id"]: m for m in admin["data"]}["sql"]["root"] == paths[0]   # the operator sees where it lives
    prompt = [1, 504, 3458, 282, 4649, 314]
    llm = make_llm(dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=2, max_lora_rank=8)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for name, path, i in (("sql", paths[0], 1), ("fr", paths[1], 2)):
        r = completion(lora_server, name, prompt)
        assert r.status_code == 200 and r.json()["model"] == name, r.text
        want = llm.generate([prompt], greedy, use_tqdm=False, lora_request=LoRARequest(name, i, path))[0]
        assert r.json()["choices"][0]["text"] == want.outputs[0].text
    on_base = completion(lora_server, base, prompt).json()["choices"][0]["text"]
    assert on_base == llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    assert on_base != completion(lora_server, "sql", prompt).json()["choices"][0]["text"]
    r = completion(lora_server, "nope", prompt)
    assert r.status_code == 404 and "`sql`" in r.json()["error"]["message"]


def test_runtime_updates_are_gated_and_checked(lora_server, paths, tmp_path, monkeypatch):
    c = lora_server.client()
    admin = {"Authorization": "Bearer root"}
    body = {"lora_name": "late", "lora_path": paths[0]}
    r = c.post("/v1/load_lora_adapter", json=body, headers=admin)
    assert r.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in r.text
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert c.post("/v1/load_lora_adapter", json=body).status_code == 403   # not the admin
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)}, headers=admin)
    assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": paths[0]}, headers=admin)
    assert r.status_code == 400 and "already served" in r.json()["error"]["message"]
    r = c.post("/v1/load_lora_adapter", json=body, headers=admin)
    assert r.status_code == 200 and "added successfully" in r.text
    prompt = [1, 378, 1838, 3549]
    late, sql = completion(lora_server, "late", prompt), completion(lora_server, "sql", prompt)
    assert late.status_code == 200 and late.json()["choices"][0]["text"] == sql.json()["choices"][0]["text"]
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=admin).status_code == 200
    assert completion(lora_server, "late", prompt).status_code == 404
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=admin).status_code == 404
    for bad in (5, None, "", ["sql"]):
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": bad}, headers=admin)
        assert r.status_code == 400 and "lora_name" in r.json()["error"]["message"], (bad, r.text)
    # the operator's --lora-modules: neither unloaded nor taken over at run time, even by the admin
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin)
    assert r.status_code == 403 and "--lora-modules" in r.json()["error"]["message"]
    assert completion(lora_server, "sql", prompt).json()["choices"][0]["text"] == sql.json()["choices"][0]["text"]


def test_with_api_keys_and_no_admin_key_no_tenant_changes_an_adapter(paths, monkeypatch, caplog):
    """Tenant B may neither unload the operator's adapter nor register its own under that name (or
    any): every tenant keeps being served the operator's weights. The start says how to allow it."""
    import logging

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with caplog.at_level(logging.WARNING, logger="pagedllm.server"):
        s = serve_in_process(*LORA, "--lora-modules", f"sql={paths[0]}", "--api-key", "tenant-a", "--api-key",
                             "tenant-b")
    try:
        assert "no --admin-key" in caplog.text
        a, b = ({"Authorization": f"Bearer {k}"} for k in ("tenant-a", "tenant-b"))
        prompt = [1, 378, 1838, 3549]
        before = completion(s, "sql", prompt, headers=a).json()["choices"][0]["text"]
        c = s.client()
        for path, body in (("unload", {"lora_name": "sql"}), ("load", {"lora_name": "sql", "lora_path": paths[1]}),
                           ("load", {"lora_name": "mine", "lora_path": paths[1]})):
            r = c.post(f"/v1/{path}_lora_adapter", json=body, headers=b)
            assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], r.text
        assert completion(s, "sql", prompt, headers=a).json()["choices"][0]["text"] == before
        assert [m["id"] for m in c.get("/v1/models", headers=b).json()["data"]][1:] == ["sql"]
        assert all(m.get("root") != paths[0] for m in c.get("/v1/models", headers=b).json()["data"])
    finally:
        s.close()


def test_bad_adapters_are_refused_by_name(paths, tmp_path, monkeypatch):
    """An adapter whose config is not an object or whose lora_alpha is missing-as-null, a list, NaN,
    zero or absurd, or whose weights hold a NaN or an Inf, gets a 400 naming what is wrong: never
    loaded, so never a request's empty text or a 500 from its logprobs."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")

    def variant(name: str, config=None, poison=None) -> str:
        d = tmp_path / name
        shutil.copytree(paths[0], d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        if config is not None:
            (d / "adapter_config.json").write_text(json.dumps(config(cfg)))
        if poison is not None:
            t = load_file(str(d / "adapter_model.safetensors"))
            key = sorted(t)[3]
            t[key] = t[key].clone()
            t[key].view(-1)[7] = poison
            save_file(t, str(d / "adapter_model.safetensors"))
        return str(d)

    cases = {
        "a list": (variant("list", lambda c: [c]), "must hold a JSON object"),
        "alpha null": (variant("null", lambda c: {**c, "lora_alpha": None}), "lora_alpha must be a finite number"),
        "alpha list": (variant("alist", lambda c: {**c, "lora_alpha": [16]}), "lora_alpha must be a finite number"),
        "alpha zero": (variant("zero", lambda c: {**c, "lora_alpha": 0}), "lora_alpha must be a finite number"),
        "alpha huge": (variant("huge", lambda c: {**c, "lora_alpha": 1e30}), "above 256"),
        "a NaN": (variant("nan", poison=float("nan")), "must hold finite floats"),
        "an Inf": (variant("inf", poison=float("inf")), "must hold finite floats"),
    }
    s = serve_in_process(*LORA, "--admin-key", "root")
    try:
        c = s.client()
        for i, (what, (path, says)) in enumerate(cases.items()):
            r = c.post("/v1/load_lora_adapter", json={"lora_name": f"bad{i}", "lora_path": path},
                       headers={"Authorization": "Bearer root"})
            assert r.status_code == 400 and says in r.json()["error"]["message"], (what, r.text)
        assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == []
        assert c.get("/health").status_code == 200
    finally:
        s.close()


def test_bad_lora_flags_stop_the_start(tmp_path, paths):
    from pagedllm.cli import main

    assert main(["serve", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--lora-modules",
                 f"x={paths[0]}"]) == 2   # without --enable-lora
    assert main(["serve", "--dtype", "float32", "--kv-cache-memory", "16MiB", *LORA, "--lora-modules",
                 f"x={tmp_path}"]) == 2   # not an adapter
    assert main(["serve", "--dtype", "float32", "--kv-cache-memory", "16MiB", *LORA, "--lora-modules",
                 "no-equals-sign"]) == 2


def test_a_request_of_another_adapter_waits_for_a_slot_and_is_served(paths):
    """With one adapter a step (--max-loras 1), a request for another waits in the queue while
    the running one holds the slot (not refused), and is served once it finishes."""
    import threading
    import time

    s = serve_in_process("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
                         "--lora-modules", f"sql={paths[0]}", f"fr={paths[1]}")
    try:
        done: dict[str, tuple] = {}

        def post(name: str, body: dict) -> None:
            r = s.client().post("/v1/completions", json=body, timeout=120)
            done[name] = (r, time.monotonic())

        body = {"model": "sql", "prompt": [1, 504, 3458], "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        t = threading.Thread(target=post, args=("sql", body))
        t.start()
        deadline = time.time() + 60
        while s.built.async_engine.stats.num_running == 0 and time.time() < deadline:
            time.sleep(0.02)   # until sql's request runs and holds the slot
        other = threading.Thread(target=post, args=("fr", {"model": "fr", "prompt": [1, 378, 1838], "max_tokens": 4,
                                                           "temperature": 0}))
        other.start()
        info, deadline = "", time.time() + 60
        while 'waiting_lora_adapters="fr"' not in info and "sql" not in done and time.time() < deadline:
            metrics = s.client().get("/metrics", timeout=30).text
            info = next((line for line in metrics.splitlines() if line.startswith("pagedllm:lora_requests_info{")), "")
        # vLLM's gauge, while fr waits behind sql's slot; sql's pages are counted beside the KV blocks
        assert 'running_lora_adapters="sql"' in info and 'waiting_lora_adapters="fr"' in info, info
        assert 'max_lora="1"' in info
        assert "pagedllm:kv_cache_adapter_blocks{" in metrics and "pagedllm:lora_adapter_loads_total{" in metrics
        t.join(120)
        other.join(120)
        (sql, sql_at), (fr, fr_at) = done["sql"], done["fr"]
        assert sql.status_code == 200 and sql.json()["usage"]["completion_tokens"] == 60
        assert fr.status_code == 200 and fr.json()["usage"]["completion_tokens"] == 4, fr.text
        assert fr_at >= sql_at - 0.5   # it ran after sql's slot was free
    finally:
        s.close()
