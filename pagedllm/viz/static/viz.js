// PagedLLM visualizer: rebuilds the KV block pool, block tables and scheduler queues from
// the engine's messages (live over SSE, or a recorded trace) and draws them. The KV event
// rules mirror pagedllm/viz/state.py. No dependencies, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
                 "#ff9da7", "#9c755f", "#bab0ac", "#17becf", "#bcbd22"];
const SPEEDS = [0.25, 0.5, 1, 2, 4, 8, Infinity];  // replay: steps per second
const LIVE_DELAYS = [2, 1, 0.5, 0.25, 0.1, 0.03, 0];  // live: seconds the engine waits after a step
const MAX_LOG = 400, MAX_TIMELINE = 160, MAX_TIER_CELLS = 400;
const params = new URLSearchParams(location.search);
const keyQuery = params.get("api_key") ? `?api_key=${encodeURIComponent(params.get("api_key"))}` : "";

let S = null;              // the picture being drawn
let source = null;         // {kind: "live", es} or {kind: "replay", messages, pos, playing, timer}
let received = [];         // what this page got, for "save trace"

// ---------------------------------------------------------------- state
function fresh(config) {
  // groupTables: a model whose layers mix attention types has a table per layer group (group 0's
  // in `tables`); KV events of group g > 0 carry `group`.
  return { config, refs: new Array(config.num_blocks).fill(0), hashed: new Set(), tables: new Map(),
           groupTables: (config.windows || [0]).slice(1).map(() => new Map()),
           seqs: new Map(), reqs: new Map(), running: [], waiting: [], preempted: new Set(), figures: {},
           step: 0, batch: [], prefill: 0, decode: 0, timeline: [], flashes: new Map(), blockText: new Map(),
           log: [], nreq: 0, labels: new Map(),
           // The second tier, followed by block hash (`key` on cache and tier_load events): what a
           // block held (blockInfo), the key each cached block holds (keyOf), the key a block evicted
           // this message held (its write-back save comes after the evict), the tier's entries this
           // page saw arrive (key -> entry, least recently used first), and this step's traffic.
           blockInfo: new Map(), keyOf: new Map(), evictedKey: new Map(), tier: new Map(), tierFlashes: new Map(),
           tierStep: { in: 0, out: 0 }, swapping: new Set(), loadedNow: new Set(), tierEvicted: 0,
           // LoRA adapters paged in the pool (S-LoRA's unified paging): block -> [adapter, page], and
           // each resident adapter's pages.
           adapterOf: new Map(), adapters: new Map() };
}

// A resident adapter's pages: held (ref > 0: a running request uses it) or idle (free to take).
function placeAdapter(a, blocks) {
  S.adapters.set(a, blocks);
  blocks.forEach((b, i) => S.adapterOf.set(b, [a, i]));
}

function addRequest(rid, seqIds, n, prompt, label) {
  if (!S.reqs.has(rid)) {
    S.nreq += 1;
    S.reqs.set(rid, { label: label || `R${S.nreq}`, color: PALETTE[(S.nreq - 1) % PALETTE.length], seqs: seqIds, n });
  }
  const r = S.reqs.get(rid);
  seqIds.forEach((sid, i) => {
    if (!S.seqs.has(sid)) S.seqs.set(sid, { req: rid, index: i, status: i === 0 ? "waiting" : "pending", tokens: [...prompt] });
    // Labels outlive the request, for the log and the last batch.
    S.labels.set(sid, { label: r.n > 1 ? `${r.label}.${i}` : r.label, color: r.color });
  });
}

function seqLabel(sid) { return S.labels.get(sid)?.label ?? `s${sid}`; }
function seqColor(sid) { return S.labels.get(sid)?.color ?? "#999"; }

function flash(blocks, kind) { blocks.forEach((b) => S.flashes.set(b, kind)); }
function log(type, text) {
  S.log.push({ type, text, step: S.step });
  if (S.log.length > MAX_LOG) S.log.shift();
}
// A table entry of -1 (RELEASED): a block the sliding window released, or a prefix hit never took.
const RELEASED = -1;
function held(blocks) { return blocks.filter((b) => b !== RELEASED); }
function ids(blocks) { return held(blocks).map((b) => `P${b}`).join(" "); }
function numReleased(t) { let n = 0; while (n < t.blocks.length && t.blocks[n] === RELEASED) n += 1; return n; }

function applyKV(ev) {
  if (ev.type === "fill") {  // every layer group's table of the sequence holds as many slots
    for (const m of [S.tables, ...S.groupTables]) {
      const g = m.get(ev.seq);
      if (g) { g.tokens = ev.tokens; g.lookahead = ev.lookahead || 0; }
    }
    return;
  }
  const tables = ev.group ? S.groupTables[ev.group - 1] : S.tables;
  const t = tables.get(ev.seq);
  switch (ev.type) {
    case "hit": {
      const got = held(ev.blocks), skipped = ev.blocks.length - got.length;
      got.forEach((b) => { S.refs[b] += 1; });
      tables.set(ev.seq, { blocks: [...ev.blocks], tokens: ev.tokens });
      if (ev.blocks.length) {
        const loaded = got.filter((b) => S.loadedNow.has(b)).length;  // its tier_load events came just before
        log("hit", `${seqLabel(ev.seq)} prefix hit: shares ${got.length} cached blocks ${ids(got)}` +
            `${loaded ? ` (${loaded} of them just loaded from the tier)` : ""}` +
            `${skipped ? ` (${skipped} below its sliding window not needed)` : ""} (${ev.tokens} of ${ev.queried} prompt tokens skip prefill)`);
        flash(got.filter((b) => !S.loadedNow.has(b)), "hit");
      }
      break;
    }
    case "alloc":
      ev.blocks.forEach((b) => { S.refs[b] = 1; S.blockText.delete(b); });
      if (t) t.blocks.push(...ev.blocks); else tables.set(ev.seq, { blocks: [...ev.blocks], tokens: 0 });
      log("alloc", `${seqLabel(ev.seq)} allocates ${ids(ev.blocks)}`);
      flash(ev.blocks, "alloc");
      break;
    case "cow":
      S.refs[ev.src] -= 1; S.refs[ev.dst] = 1; t.blocks[ev.index] = ev.dst;
      log("cow", `${seqLabel(ev.seq)} copy-on-write: logical block ${ev.index} P${ev.src} → P${ev.dst} (P${ev.src} was shared)`);
      flash([ev.src, ev.dst], "cow");
      break;
    case "rollback":  // speculative decoding: rejected draft tokens give their lookahead slots back
      ev.blocks.forEach((b) => { S.refs[b] -= 1; });
      t.blocks.length -= ev.blocks.length; t.tokens = ev.tokens; t.lookahead = 0;
      if (ev.rejected)
        log("rollback", `${seqLabel(ev.seq)} rollback: ${ev.rejected} draft token${ev.rejected > 1 ? "s" : ""} rejected, keeps ${ev.tokens} tokens${ev.blocks.length ? `, frees ${ids(ev.blocks)}` : ""}`);
      flash(ev.blocks, "free");
      break;
    case "cache": {
      S.hashed.add(ev.block);
      if (ev.key) S.keyOf.set(ev.block, ev.key);
      for (const [sid, tab] of allTables()) {  // remember its text: it outlives its sequence
        const i = tab.blocks.indexOf(ev.block);
        if (i >= 0 && S.seqs.has(sid)) {
          const B = S.config.block_size;
          S.blockText.set(ev.block, S.seqs.get(sid).tokens.slice(i * B, (i + 1) * B).join(""));
          S.blockInfo.set(ev.block, { sid, index: i });
          break;
        }
      }
      break;
    }
    case "fork": {
      held(ev.blocks).forEach((b) => { S.refs[b] = ev.shared ? S.refs[b] + 1 : 1; });
      tables.set(ev.seq, { blocks: [...ev.blocks], tokens: ev.tokens });
      const parent = S.seqs.get(ev.parent), child = S.seqs.get(ev.seq);
      if (parent && child) { child.tokens = parent.tokens.slice(0, ev.tokens); child.status = "running"; }
      if (parent && !child) {  // a beam chosen twice: a sequence the request did not announce
        const r = S.reqs.get(parent.req);
        S.seqs.set(ev.seq, { req: parent.req, index: -1, status: "running", tokens: parent.tokens.slice(0, ev.tokens) });
        S.labels.set(ev.seq, { label: `${r ? r.label : "beam"}·${ev.seq}`, color: r ? r.color : "#999" });
      }
      log("fork", `${seqLabel(ev.parent)} → ${seqLabel(ev.seq)}: fork at ${ev.tokens} tokens, ${ev.shared ? "shares" : "copies"} ${ids(ev.blocks)}`);
      flash(held(ev.blocks), "fork");
      break;
    }
    case "slide":  // sliding window: blocks no later query of the sequence reads go back to the pool
      ev.blocks.forEach((b, i) => { S.refs[b] -= 1; t.blocks[ev.index + i] = RELEASED; });
      log("slide", `${seqLabel(ev.seq)} sliding window releases ${ids(ev.blocks)} (L${ev.index}${ev.blocks.length > 1 ? `–L${ev.index + ev.blocks.length - 1}` : ""}: below every later query's window)`);
      flash(ev.blocks, "slide");
      break;
    case "free":
      ev.blocks.forEach((b) => { S.refs[b] -= 1; });
      tables.delete(ev.seq);
      log("free", `${seqLabel(ev.seq)} frees ${ids(ev.blocks)}`);
      flash(ev.blocks, "free");
      break;
    case "evict":
      // A write-back tier saves the evicted content after this event names the block: keep what it held.
      if (S.keyOf.has(ev.block)) S.evictedKey.set(ev.block, tierEntry(ev.block, S.keyOf.get(ev.block)));
      S.hashed.delete(ev.block); S.blockText.delete(ev.block); S.keyOf.delete(ev.block); S.blockInfo.delete(ev.block);
      log("evict", `P${ev.block} evicted from the prefix cache (least recently used)`);
      flash([ev.block], "evict");
      break;
    case "adapter_load":  // an adapter's weights written into fresh blocks (ref 1 each)
      ev.blocks.forEach((b) => { S.refs[b] = 1; S.hashed.add(b); S.blockText.delete(b); });
      placeAdapter(ev.adapter, ev.blocks);
      log("adapter", `LoRA adapter ${ev.adapter} paged in: ${ev.blocks.length} blocks ${ids(ev.blocks)} (weights, not KV)`);
      flash(ev.blocks, "alloc");
      break;
    case "adapter_hold":  // an idle resident adapter used again: no copy, no read
      ev.blocks.forEach((b) => { S.refs[b] += 1; });
      log("adapter", `LoRA adapter ${ev.adapter} in use again: its ${ev.blocks.length} blocks were still in the pool`);
      flash(ev.blocks, "hit");
      break;
    case "adapter_idle":  // its last running request left: its pages stay, free to take
      ev.blocks.forEach((b) => { S.refs[b] -= 1; });
      log("adapter", `LoRA adapter ${ev.adapter} idle: its blocks stay (free to take, least recently used first)`);
      break;
    case "adapter_evict":  // one of its idle pages was handed out: the whole adapter leaves the pool
      ev.blocks.forEach((b) => { S.hashed.delete(b); S.adapterOf.delete(b); });
      S.adapters.delete(ev.adapter);
      log("evict", `LoRA adapter ${ev.adapter} evicted: its blocks ${ids(ev.blocks)} go to others (read again when asked for)`);
      flash(ev.blocks, "evict");
      break;
    case "reset_cache":
      for (const b of [...S.hashed]) if (S.refs[b] === 0) { S.hashed.delete(b); S.keyOf.delete(b); }
      log("free", "prefix cache reset");
      break;
    case "pin":    // the tier holds a reference: a write in flight, or a hit's blocks while a load fills the rest
      ev.blocks.forEach((b) => { S.refs[b] += 1; });
      break;
    case "unpin":
      ev.blocks.forEach((b) => { S.refs[b] -= 1; });
      break;
    case "tier_load": {  // a fresh block filled from the tier for the sequence's table[index]: ref 1 (pinned), cached
      const B = S.config.block_size, s = S.seqs.get(ev.seq);
      S.refs[ev.block] = 1; S.hashed.add(ev.block);
      if (s) S.blockText.set(ev.block, s.tokens.slice(ev.index * B, (ev.index + 1) * B).join(""));
      S.blockInfo.set(ev.block, { sid: ev.seq, index: ev.index });
      if (ev.key) {
        S.keyOf.set(ev.block, ev.key);
        const e = S.tier.get(ev.key) || tierEntry(ev.block, ev.key);
        S.tier.delete(ev.key); S.tier.set(ev.key, { ...e, loads: (e.loads || 0) + 1 });  // most recently used now
        S.tierFlashes.set(ev.key, "out");
      }
      S.tierStep.out += 1; S.loadedNow.add(ev.block);
      flash([ev.block], "load");
      // One log line per sequence and step, however many blocks it loads (evictions come in between).
      let l = S.log.findLast((e) => e.step !== S.step || (e.loadSeq === ev.seq && e.type === "tier"));
      if (l && l.step === S.step) l.blocks.push([ev.index, ev.block]);
      else { log("tier", ""); l = Object.assign(S.log[S.log.length - 1], { loadSeq: ev.seq, blocks: [[ev.index, ev.block]] }); }
      l.text = `${seqLabel(ev.seq)} loads ${l.blocks.length} block${l.blocks.length > 1 ? "s" : ""} back from the tier: ` +
               l.blocks.map(([i, b]) => `L${i}→P${b}`).join(" ") + " (read from disk, not recomputed)";
      break;
    }
    case "offload": {  // these blocks' bytes go to the tier now
      const why = new Map();  // reason -> count
      for (const b of ev.blocks) {
        // A block evicted this step is saved with the content it held; any other is written as it is.
        const how = S.swapping.has(b) ? "swapped out" : S.evictedKey.has(b) ? "saved as the pool evicts it (write-back)"
          : "written through as it was cached";
        why.set(how, (why.get(how) || 0) + 1);
        const e = S.evictedKey.get(b) || (S.keyOf.has(b) ? tierEntry(b, S.keyOf.get(b)) : null);
        if (!e) continue;
        const old = S.tier.get(e.key);
        S.tier.delete(e.key); S.tier.set(e.key, { ...e, how, loads: old?.loads || 0 });
        S.tierFlashes.set(e.key, "in");
      }
      S.tierStep.in += ev.blocks.length;
      flash(ev.blocks.filter((b) => !S.loadedNow.has(b)), "offload");  // a reused block shows its new content's load
      log("tier", `${ids(ev.blocks)} → tier: ${[...why].map(([how, n]) => `${n} ${how}`).join(", ")}`);
      break;
    }
    case "swap_out":  // a preempted sequence's blocks saved to the tier (its free follows)
      ev.blocks.forEach((b) => S.swapping.add(b));
      log("tier", `${seqLabel(ev.seq)} swapped out: ${ev.blocks.length ? `its blocks ${ids(ev.blocks)} are saved to the tier` : "the tier holds its blocks already"}; its resume finds them in the pool, or loads them back from the tier`);
      flash(ev.blocks, "offload");
      break;
    default:
      console.warn("unknown KV event", ev);
  }
}

// What the tier keeps of a block: its hash, its text, and whose block it was (for colour and label).
function tierEntry(b, key) {
  const info = S.blockInfo.get(b);
  return { key, text: S.blockText.get(b) || "", sid: info?.sid, index: info?.index, block: b, step: S.step };
}

// The tier's LRU drops entries the page cannot name (it sends no event): drop as many of the oldest.
function tierFigures(f) {
  if (f.tier_evicted === undefined) return;
  let gone = f.tier_evicted - S.tierEvicted;
  S.tierEvicted = f.tier_evicted;
  for (const key of S.tier.keys()) { if (gone-- <= 0) break; S.tier.delete(key); }
}

function applyKVList(events) {
  events.forEach(applyKV);
  S.evictedKey.clear(); S.swapping.clear(); S.loadedNow.clear();  // a save follows its evict within the same step
}

function setQueues(m) {
  S.running = m.running; S.waiting = m.waiting;
  for (const sid of m.running) { const s = S.seqs.get(sid); if (s) s.status = "running"; S.preempted.delete(sid); }
  for (const sid of m.waiting) { const s = S.seqs.get(sid); if (s && s.status !== "preempted") s.status = "waiting"; }
}

function finish(finished) {
  for (const [sid, reason] of Object.entries(finished || {})) {
    const s = S.seqs.get(Number(sid));
    if (s) s.status = `finished (${reason})`;
    S.preempted.delete(Number(sid));
    log("finish", `${seqLabel(Number(sid))} finished: ${reason}`);
  }
  // Forget requests whose every sequence is done and holds no blocks: the page stays small.
  for (const [rid, r] of S.reqs) {
    if (r.seqs.every((sid) => !S.tables.has(sid) && (S.seqs.get(sid)?.status || "").startsWith("finished"))) {
      r.seqs.forEach((sid) => S.seqs.delete(sid));
      S.reqs.delete(rid);
    }
  }
}

// Every table of every layer group, as [seq, table] pairs.
function* allTables() {
  for (const m of [S.tables, ...S.groupTables]) yield* m;
}

function applyMessage(m) {
  if (m.kind === "snapshot") {
    S = fresh(m.config);
    S.refs = [...m.refs]; S.hashed = new Set(m.hashed); S.step = m.step;
    for (const [rid, r] of Object.entries(m.requests)) addRequest(rid, r.seqs, r.n, []);
    for (const [sid, s] of Object.entries(m.seqs)) {
      const e = S.seqs.get(Number(sid)) || {};
      S.seqs.set(Number(sid), { ...e, req: s.req, index: s.index, status: s.status, tokens: s.tokens });
    }
    for (const [sid, [blocks, tokens]] of Object.entries(m.tables)) S.tables.set(Number(sid), { blocks, tokens });
    (m.groups || []).forEach((g, i) => {
      for (const [sid, [blocks, tokens]] of Object.entries(g)) S.groupTables[i].set(Number(sid), { blocks, tokens });
    });
    for (const [b, key] of Object.entries(m.keys || {})) S.keyOf.set(Number(b), key);
    for (const [a, blocks] of Object.entries(m.adapters || {})) placeAdapter(Number(a), blocks);
    setQueues(m); S.figures = m.figures; S.tierEvicted = m.figures.tier_evicted || 0;
    showInfo();
    return;
  }
  if (!S) return;
  if (m.kind === "request") {
    addRequest(m.req, m.seqs, m.n, m.prompt, m.label);
    const r = S.reqs.get(m.req);
    log("request", `${r.label} arrives: ${m.prompt.length} prompt tokens${m.n > 1 ? `, n=${m.n}` : ""}${m.forked_from !== undefined ? ` (reader forked from ${seqLabel(m.forked_from)})` : ""}`);
    return;
  }
  if (m.kind === "step") {
    S.step = m.step; S.tierStep = { in: 0, out: 0 };
    if (m.label) log("step", `step ${m.step}: ${m.label}`);
    for (const sid of m.preempted) {
      S.preempted.add(sid);
      const s = S.seqs.get(sid); if (s) s.status = "preempted";
      log("preempt", S.config.tier?.preemption_mode === "swap"
        ? `${seqLabel(sid)} preempted: out of free blocks, its blocks go to the tier and are freed; it resumes from a prefix hit`
        : `${seqLabel(sid)} preempted: out of free blocks, its blocks are freed and it will be recomputed`);
    }
    applyKVList(m.kv);
    for (const [sid, pieces] of Object.entries(m.tokens)) {
      const s = S.seqs.get(Number(sid)); if (s) s.tokens.push(...pieces);
    }
    S.batch = m.batch; S.prefill = m.prefill_tokens; S.decode = m.decode_tokens;
    setQueues(m); S.figures = m.figures; tierFigures(m.figures);
    S.timeline.push({ step: m.step, prefill: m.prefill_tokens, decode: m.decode_tokens, used: m.figures.used,
                      tierIn: S.tierStep.in, tierOut: S.tierStep.out });
    if (S.timeline.length > MAX_TIMELINE) S.timeline.shift();
    finish(m.finished);
    return;
  }
  if (m.kind === "abort") {
    applyKVList(m.kv);
    setQueues(m); S.figures = m.figures; tierFigures(m.figures);
    finish(m.finished);
    return;
  }
  if (m.kind === "dropped") log("evict", `live stream dropped: ${m.reason}; reload the page`);
  if (m.kind === "closing") log("evict", `live stream closed: ${m.reason}`);
}

// ---------------------------------------------------------------- drawing
let dirty = false;
let poolCells = [], poolSigs = [];
function redraw() { if (!dirty) { dirty = true; requestAnimationFrame(draw); } }

function owners() {
  const own = new Map();  // block -> [[seq, logical index], ...]
  for (const [sid, t] of allTables()) t.blocks.forEach((b, i) => {
    if (b === RELEASED) return;
    if (!own.has(b)) own.set(b, []);
    own.get(b).push([sid, i, t]);
  });
  return own;
}

function blockFill(t, i) {
  const B = S.config.block_size;
  return Math.max(0, Math.min(B, t.tokens - i * B));
}
// Of block i's filled slots, the lookahead ones: draft tokens waiting for verification.
function blockAhead(t, i) {
  const B = S.config.block_size, la = t.lookahead || 0;
  return Math.max(0, Math.min(B, t.tokens - i * B) - Math.max(0, t.tokens - la - i * B));
}

function draw() {
  dirty = false;
  if (!S) return;
  const own = owners(), B = S.config.block_size, n = S.config.num_blocks;
  let used = 0, shared = 0, cached = 0;
  S.refs.forEach((r, b) => { if (r > 0) used += 1; if (r > 1) shared += 1; if (r === 0 && S.hashed.has(b)) cached += 1; });
  let adapterPages = 0;
  S.adapterOf.forEach((_, b) => { if (S.refs[b] > 0) adapterPages += 1; });
  $("fig-adapter-box").hidden = !S.config.lora;
  $("fig-adapter").textContent = `${S.adapters.size} · ${adapterPages} · ${S.adapterOf.size - adapterPages}`;
  const f = S.figures || {};
  $("fig-step").textContent = S.step;
  $("fig-used").textContent = used; $("cmp-used").textContent = used;
  $("fig-shared").textContent = shared; $("fig-cached").textContent = cached; $("fig-free").textContent = n - used - cached;
  $("fig-usage").textContent = pct(used / n);
  $("fig-hit").textContent = pct(f.hit_rate || 0);
  $("fig-waste").textContent = pct(f.waste || 0);
  $("fig-events").textContent = `${f.cow || 0} · ${f.forks || 0} · ${f.evictions || 0} · ${f.preemptions || 0}`;
  $("fig-spec-box").hidden = f.spec_drafted === undefined;
  $("fig-window-box").hidden = !S.config.sliding_window;
  // A model whose layers mix attention types: what each layer group holds, and what windows released.
  $("fig-window").textContent = f.groups
    ? `${f.window_released || 0} (held: ${f.groups.map((g) => `${g.kind} ${g.held}`).join(", ")})`
    : f.window_released || 0;
  if (f.spec_drafted !== undefined)
    $("fig-spec").textContent = `${f.spec_accepted}/${f.spec_drafted} (${pct(f.spec_drafted ? f.spec_accepted / f.spec_drafted : 0)})`;
  $("fig-without").textContent = f.without_sharing ?? 0; $("fig-reserve").textContent = f.reserve_max ?? 0;
  const tier = f.tier_blocks !== undefined;
  document.querySelectorAll(".tier-only").forEach((el) => { el.hidden = !tier; });
  document.querySelector("main").classList.toggle("with-tier", tier);
  if (tier) {
    $("fig-tier-hit").textContent = `${pct(f.tier_hit_rate)} (${f.tier_hits} tok)`;
    $("fig-tier-disk").textContent = `${f.tier_blocks} · ${mib(f.tier_bytes)}`;
    $("fig-tier-io").textContent = `${f.tier_loaded} · ${f.tier_offloaded} · ${f.swap_outs}`;
  }
  const top = Math.max(used, f.without_sharing || 0, f.reserve_max || 0, 1);
  $("bar-used").style.width = pct(used / top); $("bar-without").style.width = pct((f.without_sharing || 0) / top);
  $("bar-reserve").style.width = pct((f.reserve_max || 0) / top);

  // The pool: one cell per physical block, created once; a frame rewrites only the cells
  // whose look changed (thousands of blocks, a handful change per step).
  const pool = $("pool");
  pool.classList.toggle("dense", n > 768);
  if (poolCells.length !== n || pool.children.length !== n) {
    pool.innerHTML = Array.from({ length: n }, (_, b) => `<div class="cell" data-block="${b}"></div>`).join("");
    poolCells = Array.from(pool.children);
    poolSigs = new Array(n).fill("");
  }
  for (let b = 0; b < n; b++) {
    const ref = S.refs[b], h = own.get(b), cls = ["cell"];
    const pins = S.adapterOf.has(b) ? 0 : ref - (h ? h.length : 0);  // references no table holds: the tier's
    let fill = "", ownTxt = "";
    const ad = S.adapterOf.get(b);
    if (ad) {  // a page of a LoRA adapter's weights
      cls.push(ref > 0 ? "adapter" : "adapter-idle");
      ownTxt = `A${ad[0]}`;
    } else if (ref > 0 && h) {
      const [sid, i, t] = h[0], k = blockFill(t, i);
      fill = `<div class="fill" style="height:${(100 * k) / B}%;background:${seqColor(sid)}"></div>`;
      ownTxt = seqLabel(sid);
    } else if (S.hashed.has(b)) cls.push("cached");
    if (ref > 1) cls.push("shared");
    if (pins > 0) cls.push("pinned");
    const fl = S.flashes.get(b); if (fl) cls.push(`flash-${fl}`);
    const html = `${fill}<span class="id">${b}</span><span class="own">${ownTxt}</span>${ref > 1 ? `<span class="ref">×${ref}</span>` : ""}` +
                 (pins > 0 ? `<span class="pin" title="pinned by the tier">⛁</span>` : "");
    const sig = cls.join(" ") + html;
    if (sig !== poolSigs[b]) {
      poolSigs[b] = sig;
      poolCells[b].className = cls.join(" ");
      poolCells[b].innerHTML = html;
    }
  }
  S.flashes.clear();
  if (tier) drawTier(f);

  // Block tables, one row per sequence holding blocks (and per layer group, when the model has several).
  const rows = [], windows = S.config.windows || [0];
  const groupRows = [];
  for (const sid of [...S.tables.keys()].sort((a, b) => a - b))
    [S.tables, ...S.groupTables].forEach((m, g) => { if (m.has(sid)) groupRows.push([sid, g, m.get(sid)]); });
  for (const [sid, g, t] of groupRows) {
    const s = S.seqs.get(sid), r = numReleased(t);
    const group = windows.length > 1 ? ` · group ${g} (${windows[g] ? `window ${windows[g]}` : "full"})` : "";
    // The leading entries the sliding window released, as one cell (a long sequence has thousands).
    const gone = r ? `<div class="tcell released" data-seq="${sid}" data-released="${r}" title="L0–L${r - 1}: released by the sliding window (no later query reads them)">` +
                     `<span>L0${r > 1 ? `–L${r - 1}` : ""} released</span></div>` : "";
    const tc = t.blocks.map((b, i) => {
      if (b === RELEASED) return "";
      const k = blockFill(t, i);
      const a = blockAhead(t, i);
      return `<div class="tcell${S.refs[b] > 1 ? " shared" : ""}" data-block="${b}" data-seq="${sid}" title="L${i} → P${b}${a ? `, ${a} lookahead slots` : ""}">` +
             `<div class="fill" style="width:${(100 * k) / B}%;background:${seqColor(sid)}"></div>` +
             (a ? `<div class="ahead" style="left:${(100 * (k - a)) / B}%;width:${(100 * a) / B}%"></div>` : "") +
             `<span>L${i}→P${b}${k < B ? ` ${k}/${B}` : ""}</span></div>`;
    });
    rows.push(`<div class="trow" data-seq="${sid}"><span class="label"><i class="sw" style="background:${seqColor(sid)}"></i>` +
              `${seqLabel(sid)}${group} · ${s ? s.status : ""} · ${t.tokens} tok${t.lookahead ? ` (${t.lookahead} lookahead)` : ""}</span>${gone}${tc.join("")}</div>`);
  }
  $("tables").innerHTML = rows.join("") || "<small>no sequence holds blocks</small>";

  // Scheduler.
  const chip = (sid, extra = "") => `<span class="chip ${extra}" data-seq="${sid}" style="background:${seqColor(sid)}33">${seqLabel(sid)}</span>`;
  $("q-running").innerHTML = S.running.map((sid) => chip(sid)).join("");
  $("q-waiting").innerHTML = S.waiting.filter((sid) => !S.preempted.has(sid)).map((sid) => chip(sid)).join("");
  $("q-preempted").innerHTML = [...S.preempted].map((sid) => chip(sid)).join("");
  $("batch").innerHTML = S.batch.map(([sid, start, k, d = 0]) => {
    const decode = start > 0 && k - d === 1;
    return `<span class="chip ${decode ? "decode" : "prefill"}" data-seq="${sid}">${seqLabel(sid)} ${decode ? (d ? `decode 1 + ${d} draft` : "decode 1") : `prefill ${k}`}</span>`;
  }).join("");
  $("batch-info").textContent = `${S.batch.length} sequences: ${S.prefill} prefill + ${S.decode} decode tokens`;
  drawTimeline();

  const logEl = $("log");
  logEl.innerHTML = S.log.map((e) => `<li data-type="${e.type}"><b>${e.type}</b> ${esc(e.text)}</li>`).join("");
  logEl.scrollTop = logEl.scrollHeight;
}

// The second tier: one cell per entry this page saw go to disk, least recently used first (the
// tier evicts from the left); entries it held before the page opened are counted, not drawn.
function drawTier(f) {
  const c = S.config.tier || {};
  $("tier-info").textContent = `on disk · ${c.write_policy === "write_back" ? "write-back" : "write-through"}` +
    `${c.preemption_mode === "swap" ? " · swap preemption" : ""} · ${f.tier_blocks} blocks, ${mib(f.tier_bytes)} of ${gib(f.tier_capacity)}`;
  $("tier-in").textContent = S.tierStep.in; $("tier-out").textContent = S.tierStep.out;
  $("tier-hits").textContent = f.tier_hits;
  $("tier-errors").textContent = `${f.tier_read_failures} · ${f.tier_write_errors}`;
  const entries = [...S.tier.values()], shown = entries.slice(-MAX_TIER_CELLS);
  const before = Math.max(0, f.tier_blocks - entries.length) + (entries.length - shown.length);
  $("tier").innerHTML = (before ? `<div class="tier-cell earlier" title="entries this page did not see written">+${before}</div>` : "") +
    shown.map((e) => {
      const fl = S.tierFlashes.get(e.key);
      const who = e.sid !== undefined ? `${seqLabel(e.sid)}${e.index !== undefined ? ` L${e.index}` : ""}` : `P${e.block}`;
      return `<div class="tier-cell${fl ? ` flash-${fl}` : ""}" data-key="${esc(e.key)}" style="--c:${e.sid !== undefined ? seqColor(e.sid) : "#999"}">` +
             `<span class="who">${esc(who)}</span>${e.loads ? `<span class="loads">↑${e.loads}</span>` : ""}</div>`;
    }).join("") || (before ? "" : "<small>nothing on disk yet</small>");
  S.tierFlashes.clear();
}

function drawTimeline() {
  const c = $("timeline"), ctx = c.getContext("2d");
  c.width = c.clientWidth * devicePixelRatio; c.height = 110 * devicePixelRatio;
  ctx.scale(devicePixelRatio, devicePixelRatio);
  const w = c.clientWidth, h = 110, T = S.timeline;
  ctx.clearRect(0, 0, w, h);
  if (!T.length) return;
  const maxTok = Math.max(1, ...T.map((p) => p.prefill + p.decode)), maxUsed = Math.max(1, S.config.num_blocks);
  const bw = w / MAX_TIMELINE, css = getComputedStyle(document.documentElement);
  T.forEach((p, i) => {
    const x = i * bw, hp = ((h - 12) * p.prefill) / maxTok, hd = ((h - 12) * p.decode) / maxTok;
    ctx.fillStyle = css.getPropertyValue("--decode"); ctx.fillRect(x, h - hd, Math.max(1, bw - 1), hd);
    ctx.fillStyle = css.getPropertyValue("--prefill"); ctx.fillRect(x, h - hd - hp, Math.max(1, bw - 1), hp);
  });
  T.forEach((p, i) => {  // tier traffic: a tick on top, green to the tier, blue back from it
    if (p.tierIn) { ctx.fillStyle = "#2ca02c"; ctx.fillRect(i * bw, 12, Math.max(1, bw - 1), 4); }
    if (p.tierOut) { ctx.fillStyle = "#1f77b4"; ctx.fillRect(i * bw, 17, Math.max(1, bw - 1), 4); }
  });
  ctx.strokeStyle = "#111"; ctx.lineWidth = 1.5; ctx.beginPath();
  T.forEach((p, i) => { const y = h - ((h - 12) * p.used) / maxUsed; i ? ctx.lineTo(i * bw + bw / 2, y) : ctx.moveTo(bw / 2, y); });
  ctx.stroke();
  ctx.fillStyle = "#555"; ctx.font = "10px sans-serif";
  ctx.fillText(`max ${maxTok} tok/step · ${S.config.num_blocks} blocks`, 4, 10);
}

function showInfo() {
  const c = S.config;
  $("pool-info").textContent = `${c.num_blocks} blocks × ${c.block_size} tokens · ${c.policy}` +
    `${c.prefix_caching ? " · prefix caching" : ""}${c.sliding_window ? ` · sliding window ${c.sliding_window}` : ""} · model ${c.model}`;
  $("legend").innerHTML = [
    ["#4e79a7", "owned: colour and label = request (height = how full)"],
    ["#fff; border:2px dashed #111", "shared (ref > 1, read-only) ×ref"],
    ["repeating-linear-gradient(45deg,#e9e9ee 0 3px,#fff 3px 6px)", "cached-free (reusable prefix)"],
    ["#fff", "free"]].concat(c.sliding_window ? [["repeating-linear-gradient(90deg,#ccc 0 2px,#fff 2px 5px)",
      `table entry released by the sliding window (${c.sliding_window} tokens)`]] : [])
    .concat(c.tier ? [["#fff; box-shadow: 0 0 0 3px #2ca02c", "to the tier this step (offload, swap-out)"],
                      ["#fff; box-shadow: 0 0 0 3px #1f77b4", "loaded back from the tier this step"],
                      ["#fff", "⛁ pinned by the tier (a write in flight, a load's step)"]] : [])
    .concat(c.lora ? [["#b07aa1", "LoRA adapter page (A id): its weights, in use"],
                      ["repeating-linear-gradient(45deg,#e4cfe0 0 3px,#fff 3px 6px)", "idle adapter page (free to take)"]] : [])
    .map(([bg, t]) => `<span><i class="sw" style="background:${bg}"></i>${t}</span>`).join("");
}

const pct = (x) => `${(100 * x).toFixed(1)}%`;
const mib = (x) => `${(x / 2 ** 20).toFixed(1)} MiB`;
const gib = (x) => `${(x / 2 ** 30).toFixed(1)} GiB`;
const esc = (s) => String(s).replace(/[&<>"]/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[ch]));
const show = (s) => esc(s).replace(/\n/g, "⏎\n");

// ---------------------------------------------------------------- hover
function tipFor(el) {
  if (!S) return null;
  const B = S.config.block_size;
  if (el.dataset.block !== undefined) {
    const b = Number(el.dataset.block), holders = owners().get(b) || [];
    let text = S.blockText.get(b) || "";
    if (holders.length) {
      const [sid, i, t] = holders[0], s = S.seqs.get(sid);
      if (s) text = s.tokens.slice(i * B, Math.min((i + 1) * B, t.tokens)).join("");
    }
    const pins = S.refs[b] - holders.length;
    const ad = S.adapterOf.get(b);
    if (ad) return `P${b}: page ${ad[1] + 1} of LoRA adapter ${ad[0]} (${S.adapters.get(ad[0]).length} pages: its weights, ` +
      `${S.refs[b] > 0 ? "used by running requests" : "idle: free to take, used again at no cost until then"})`;
    const state = S.refs[b] > 0 ? `used, ref ${S.refs[b]}${pins > 0 ? ` (${pins} held by the tier: pinned)` : S.refs[b] > 1 ? " (shared, read-only)" : ""}`
      : S.hashed.has(b) ? "cached-free (a prefix hit can reuse it)" : "free";
    const who = holders.map(([sid, i, t]) => `${seqLabel(sid)} L${i} (${blockFill(t, i)}/${B})`).join(", ");
    return `P${b}: ${state}${who ? `\nheld by ${who}` : ""}${text ? `\ntokens: ${show(text)}` : ""}`;
  }
  if (el.dataset.key !== undefined) {
    const e = S.tier.get(el.dataset.key);
    if (!e) return null;
    const where = [...S.keyOf].find(([, k]) => k === e.key);
    return `tier entry ${e.key}: ${e.how || "on disk"} at step ${e.step} from P${e.block}` +
           `${e.sid !== undefined ? ` (${seqLabel(e.sid)}${e.index !== undefined ? ` L${e.index}` : ""})` : ""}` +
           `${e.loads ? `\nloaded back ${e.loads}×` : ""}${where ? `\nin the pool too: P${where[0]}` : "\nno longer in the pool"}` +
           `${e.text ? `\ntokens: ${show(e.text)}` : ""}`;
  }
  if (el.dataset.seq !== undefined) {
    const sid = Number(el.dataset.seq), s = S.seqs.get(sid), t = S.tables.get(sid);
    if (!s) return `s${sid}`;
    const r = t ? numReleased(t) : 0;
    const table = t ? (r ? `L0${r > 1 ? `–L${r - 1}` : ""} released ` : "") + t.blocks.slice(r).map((b, i) => `L${i + r}→P${b}`).join(" ") : "(no blocks)";
    return `${seqLabel(sid)} · ${s.status} · ${s.tokens.length} tokens\ntable: ${table}\ntext: ${show(s.tokens.join("").slice(-1200))}`;
  }
  return null;
}

document.addEventListener("mouseover", (e) => {
  const el = e.target.closest("[data-block],[data-seq],[data-key]"), tip = $("tip");
  document.querySelectorAll(".hl").forEach((x) => x.classList.remove("hl"));
  const text = el && tipFor(el);
  if (!text) { tip.hidden = true; return; }
  tip.textContent = text; tip.hidden = false;
  if (el.dataset.block !== undefined) document.querySelectorAll(`[data-block="${el.dataset.block}"]`).forEach((x) => x.classList.add("hl"));
  if (el.dataset.key !== undefined) {  // the pool block that holds the entry's content now, if one does
    el.classList.add("hl");
    const where = [...S.keyOf].find(([, k]) => k === el.dataset.key);
    if (where) document.querySelectorAll(`[data-block="${where[0]}"]`).forEach((x) => x.classList.add("hl"));
  }
  if (el.dataset.block !== undefined && S.keyOf.has(Number(el.dataset.block)))  // and the other way
    document.querySelectorAll(`#tier [data-key="${S.keyOf.get(Number(el.dataset.block))}"]`).forEach((x) => x.classList.add("hl"));
  if (el.dataset.seq !== undefined) {
    const t = S.tables.get(Number(el.dataset.seq));
    (t ? held(t.blocks) : []).forEach((b) => document.querySelectorAll(`#pool [data-block="${b}"]`).forEach((x) => x.classList.add("hl")));
  }
});
document.addEventListener("mousemove", (e) => {
  const tip = $("tip");
  tip.style.left = `${Math.min(e.clientX + 14, innerWidth - 430)}px`; tip.style.top = `${e.clientY + 14}px`;
});

// ---------------------------------------------------------------- sources
function stop() {
  if (source?.kind === "live") source.es.close();
  if (source?.kind === "replay") clearTimeout(source.timer);
  source = null;
}

function setMode(mode, text) { $("mode").dataset.mode = mode; $("mode").textContent = text; }

function goLive() {
  stop();
  received = [];
  S = null;
  $("scenario-desc").textContent = "";
  setMode("live", "live: connecting…");
  const es = new EventSource(`events${keyQuery}`);
  source = { kind: "live", es, playing: true };
  es.onopen = () => setMode("live", "live engine");
  es.onmessage = (e) => { const m = JSON.parse(e.data); received.push(m); applyMessage(m); redraw(); };
  es.onerror = () => setMode("live", "live: disconnected (retrying)");
  $("play").textContent = "pause";
}

async function loadTrace(name) {
  const r = await fetch(`static/traces/${encodeURIComponent(name)}.json`);
  if (!r.ok) { setMode("replay", `no trace named ${name}`); return; }
  startReplay(await r.json());
}

function startReplay(trace) {
  if (!trace || !Array.isArray(trace.messages) || trace.messages[0]?.kind !== "snapshot")
    throw new Error("not a PagedLLM trace: it needs a messages list starting with a snapshot");
  stop();
  received = trace.messages;
  source = { kind: "replay", trace, messages: trace.messages, pos: 0, playing: true, timer: null };
  $("scenario-desc").textContent = `${trace.title || trace.scenario || "trace"}: ${trace.description || ""}`;
  S = null;
  setMode("replay", `replay: ${trace.scenario || "trace"}`);
  $("play").textContent = "pause";
  advance();  // the snapshot
  schedule();
}

function advance() {  // apply messages up to and including the next step
  const R = source;
  while (R.pos < R.messages.length) {
    const m = R.messages[R.pos++];
    applyMessage(m);
    if (m.kind === "step" || m.kind === "snapshot") break;
  }
  if (R.pos >= R.messages.length) { R.playing = false; $("play").textContent = "replay"; setMode("replay", `replay: ${R.trace.scenario || "trace"} (end)`); }
  redraw();
}

function schedule() {
  const R = source;
  if (!R || R.kind !== "replay" || !R.playing) return;
  const speed = SPEEDS[Number($("speed").value)];
  if (speed === Infinity) {  // as fast as possible, drawing now and then
    for (let i = 0; i < 200 && R.playing; i++) advance();
    R.timer = setTimeout(schedule, 0);
  } else {
    advance();
    R.timer = setTimeout(schedule, 1000 / speed);
  }
}

async function control(action, extra = {}) {
  const r = await fetch(`control${keyQuery}`, { method: "POST", headers: { "content-type": "application/json" },
                                                body: JSON.stringify({ action, ...extra }) });
  // A tenant's key may watch but not steer (the controls slow every tenant): say so.
  if (!r.ok && S) { log("request", `${action}: ${(await r.json()).error?.message}`); redraw(); }
}

function speedLabel() {
  const i = Number($("speed").value);
  $("speed-label").textContent = source?.kind === "live" ? `${LIVE_DELAYS[i]} s/step` : (SPEEDS[i] === Infinity ? "max" : `${SPEEDS[i]} steps/s`);
}
function speedChanged() {  // only a user's move changes the live engine's pace
  speedLabel();
  if (source?.kind === "live") control("delay", { seconds: LIVE_DELAYS[Number($("speed").value)] });
}
async function syncLiveSpeed() {  // show the engine's own pace; opening the page must not change it
  try {
    const st = await (await fetch(`state${keyQuery}`)).json();
    let best = 0;
    LIVE_DELAYS.forEach((d, i) => { if (Math.abs(d - st.step_delay) < Math.abs(LIVE_DELAYS[best] - st.step_delay)) best = i; });
    $("speed").value = best;
    if (st.paused && source?.kind === "live") { source.playing = false; $("play").textContent = "play"; }
  } catch (_) { /* not served by pagedllm */ }
  speedLabel();
}

$("play").onclick = () => {
  if (source?.kind === "replay") {
    if (source.pos >= source.messages.length) { startReplay(source.trace); return; }
    source.playing = !source.playing;
    $("play").textContent = source.playing ? "pause" : "play";
    if (source.playing) schedule(); else clearTimeout(source.timer);
  } else if (source?.kind === "live") {
    source.playing = !source.playing;
    $("play").textContent = source.playing ? "pause" : "play";
    control(source.playing ? "resume" : "pause");
  }
};
$("step").onclick = () => {
  if (source?.kind === "replay") {
    source.playing = false; clearTimeout(source.timer); $("play").textContent = "play";
    if (source.pos < source.messages.length) advance();
  } else if (source?.kind === "live") {
    if (source.playing) { source.playing = false; $("play").textContent = "play"; control("pause"); }
    control("step");
  }
};
$("speed").oninput = speedChanged;
$("go-live").onclick = () => { history.replaceState(null, "", location.pathname + keyQuery); goLive(); syncLiveSpeed(); };
$("trace-select").onchange = (e) => { if (e.target.value) { loadTrace(e.target.value); speedLabel(); } };
$("run-select").onchange = async (e) => {
  const name = e.target.value;
  e.target.value = "";
  if (!name) return;
  if (source?.kind !== "live") { history.replaceState(null, "", location.pathname + keyQuery); goLive(); await syncLiveSpeed(); }
  const r = await fetch(`scenarios/${encodeURIComponent(name)}/run${keyQuery}`, { method: "POST" });
  const body = await r.json();
  if (S) { log("request", r.ok ? `scenario ${name}: ${body.requests} requests sent to the engine` : `scenario ${name}: ${body.error?.message}`); redraw(); }
};
$("trace-file").onchange = async (e) => {
  const file = e.target.files[0];
  if (!file) return;
  try { startReplay(JSON.parse(await file.text())); speedLabel(); } catch (err) { setMode("replay", `cannot replay ${file.name}: ${err.message}`); }
};
$("record").onclick = () => {
  const trace = { version: 1, scenario: source?.kind === "replay" ? source.trace.scenario : "live-recording",
                  title: "Recorded from the page", description: `${received.length} messages`, messages: received };
  const a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([JSON.stringify(trace)], { type: "application/json" }));
  a.download = `pagedllm-trace-${Date.now()}.json`; a.click();
};
document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "INPUT" || e.target.tagName === "SELECT") return;
  if (e.key === " ") { e.preventDefault(); $("play").click(); }
  if (e.key === "ArrowRight") $("step").click();
});

async function init() {
  try {
    const r = await fetch(`scenarios${keyQuery}`);
    if (r.ok) for (const s of await r.json()) {
      if (s.trace) $("trace-select").insertAdjacentHTML("beforeend", `<option value="${esc(s.name)}">${esc(s.title)}</option>`);
      if (s.live) $("run-select").insertAdjacentHTML("beforeend", `<option value="${esc(s.name)}">${esc(s.title)}</option>`);
    }
  } catch (_) { /* opened as a file: traces come from the file picker */ }
  if (params.get("speed")) $("speed").value = params.get("speed");
  if (params.get("trace")) { await loadTrace(params.get("trace")); speedLabel(); }
  else if (location.protocol === "file:") setMode("replay", "offline: open a trace file");
  else { goLive(); await syncLiveSpeed(); }
}
init();
