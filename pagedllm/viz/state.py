"""Rebuild the block pool and block tables from KV events alone (no engine, no torch).

The page runs the same logic in JavaScript; this copy lets the tests check that the
event stream carries everything: replaying it must give the manager's own state.

Events (dicts, as KVCacheManager emits them). A table entry -1 (RELEASED) is a block the
sliding window released, or a prefix hit never took: it holds no reference.
  hit    seq, blocks, tokens   a new sequence starts from cached blocks (each ref +1)
  alloc  seq, blocks           fresh blocks appended to the sequence's table (ref 1)
  cow    seq, index, src, dst  copy-on-write: table[index] src -> dst (src ref -1)
  fill   seq, tokens           the sequence now holds `tokens` slots
  cache  block                 a full block is registered in the prefix cache
  fork   parent, seq, blocks, tokens, shared   the child's table (shared: each ref +1)
  free   seq, blocks           the sequence's blocks, each ref -1 (tail first)
  slide  seq, index, blocks    sliding window: table[index ..] (these blocks) become -1, each ref -1
  evict  block                 a cached-free block is handed out: its cache entry goes
  pin    blocks                each ref +1, held by the second tier (a write in flight, a load's step)
  unpin  blocks                each ref -1
  tier_load seq, block, index  a fresh block filled from the tier for seq's table[index]: ref 1 (pinned), cached
  offload blocks               these blocks' bytes go to the tier (written through, saved before reuse)
  swap_out seq, blocks         a preempted sequence's blocks saved to the tier (its free follows)
  reset_cache                  every cached-free block forgets its hash
  adapter_load adapter, blocks a LoRA adapter's weights placed in fresh blocks (ref 1 each, tagged)
  adapter_hold adapter, blocks an idle resident adapter used again (each ref +1)
  adapter_idle adapter, blocks its last user left: each ref -1, still tagged (revivable)
  adapter_evict adapter, blocks one of its idle pages was handed out: every page loses its tag
A model whose layers mix attention types has a table per layer group (kv.groups): the events
of group g > 0 carry "group": g; a fill applies to every group's table of its sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..kv.block_table import RELEASED


def held(blocks: list[int]) -> list[int]:
    """The entries of a table that hold a block."""
    return [b for b in blocks if b != RELEASED]


def kv_picture(kv) -> dict:
    """A KVCacheManager's block-level state in the shape snapshots carry: refs per block,
    hashed (prefix-cached or adapter-tagged) block ids, tables {seq: [blocks, tokens]} (group
    0's), "adapters" {adapter id: its pages} when any is resident, and with
    several layer groups "groups": each later group's tables, with every group's window."""
    pic = {"refs": [b.ref_cnt for b in kv.pool.blocks],
           "hashed": [b.block_id for b in kv.pool.blocks if b.block_hash is not None],
           "tables": _tables(kv.groups[0].tables)}
    if kv.adapters.pages:   # LoRA adapters resident in the pool (kv.adapter_pages): their pages
        pic["adapters"] = {a: list(blocks) for a, blocks in kv.adapters.pages.items()}
    if len(kv.groups) > 1:
        pic["windows"] = [g.window for g in kv.groups]
        pic["groups"] = [_tables(g.tables) for g in kv.groups[1:]]
    return pic


def _tables(tables: dict) -> dict:
    return {sid: [list(t.block_ids), t.num_tokens] for sid, t in tables.items()}


@dataclass
class TableState:
    blocks: list[int] = field(default_factory=list)
    tokens: int = 0


@dataclass
class KVReplay:
    num_blocks: int
    refs: list[int] = field(default_factory=list)
    hashed: set[int] = field(default_factory=set)
    tables: dict[int, TableState] = field(default_factory=dict)
    # Layer groups 1.. (kv.groups), each with tables of its own; their windows, all groups'.
    group_tables: list[dict[int, TableState]] = field(default_factory=list)
    windows: list[int] | None = None
    adapters: dict[int, list[int]] = field(default_factory=dict)   # resident LoRA adapter -> its pages

    def __post_init__(self) -> None:
        if not self.refs:
            self.refs = [0] * self.num_blocks
        if self.windows is not None and not self.group_tables:
            self.group_tables = [{} for _ in self.windows[1:]]

    @classmethod
    def from_picture(cls, pic: dict) -> KVReplay:
        """Start from a snapshot (or kv_picture); JSON may have turned seq ids into strings."""
        def tables(d: dict) -> dict[int, TableState]:
            return {int(sid): TableState(list(blocks), tokens) for sid, (blocks, tokens) in d.items()}
        return cls(len(pic["refs"]), list(pic["refs"]), set(pic["hashed"]), tables(pic["tables"]),
                   [tables(g) for g in pic.get("groups", [])], pic.get("windows"),
                   {int(a): list(b) for a, b in pic.get("adapters", {}).items()})

    def picture(self) -> dict:
        """The same shape as kv_picture, to compare the two."""
        def tables(d: dict[int, TableState]) -> dict:
            return {sid: [t.blocks, t.tokens] for sid, t in d.items()}
        pic = {"refs": list(self.refs), "hashed": sorted(self.hashed), "tables": tables(self.tables)}
        if self.adapters:
            pic["adapters"] = {a: list(b) for a, b in self.adapters.items()}
        if self.windows is not None:
            pic["windows"] = list(self.windows)
            pic["groups"] = [tables(g) for g in self.group_tables]
        return pic

    def apply(self, ev: dict) -> None:
        kind = ev["type"]
        group = ev.get("group", 0)
        tables = self.tables if not group else self.group_tables[group - 1]
        if kind == "fill":   # every group's table of the sequence holds as many slots
            for t in [self.tables, *self.group_tables]:
                if ev["seq"] in t:
                    t[ev["seq"]].tokens = ev["tokens"]
            return
        self._apply(kind, ev, tables)

    def _apply(self, kind: str, ev: dict, tables: dict[int, TableState]) -> None:
        if kind == "hit":
            for b in held(ev["blocks"]):
                self.refs[b] += 1
            tables[ev["seq"]] = TableState(list(ev["blocks"]), ev["tokens"])
        elif kind == "alloc":
            for b in ev["blocks"]:
                assert self.refs[b] == 0, f"alloc of used block {b}"
                self.refs[b] = 1
            tables.setdefault(ev["seq"], TableState()).blocks.extend(ev["blocks"])
        elif kind == "cow":
            self.refs[ev["src"]] -= 1
            self.refs[ev["dst"]] = 1
            tables[ev["seq"]].blocks[ev["index"]] = ev["dst"]
        elif kind == "rollback":  # rejected drafts: their lookahead slots, and blocks only they filled, go
            t = tables[ev["seq"]]
            for b in ev["blocks"]:
                self.refs[b] -= 1
            del t.blocks[len(t.blocks) - len(ev["blocks"]):]
            t.tokens = ev["tokens"]
        elif kind == "cache":
            self.hashed.add(ev["block"])
        elif kind == "fork":
            for b in held(ev["blocks"]):
                self.refs[b] = self.refs[b] + 1 if ev["shared"] else 1
            tables[ev["seq"]] = TableState(list(ev["blocks"]), ev["tokens"])
        elif kind == "free":
            for b in ev["blocks"]:
                self.refs[b] -= 1
            del tables[ev["seq"]]
        elif kind == "slide":
            t = tables[ev["seq"]]
            for i, b in enumerate(ev["blocks"], ev["index"]):
                assert t.blocks[i] == b, f"slide of block {b}, but entry {i} holds {t.blocks[i]}"
                self.refs[b] -= 1
                t.blocks[i] = RELEASED
        elif kind == "evict":
            self.hashed.discard(ev["block"])
        elif kind == "pin":          # the tier holds a reference: a write in flight, a load this step
            for b in ev["blocks"]:
                self.refs[b] += 1
        elif kind == "unpin":
            for b in ev["blocks"]:
                self.refs[b] -= 1
        elif kind == "tier_load":    # a fresh block filled from the tier: cached, pinned for its step
            assert self.refs[ev["block"]] == 0, f"tier load into used block {ev['block']}"
            self.refs[ev["block"]] = 1
            self.hashed.add(ev["block"])
        elif kind in ("offload", "swap_out"):   # bytes going to the tier: nothing changes in the pool
            pass
        elif kind == "adapter_load":
            for b in ev["blocks"]:
                assert self.refs[b] == 0, f"adapter placed in used block {b}"
                self.refs[b] = 1
            self.hashed.update(ev["blocks"])
            self.adapters[ev["adapter"]] = list(ev["blocks"])
        elif kind in ("adapter_hold", "adapter_idle"):
            for b in ev["blocks"]:
                self.refs[b] += 1 if kind == "adapter_hold" else -1
        elif kind == "adapter_evict":
            self.hashed.difference_update(ev["blocks"])
            del self.adapters[ev["adapter"]]
        elif kind == "reset_cache":
            self.hashed = {b for b in self.hashed if self.refs[b] > 0}
        else:
            raise ValueError(f"unknown KV event type {kind!r}")

    @property
    def used(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    @property
    def shared(self) -> int:
        return sum(1 for r in self.refs if r > 1)

    @property
    def cached_free(self) -> int:
        return sum(1 for b in self.hashed if self.refs[b] == 0)
