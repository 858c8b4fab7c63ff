"""Worked examples on the real KV cache manager (block size 4, 12 blocks): the library
(readers sharing a system prompt, one branching off), and a sliding window releasing blocks."""
from __future__ import annotations

from typing import Iterator

from .kv import KVCacheManager

SYS, A, B, C = 0, 1, 2, 3
NAMES = {SYS: "sys", A: "A", B: "B", C: "C"}
SYSTEM = [101, 102, 103, 104, 105, 106, 107, 108]  # an 8-token system prompt
# Words for the token ids, so the visualizer can show what each block holds.
WORDS = {101: "You", 102: " are", 103: " a", 104: " helpful", 105: " library", 106: " assistant",
         107: ".", 108: "\n", 201: " Find", 202: " Dune", 203: "?", 301: " Hours", 302: "?",
         401: " Dune", 501: " Where", 502: " is", 503: " Emma"}


def library_kv() -> KVCacheManager:
    return KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=True)


def library_steps(kv: KVCacheManager, tokens: dict[int, list[int]],
                  copies: list[tuple[int, int]]) -> Iterator[tuple[str, dict[int, list[int]]]]:
    """Run the example one operation at a time; after each, yield what happened and the
    tokens each sequence gained (`tokens` and `copies` are filled in as it goes)."""
    def extend(seq: int, new: list[int]) -> None:
        tokens[seq] += new
        copies.extend(kv.allocate_slots(seq, tokens[seq], len(tokens[seq])))

    tokens[SYS] = list(SYSTEM)
    kv.allocate_slots(SYS, SYSTEM, len(SYSTEM))                   # 2 blocks
    yield "the system prompt fills 2 blocks", {SYS: list(SYSTEM)}
    kv.fork(SYS, A); tokens[A] = list(SYSTEM)
    yield "reader A shares the system prompt's blocks", {}
    for t in (201, 202, 203):                                    # A generates 3 tokens
        extend(A, [t])
        yield f"A writes {WORDS[t]!r}", {A: [t]}
    kv.fork(SYS, B); tokens[B] = list(SYSTEM)
    yield "reader B shares the system prompt's blocks", {}
    for t in (301, 302):                                         # B generates 2 tokens
        extend(B, [t])
        yield f"B writes {WORDS[t]!r}", {B: [t]}
    kv.fork(A, C, 9); tokens[C] = tokens[A][:9]                  # C branches off A at token 9
    yield "C branches off A after 9 tokens: A's third block is now shared", {}
    extend(C, [401])                                             # ...and writes: copy-on-write
    yield "C writes into the shared block: copy-on-write", {C: [401]}


WINDOW = 8  # the sliding-window example: every query sees its last 8 keys
WINDOW_A, WINDOW_B = 0, 1
WINDOW_NAMES = {WINDOW_A: "A", WINDOW_B: "B"}


def window_word(t: int) -> str:
    return f" w{t}"


def window_kv() -> KVCacheManager:
    return KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=True, sliding_window=WINDOW)


def window_steps(kv: KVCacheManager, tokens: dict[int, list[int]]) -> Iterator[tuple[str, dict[int, list[int]]]]:
    """Under a window of 8 keys, A decodes past its window and releases its oldest blocks (they
    stay cached-free); B arrives with A's first 20 tokens and hits only the two blocks its own
    window reads. Yields what happened and the tokens each sequence gained."""
    def extend(seq: int, new: list[int]) -> None:
        tokens[seq] += new
        kv.allocate_slots(seq, tokens[seq], len(tokens[seq]))

    tokens[WINDOW_A] = list(range(1, 13))
    kv.allocate_slots(WINDOW_A, tokens[WINDOW_A], 12)
    yield "A's 12-token prompt fills 3 blocks", {WINDOW_A: list(tokens[WINDOW_A])}
    for t in range(13, 23):
        extend(WINDOW_A, [t])
        yield f"A writes token {t}: its query sees tokens {max(1, t - WINDOW + 1)}..{t}", {WINDOW_A: [t]}
    prompt = tokens[WINDOW_A][:20] + [99]
    hit = kv.lookup_prefix(prompt)
    tokens[WINDOW_B] = list(prompt)
    kv.allocate_slots(WINDOW_B, prompt, len(prompt), hit)
    yield f"B shares A's first 20 tokens: a hit of {len(hit)} blocks, of which it takes the 2 its window reads", \
        {WINDOW_B: list(prompt)}
    kv.free(WINDOW_A)
    yield "A finishes: its blocks go back, B's shared ones stay", {}
    for t in (100, 101, 102, 103):
        extend(WINDOW_B, [t])
        yield f"B writes token {t}", {WINDOW_B: [t]}


def run_library_demo(print_fn=print) -> dict:
    kv = library_kv()
    tokens: dict[int, list[int]] = {}
    copies: list[tuple[int, int]] = []
    for _ in library_steps(kv, tokens, copies):
        pass

    p = print_fn
    p("PagedLLM library demo: block size 4, 12 physical blocks (the PagedAttention worked example)\n")
    for seq in (SYS, A, B, C):
        t = kv.block_table(seq)
        row = " | ".join(f"L{i}->P{b}" for i, b in enumerate(t.block_ids))
        p(f"  {NAMES[seq]:>3} ({t.num_tokens:2d} tokens) block table: {row}")
    refs = [b.ref_cnt for b in kv.pool.blocks]
    p(f"\n  ref counts per physical block: {refs}")
    shared = [b.block_id for b in kv.pool.blocks if b.ref_cnt > 1]
    p(f"  shared (read-only) blocks: {shared}")
    p(f"  copy-on-write copies (src -> dst): {', '.join(f'P{s}->P{d}' for s, d in copies)}")
    st = kv.stats()
    p(f"\n  {st.blocks_without_sharing} blocks without sharing, {st.used_blocks} with paging + sharing "
      f"(saved {st.blocks_without_sharing - st.used_blocks})")

    # A later request with the same system prompt finds it in the prefix cache.
    question = SYSTEM + [501, 502, 503]
    hit = kv.lookup_prefix(question)
    p(f"  a new request with the same system prompt hits {len(hit)} cached blocks {hit} "
      f"({len(hit) * 4} of {len(question)} tokens skip prefill)")

    for seq in (C, B, A, SYS):                                   # unlike the paper's sketch, free
        kv.free(seq)
    kv.check_integrity()
    p(f"\n  after all requests finish: {kv.pool.num_available} of 12 blocks free again "
      f"({kv.pool.num_cached_free} of them still cached for future prefix hits)")
    return {"without_sharing": st.blocks_without_sharing, "with_sharing": st.used_blocks,
            "cow": copies, "refs": refs, "free_after": kv.pool.num_available, "hit_blocks": len(hit)}
