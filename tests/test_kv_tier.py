"""The second tier of the prefix cache (--kv-offload-dir) on the tiny model, in float32:
greedy output equals a run without the tier when blocks come back from it after an
eviction, after a restart and after a swap-out; corrupted, truncated and foreign block
files are skipped (with a warning) and recomputed; a SIGKILL in the middle of writes never
leaves a torn block to serve; cache salts keep tenants apart through the tier too."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kv.hashing import BlockHashes
from pagedllm.kv.tier_store import SUFFIX, TierStore, fingerprint

B = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)
# ~300 tokens (19 blocks of 16) of document, questions about it, and other traffic (~250
# tokens each) that pushes the document out of a 32-block pool.
DOC = " ".join(f"Record {i}: the warehouse in town {i % 17} holds {i * 37 % 101} crates of item {i}." for i in range(13))
QUESTIONS = [f"\nQuestion: how many crates does record {i} hold? Answer: record {i} holds" for i in (3, 5, 9, 11)]
FILLER = [" ".join(f"Filler text {j}-{i} about nothing in particular." for i in range(28)) for j in range(2)]


def tier_llm(model: str, path: Path, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks_override", 32)
    return LLM(model, dtype="float32", max_model_len=2048, kv_offload_dir=str(path), **kw)


def texts(llm: LLM, prompts: list[str], **kw) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, **kw)]


@pytest.fixture(scope="module")
def reference(tiny_fp32) -> dict[str, list[int]]:
    """Greedy tokens of every prompt here, by an engine without a tier."""
    prompts = [DOC + q for q in QUESTIONS] + FILLER
    return dict(zip(prompts, texts(tiny_fp32, prompts)))


def doc_keys(llm: LLM, question: str, salt: str | None = None) -> list[int]:
    ids = llm.engine.tokenizer(DOC + question)["input_ids"]
    return BlockHashes(B, salt).update(ids)


def block_files(llm: LLM) -> Path:
    return llm.engine.kv.connector.store.dir


@pytest.fixture(scope="module")
def engine_a(tmp_path_factory, tiny_model) -> LLM:
    """An engine with a fresh tier (the first tests share it)."""
    llm = tier_llm(tiny_model, tmp_path_factory.mktemp("tier"))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def warm_tier(engine_a) -> Path:
    """The tier folder engine A leaves at a clean shutdown: the document's blocks among others."""
    engine_a.close()
    return engine_a.engine.kv.connector.store.dir.parent


@pytest.fixture(scope="module")
def restarted(warm_tier, tiny_model) -> LLM:
    llm = tier_llm(tiny_model, warm_tier)
    yield llm
    llm.close()


def test_served_from_the_tier_after_an_eviction(engine_a, reference):
    llm = engine_a
    first = DOC + QUESTIONS[0]
    assert texts(llm, [first]) == [reference[first]]
    kv = llm.engine.kv
    assert kv.connector.hits == 0
    for f in FILLER:  # other traffic: the document's blocks leave the 32-block pool
        assert texts(llm, [f]) == [reference[f]]
    keys = doc_keys(llm, QUESTIONS[1])
    assert not any(k in kv.pool.cached for k in keys), "the filler should have evicted the document"
    second = DOC + QUESTIONS[1]
    assert texts(llm, [second]) == [reference[second]]
    st = llm.get_stats().kv
    doc_blocks = len(doc_keys(llm, "")) - 1
    assert st.tier.hits >= doc_blocks * B and st.tier.loaded_blocks >= doc_blocks
    assert st.tier.store.read_failures == 0 and st.tier.store.written_blocks > 0
    kv.check_integrity()


def test_a_restarted_engine_serves_hits_from_the_tier(restarted, reference):
    llm = restarted
    q = DOC + QUESTIONS[2]
    assert texts(llm, [q]) == [reference[q]]
    st = llm.get_stats()
    doc_blocks = len(doc_keys(llm, "")) - 1
    assert st.kv.tier.hits >= doc_blocks * B, "the document comes from the tier, not recomputed"
    assert st.computed_prompt_tokens < len(llm.engine.tokenizer(q)["input_ids"]) - doc_blocks * B + B


def test_bad_block_files_are_skipped_and_recomputed(restarted, warm_tier, reference, caplog):
    """A flipped byte, a truncated file and another engine's block (fingerprint differs),
    each at a block the next request would load: skipped with a warning, the answer right."""
    llm = restarted
    kv, folder = llm.engine.kv, block_files(llm)
    keys = doc_keys(llm, QUESTIONS[3])

    def path(i: int) -> Path:
        return folder / f"{keys[i]:016x}{SUFFIX}"

    def flip(i: int) -> None:
        raw = bytearray(path(i).read_bytes())
        raw[len(raw) // 2] ^= 0x40
        path(i).write_bytes(bytes(raw))

    def truncate(i: int) -> None:
        path(i).write_bytes(path(i).read_bytes()[:-100])

    def foreign(i: int) -> None:  # what an engine of another model or block size wrote under this key
        other = TierStore(warm_tier, 1 << 30, fingerprint("another model", 8), kv.connector.store.block_bytes)
        other.put(keys[i], [bytes(kv.connector.store.block_bytes)])
        other.close()
        path(i).write_bytes((other.dir / path(i).name).read_bytes())

    q = DOC + QUESTIONS[3]
    for n, (i, spoil, why) in enumerate([(3, flip, "checksum"), (8, truncate, "truncated"),
                                         (13, foreign, "fingerprint")], 1):
        assert path(i).exists()
        spoil(i)
        llm.reset_prefix_cache()  # out of the pool: the next request looks in the tier
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedllm.kv.tier_store"):
            assert texts(llm, [q]) == [reference[q]]
        assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert kv.connector.store.stats.read_failures == n
    kv.check_integrity()


def test_salts_do_not_cross_through_the_tier(tmp_path, tiny_model):
    llm = tier_llm(tiny_model, tmp_path)
    q = DOC + QUESTIONS[0]
    a = texts(llm, [q], cache_salt="tenant-a")
    llm.close()
    llm = tier_llm(tiny_model, tmp_path)          # a restart: only the tier holds tenant a's blocks
    assert texts(llm, [q], cache_salt="tenant-b") == a
    assert llm.engine.kv.connector.hits == 0, "tenant b was served tenant a's blocks"
    assert llm.engine.kv.prefix_hits == 0
    llm.reset_prefix_cache()
    assert texts(llm, [q], cache_salt="tenant-a") == a
    assert llm.engine.kv.connector.hits > 0
    llm.close()


def test_swap_preemption_gives_the_same_tokens(tmp_path, tiny_fp32, tiny_model):
    """A pool too small for the batch: sequences are preempted by swap (their blocks saved
    to the tier, write-back so nothing else writes), resume by loading them, and the greedy
    tokens are those of a run without preemption."""
    prompts = [f"Q{i}. " + DOC[:250 + 40 * i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in tiny_fp32.generate(prompts, params, use_tqdm=False)]
    llm = tier_llm(tiny_model, tmp_path, num_gpu_blocks_override=24, preemption_mode="swap", kv_offload_write_policy="write_back")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    st = llm.get_stats()
    assert st.preemptions > 0 and st.kv.tier.swap_outs == st.preemptions
    assert st.kv.tier.swap_out_blocks > 0 and st.kv.tier.loaded_blocks > 0
    assert got == want
    llm.engine.kv.check_integrity()
    llm.close()


CHILD = r"""
import sys, time
import pagedllm.kv.tier_store as ts
from pagedllm import LLM, SamplingParams

class SlowFile:
    # a disk that stalls half-way through each block: a SIGKILL lands mid-write
    def __init__(self, f): self.f = f
    def __enter__(self): return self
    def __exit__(self, *a): return self.f.__exit__(*a)
    def write(self, b):
        n = len(memoryview(b).cast("B"))
        if n > 1000:
            self.f.write(memoryview(b).cast("B")[:n // 2]); self.f.flush(); time.sleep(0.3)
            return self.f.write(memoryview(b).cast("B")[n // 2:])
        return self.f.write(b)

ts.open = lambda p, m: SlowFile(open(p, m))
llm = LLM(sys.argv[3], dtype="float32", max_model_len=2048, num_gpu_blocks_override=32, kv_offload_dir=sys.argv[1])
llm.generate([sys.argv[2]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
print("GENERATED", flush=True)
time.sleep(60)
"""


def test_sigkill_mid_write_never_serves_a_torn_block(tmp_path, reference, tiny_model):
    q = DOC + QUESTIONS[1]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), q, tiny_model], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "GENERATED"
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until a block is half on disk
            tmp = [p for p in tmp_path.rglob(".tmp-*") if p.stat().st_size > 0]
            done = list(tmp_path.rglob(f"*{SUFFIX}"))
            if tmp and done:
                break
            time.sleep(0.05)
        assert tmp and done, "the child never wrote"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    llm = tier_llm(tiny_model, tmp_path)
    assert not list(tmp_path.rglob(".tmp-*")), "the killed writer's temporary file should be gone"
    assert texts(llm, [q]) == [reference[q]]
    st = llm.get_stats().kv
    assert st.tier.hits > 0 and st.tier.store.read_failures == 0
    llm.close()


def test_bad_tier_settings_are_named(make_llm):
    with pytest.raises(ValueError, match="kv_offload_dir"):
        make_llm(dtype="float32", preemption_mode="swap")
    with pytest.raises(ValueError, match="kv_offload_size"):
        make_llm(dtype="float32", kv_offload_dir="/tmp/x", kv_offload_size="lots")
    with pytest.raises(ValueError, match="prefix cache"):
        make_llm(dtype="float32", kv_offload_dir="/tmp/x", enable_prefix_caching=False, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="kv_offload_write_policy"):
        make_llm(dtype="float32", kv_offload_dir="/tmp/x", kv_offload_write_policy="sometimes")
