"""Built-in scenarios for the visualizer, and recording them as replayable traces.

`library` is the PagedAttention worked example on the KV manager alone (block size 4, 12 blocks,
no model), and `sliding-window` the same pool under a window of 8 keys. The others run the
real engine on the default model with a small pool so that every block is visible: a
shared-system-prompt chat, parallel sampling n=4, beam search, a preemption under a
tight KV budget, and a second tier on disk that takes the blocks the pool evicts and
gives them back.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..demo import NAMES, WINDOW_NAMES, WORDS, library_kv, library_steps, window_kv, window_steps, window_word
from ..util import cdiv
from .hub import kv_figures
from .state import kv_picture

TRACE_DIR = Path(__file__).parent / "static" / "traces"
TRACE_VERSION = 1

SYSTEM_PROMPT = ("You are the help desk of the city library. Answer in one or two short sentences, "
                 "politely, and suggest where in the library the reader can look next.")
QUESTIONS = ["When does the library open on Sundays?", "Can I renew a book online?",
             "Where are the science fiction novels?", "How many books can I borrow at once?",
             "Is there a quiet room for studying?", "Do you have newspapers from last year?"]


@dataclass
class ScenarioRequest:
    at_step: int                 # queued once the engine has run this many steps
    messages: list[dict]         # chat messages; the model's chat template is applied
    params: dict = field(default_factory=dict)   # SamplingParams fields (BeamSearchParams' with beam_width)
    adapter: str | None = None   # the scenario's LoRA adapter it runs under (None: the base model)

    def sampling(self):
        from ..sampling_params import BeamSearchParams, SamplingParams
        return (BeamSearchParams if "beam_width" in self.params else SamplingParams)(**self.params)


@dataclass
class Scenario:
    name: str
    title: str
    description: str
    engine: dict = field(default_factory=dict)   # EngineConfig fields
    requests: list[ScenarioRequest] = field(default_factory=list)
    tier: bool = False   # runs with a second tier (--kv-offload-dir) in a fresh temporary folder
    # LoRA adapters (enable_lora): name -> (rank, target modules), random weights written for the run
    adapters: dict[str, tuple[int, list[str]]] = field(default_factory=dict)

    def engine_fields(self, tier_dir: str | None = None) -> dict:
        """The EngineConfig fields the scenario sets. A tier scenario's tier goes in `tier_dir`,
        else in a new temporary folder that the caller removes: every run starts cold, so its
        blocks reach the tier while the page watches."""
        if not self.tier:
            return dict(self.engine)
        return {**self.engine, "kv_offload_dir": tier_dir or tempfile.mkdtemp(prefix=f"pagedllm-viz-{self.name}-")}


def _chat(q: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]


# The tier scenario: a document that outlives its place in the pool.
HOUSE_RULES = (
    "Library house rules. The reading hall opens at nine and closes at eight; on Sundays it opens at noon. "
    "Each reader may borrow up to twelve books for three weeks and renew them twice online or at the desk. "
    "Study rooms on the second floor are booked for two hours at a time. Newspapers of the last twelve months "
    "are kept in the periodicals room; older ones are on microfilm in the basement archive. Food is allowed "
    "only in the garden cafe. Lost cards are replaced at the front desk for two euros.")
RULE_QUESTIONS = ["When does the hall open on Sunday?", "How many books can I borrow?",
                  "Where are old newspapers kept?", "Can I eat in the reading hall?",
                  "How long can I book a study room?"]
STORIES = ["Write a short story about a lighthouse keeper.", "Explain how rain forms, step by step.",
           "Describe a walk through a busy market."]


def _rules(q: str) -> list[dict]:
    return [{"role": "system", "content": HOUSE_RULES}, {"role": "user", "content": q}]


def _tier_requests() -> list[ScenarioRequest]:
    """Two questions on the rules, three long stories that need the whole pool (the rules'
    blocks are evicted, and saved; one story is preempted by swap), then three more questions."""
    short = {"max_tokens": 16, "ignore_eos": True}
    return ([ScenarioRequest(0, _rules(q), short) for q in RULE_QUESTIONS[:2]]
            + [ScenarioRequest(at, [{"role": "user", "content": q}], {"max_tokens": 80, "ignore_eos": True})
               for at, q in zip((14, 14, 16), STORIES)]
            + [ScenarioRequest(at, _rules(q), short) for at, q in zip((100, 100, 102), RULE_QUESTIONS[2:])])


def _lora_requests() -> list[ScenarioRequest]:
    """Questions under three adapters and the base, arriving in waves: two adapters run at a time
    (max_loras), the third waits; idle ones stay in the pool until KV needs their blocks, and one
    asked for again before that is used again where it lies."""
    short = {"max_tokens": 20, "ignore_eos": True}
    plan = [(0, "sql"), (0, "fr"), (0, None), (2, "legal"), (24, "fr"), (30, "sql"), (32, "legal"), (60, "fr"),
            (62, None), (90, "sql")]
    return [ScenarioRequest(at, _chat(QUESTIONS[i % len(QUESTIONS)]), short, name) for i, (at, name) in enumerate(plan)]


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("library", "The library example",
             "A system prompt, readers A and B sharing it, C branching off A and writing: copy-on-write. "
             "11 blocks without sharing, 5 with paging and sharing. Block size 4, 12 blocks, KV manager only."),
    Scenario("sliding-window", "A sliding window releases blocks",
             "Every query sees its last 8 keys: as A decodes, each block wholly below its window goes back to "
             "the pool (its table entry released, the block still cached). B shares A's first 20 tokens and "
             "takes only the 2 blocks its window reads. Block size 4, 12 blocks, KV manager only."),
    Scenario("chat", "Chat with a shared system prompt",
             "Six chats arrive one after another, all with the same system prompt: from the second on, "
             "its blocks are prefix hits (ref count > 1) and only the question is prefilled.",
             engine={"num_gpu_blocks_override": 48, "max_num_seqs": 8},
             requests=[ScenarioRequest(3 * i, _chat(q), {"max_tokens": 24}) for i, q in enumerate(QUESTIONS)]),
    Scenario("parallel-n4", "Parallel sampling, n = 4",
             "One prompt, four samples: the samples fork from the prompt's blocks after prefill and share "
             "them; the first write into the shared partial block copies it (copy-on-write).",
             engine={"num_gpu_blocks_override": 32, "max_num_seqs": 8},
             requests=[ScenarioRequest(0, [{"role": "user", "content": "Write a one-line poem about books."}],
                                       {"n": 4, "temperature": 0.9, "seed": 7, "max_tokens": 40})]),
    Scenario("beam", "Beam search, k = 4",
             "One prompt, four beams: every step each beam proposes its best next tokens, the best four "
             "continue. A beam chosen twice forks (its blocks shared, the partial last one copied on the "
             "first write); a beam not chosen is freed at once. The library example at real scale.",
             engine={"num_gpu_blocks_override": 32, "max_num_seqs": 8},
             requests=[ScenarioRequest(0, [{"role": "user", "content": "Name a famous library."}],
                                       {"beam_width": 4, "max_tokens": 24})]),
    Scenario("preemption", "Preemption under a small KV budget",
             "Four long answers in a pool of 20 blocks: when a running sequence needs a block and none "
             "is free, the newest is preempted (its blocks freed) and recomputed later.",
             engine={"num_gpu_blocks_override": 20, "max_num_seqs": 4, "enable_prefix_caching": False},
             requests=[ScenarioRequest(0, [{"role": "user", "content": q}],
                                       {"max_tokens": 72, "ignore_eos": True}) for q in QUESTIONS[:4]]),
    Scenario("tier", "Evicted blocks come back from disk",
             "A document (the library's house rules, 7 full blocks) is asked two questions; three long stories "
             "then need the whole pool of 20 blocks, so the document's cached blocks are evicted, each saved "
             "to the tier on disk as it goes (write-back), and one story is preempted by swap (its blocks "
             "saved too). The next question loads the document's blocks back from the tier instead of "
             "recomputing them (a tier hit), and the two after it share them in the pool.",
             engine={"num_gpu_blocks_override": 20, "max_num_seqs": 4, "kv_offload_write_policy": "write_back",
                     "preemption_mode": "swap"},
             requests=_tier_requests(), tier=True),
    Scenario("lora", "LoRA adapters paged with the KV cache",
             "Three LoRA adapters (3, 10 and 14 pages) and the base model share one pool of 40 blocks "
             "(S-LoRA's unified paging): an adapter's weights are paged in when a request first needs it, "
             "held while requests use it, left idle in the pool after (used again at no cost) and evicted, "
             "least recently used first, when KV blocks need the room. Two adapters run at a time "
             "(max_loras = 2): a request of a third waits in the queue.",
             engine={"num_gpu_blocks_override": 40, "max_num_seqs": 4, "enable_lora": True, "max_loras": 2},
             requests=_lora_requests(),
             adapters={"sql": (8, ["q_proj", "v_proj"]), "fr": (16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
                       "legal": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}),
]}


def trace_path(name: str) -> Path:
    return TRACE_DIR / f"{name}.json"


def record(name: str, engine_overrides: dict | None = None) -> dict:
    """Run a scenario and return its trace: {version, scenario, title, description, messages}."""
    sc = SCENARIOS[name]
    kv_only = {"library": library_messages, "sliding-window": window_messages}
    messages = kv_only[name]() if name in kv_only else _engine_messages(sc, engine_overrides or {})
    return {"version": TRACE_VERSION, "scenario": sc.name, "title": sc.title,
            "description": sc.description, "messages": messages}


def save(trace: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, separators=(",", ":")) + "\n")


def engine_config(sc: Scenario, overrides: dict, fields: dict | None = None):
    """`fields`: the scenario's own, if already taken (engine_fields makes a tier's folder)."""
    from ..config import EngineConfig
    fields = sc.engine_fields(overrides.get("kv_offload_dir")) if fields is None else fields
    return EngineConfig(**{**fields, **overrides})


def prompt_text(tokenizer, req: ScenarioRequest) -> str:
    return tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)


def _engine_messages(sc: Scenario, overrides: dict) -> list[dict]:
    from ..engine.engine import LLMEngine
    from ..lora.request import LoRARequest
    from .hub import VizHub

    fields = sc.engine_fields(overrides.get("kv_offload_dir"))
    # A tier folder the scenario made for this run goes with it.
    scratch = fields["kv_offload_dir"] if sc.tier and not overrides.get("kv_offload_dir") else None
    adapter_dir = tempfile.mkdtemp(prefix=f"pagedllm-viz-{sc.name}-") if sc.adapters else None
    try:
        engine = LLMEngine(engine_config(sc, overrides, fields))
        loras = write_adapters(sc, engine.runner.model_cfg, Path(adapter_dir),
                               lambda name, path, i: LoRARequest(name, i + 1, path)) if sc.adapters else {}
        hub = VizHub(engine)
        engine.observers.append(hub)
        hub.start_recording()
        pending = sorted(sc.requests, key=lambda r: r.at_step)
        while pending or engine.has_unfinished_requests():
            # Arrivals are counted in engine steps; an idle engine takes the next one at once.
            while pending and (pending[0].at_step <= engine.steps or not engine.has_unfinished_requests()):
                r = pending.pop(0)
                # A chat template's text holds its special tokens already: no second BOS.
                engine.add_request(None, prompt_text(engine.tokenizer, r), r.sampling(), add_special_tokens=False,
                                   lora_request=loras[r.adapter] if r.adapter else None)
            engine.step()
        trace = hub.stop_recording()
        engine.close()
        return trace
    finally:
        for d in (scratch, adapter_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


def write_adapters(sc: Scenario, mc, folder: Path, serve) -> dict:
    """The scenario's adapters, random weights on their target modules of every layer, written
    under `folder` (what the page shows is where their pages go, not what they say), each seeded
    by its place in the scenario; serve(name, path, i) names each one to the engine (its
    LoRARequest). The recorded trace and the live run write the same adapters."""
    from ..lora.synthetic import write_random_adapter

    return {name: serve(name, str(write_random_adapter(Path(folder) / name, mc, i + 1, rank, targets)), i)
            for i, (name, (rank, targets)) in enumerate(sc.adapters.items())}


def library_messages() -> list[dict]:
    """The library example as a trace: one message per KV manager operation."""
    kv = library_kv()
    tokens: dict[int, list[int]] = {}
    copies: list[tuple[int, int]] = []
    return kv_messages(kv, library_steps(kv, tokens, copies), tokens, NAMES, WORDS.__getitem__, max_len=16)


def window_messages() -> list[dict]:
    """The sliding-window example as a trace."""
    kv = window_kv()
    tokens: dict[int, list[int]] = {}
    return kv_messages(kv, window_steps(kv, tokens), tokens, WINDOW_NAMES, window_word, max_len=32)


def kv_messages(kv, steps, tokens: dict[int, list[int]], names: dict[int, str], word, max_len: int) -> list[dict]:
    """A KV-manager-only example as a trace: a snapshot, then one step message per
    operation of `steps` (label, tokens gained), and a request message for each sequence
    as it first takes blocks (a forked reader names its parent). `max_len`: what a
    sequence would reserve up front in the traditional scheme."""
    events: list[dict] = []
    kv.watch(events.append)
    reserve = lambda: len(kv.tables) * cdiv(max_len, kv.block_size)  # noqa: E731
    msgs = [{"kind": "snapshot", "t": 0, "step": 0,
             "config": {"num_blocks": kv.pool.num_blocks, "block_size": kv.block_size, "policy": kv.policy,
                        "prefix_caching": True, "sliding_window": kv.groups[0].window, "max_num_seqs": 4,
                        "max_model_len": max_len, "model": "none (KV manager only)"},
             **kv_picture(kv), "seqs": {}, "requests": {},
             "running": [], "waiting": [], "figures": kv_figures(kv.stats(), 0)}]
    announced: set[int] = set()
    for step, (label, new) in enumerate(steps, 1):
        for ev in events:  # each sequence becomes a request on the page when it first holds blocks
            seq = ev.get("seq")
            if ev["type"] not in ("hit", "alloc", "fork") or seq in announced:
                continue
            announced.add(seq)
            req = {"kind": "request", "t": step, "req": names[seq], "label": names[seq], "seqs": [seq], "n": 1}
            if ev["type"] == "fork":
                req.update(max_tokens=max_len - ev["tokens"], prompt=[], forked_from=ev["parent"])
            else:
                req.update(max_tokens=max_len - len(new.get(seq, [])), prompt=[word(t) for t in new.get(seq, [])])
            msgs.append(req)
        prompts = {ev["seq"] for ev in events if ev["type"] in ("hit", "alloc") and ev["seq"] in new}
        msgs.append({"kind": "step", "t": step, "step": step, "label": label, "kv": list(events),
                     "batch": [[s, len(tokens[s]) - len(t), len(t)] for s, t in new.items()],
                     "prefill_tokens": sum(len(t) for t in new.values() if len(t) > 1),
                     "decode_tokens": sum(1 for t in new.values() if len(t) == 1), "preempted": [],
                     # a new sequence's prompt came with its request; only generated tokens follow
                     "tokens": {s: [word(x) for x in t] for s, t in new.items()
                                if not (s in prompts and len(t) == len(tokens[s]))},
                     "finished": {ev["seq"]: "stop" for ev in events if ev["type"] == "free"},
                     "running": sorted(kv.tables), "waiting": [], "figures": kv_figures(kv.stats(), reserve())})
        events.clear()
    return msgs


def main(argv: list[str] | None = None) -> int:
    """Record the built-in traces: python -m pagedllm.viz.scenarios [NAME ...] [--out DIR]"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m pagedllm.viz.scenarios", description=main.__doc__)
    p.add_argument("names", nargs="*", help=f"scenarios to record (default: all of {', '.join(SCENARIOS)})")
    p.add_argument("--out", type=Path, default=TRACE_DIR)
    p.add_argument("--dtype", default="float32", help="engine dtype for the model scenarios")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    for name in args.names or list(SCENARIOS):
        trace = record(name, {} if name == "library" else {"dtype": args.dtype})
        save(trace, args.out / f"{name}.json")
        print(f"{name}: {len(trace['messages'])} messages -> {args.out / f'{name}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
