// Paged attention for CPUs: reads K/V in place through the block tables.
//
// One op serves a whole step, decodes and prefill chunks alike (varlen): query token i
// of a sequence with ctx_len keys sits at absolute position ctx_len - q_len + i and sees
// keys 0..that position (causal). Work is cut into items of one KV head and a tile of
// query tokens; the query heads that share the KV head (GQA) ride along, so every K/V
// row is read once per item. Small decode batches split long contexts across threads
// and merge the parts' softmax states afterwards (unless split_k is off: the merge sums
// in another order than one pass does, so a row's result would depend on the batch).
// Otherwise a query row's result depends only on its own position and keys: key chunks
// start at key 0 whatever the tile, and keys past a row's last one add exact zeros.
// Math in fp32 whatever the storage
// type (fp32, bf16, fp16); the bf16 dot-product path rounds the softmax weights to bf16
// for P.V, as flash attention on GPUs does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "vec.h"

namespace pagedllm {
namespace {

constexpr int MAX_ROWS = 32;   // query rows (tokens x heads of a group) per prefill item
constexpr float LOG2E = 1.4426950408889634f;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Item {
  int32_t seq, kvh, t0, t1;  // sequence, KV head, query tokens [t0, t1) of the sequence
  int32_t lo, hi;            // keys [lo, hi) this item covers
  int32_t part;              // -1: writes the output; else its slot in the split-K buffers
  int64_t cost;
};

// Pool layouts, per block and KV head, with P = 2 for 16-bit types and 1 for fp32:
//   K [num_blocks, KVH, D / P, B, P]   keys of a block contiguous along each (pair of) dims
//   V [num_blocks, KVH, ceil(B / P), D, P]   (pairs of) keys' values contiguous along d
// With P = 2 a 64-byte line holds 16 keys x 2 dims (K) or 16 dims x 2 keys (V): one
// bf16 dot-product instruction (AVX512_BF16) then does 32 multiply-adds of Q.K or P.V.
// Without it the pair splits into two fp32 vectors (a shift and a mask).
template <typename T>
constexpr int PAIR = sizeof(T) == 2 ? 2 : 1;

#if defined(__AVX512BF16__)
template <typename T>
constexpr bool BF16_DOT = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool BF16_DOT = false;
#endif

template <typename T>
struct Args {
  const T* q; int64_t q_tok, q_head;
  T* out; int64_t o_tok, o_head;
  const T* k; int64_t k_blk, k_head;
  const T* v; int64_t v_blk, v_head;
  const int32_t* tables; int64_t t_row;
  const int32_t* ctx_lens;
  const int32_t* q_start;
  int block_size, group;
  float scale;  // softmax scale times log2(e): the kernel works in base 2
  float* part_acc; float* part_ml;  // split-K: [part][group][D] and [part][group][2]
};

constexpr int QK_ROWS = 4;   // query rows sharing one pass over a K tile
constexpr int CHUNK = 512;   // keys whose scores are computed before their softmax and P.V

struct Scratch {
  std::vector<float> q, acc, s, m, l, alpha;
  std::vector<uint32_t> qp, pp;    // bf16 pairs of q and of P (dot-product path)
  std::vector<uint16_t> kt, vt;    // a gathered tile, in the pool's own layout
  std::vector<int> last_key;
  void fit(int rows, int d) {
    const size_t r = size_t(rows + QK_ROWS);  // room to pad to whole row blocks
    if (q.size() < r * d) { q.resize(r * d); acc.resize(r * d); qp.resize(r * d / 2 + 1); }
    if (s.size() < r * CHUNK) { s.resize(r * CHUNK); pp.resize(r * CHUNK / 2); }
    if (kt.size() < size_t(d) * L * 2) { kt.resize(size_t(d) * L * 2); vt.resize(size_t(d) * L * 2); }
    if (m.size() < r) { m.resize(r); l.resize(r); alpha.resize(r); last_key.resize(r); }
  }
};

// The two fp32 vectors in a line of 16 bf16 pairs: low halves (element 2i), high halves.
inline void split_pairs(const c10::BFloat16* p, vf& lo, vf& hi) {
  vu u;
  std::memcpy(&u, p, sizeof u);
  lo = (vf)(u << 16);
  hi = (vf)(u & 0xFFFF0000u);
}
inline void split_pairs(const c10::Half* p, vf& lo, vf& hi) {
  for (int i = 0; i < L; ++i) {
    lo[i] = float(p[2 * i]);
    hi[i] = float(p[2 * i + 1]);
  }
}

#if defined(__AVX512BF16__)
// acc += x . (the bf16 pair at p, broadcast): the broadcast rides in the instruction
// ({1to16}), where the intrinsics cost a separate vpbroadcastd per dot product.
inline vf dot_bcast(vf acc, __m512bh x, const uint32_t* p) {
  __m512 r = (__m512)acc;
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(r) : "v"(x), "m"(*p));
  return (vf)r;
}
#endif

// Scores S[r][0..16) (rows CHUNK apart) for R query rows against a K tile: kt(j) points
// at pair-row j (16 keys x P dims). Dot path: q as bf16 pairs, scaled after; else q as
// floats, already scaled.
template <typename T, int NC, int R, typename KT>
inline void qk_block(const float* qs, const uint32_t* qp, float scale, float* S, KT kt) {
  constexpr int D = NC * L, P = PAIR<T>;
  vf a0[R] = {}, a1[R] = {};
#if defined(__AVX512BF16__)
  if constexpr (BF16_DOT<T>) {
    for (int j = 0; j < D / 2; j += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt(j)), k1 = (__m512bh)_mm512_loadu_si512(kt(j + 1));
      for (int r = 0; r < R; ++r) {
        a0[r] = dot_bcast(a0[r], k0, qp + r * D / 2 + j);
        a1[r] = dot_bcast(a1[r], k1, qp + r * D / 2 + j + 1);
      }
    }
    for (int r = 0; r < R; ++r) storef(S + r * CHUNK, (a0[r] + a1[r]) * scale);
    return;
  }
#endif
  if constexpr (P == 2) {
    for (int j = 0; j < D / 2; ++j) {
      vf lo, hi;
      split_pairs(kt(j), lo, hi);
      for (int r = 0; r < R; ++r) {
        a0[r] += splat(qs[r * D + 2 * j]) * lo;
        a1[r] += splat(qs[r * D + 2 * j + 1]) * hi;
      }
    }
  } else {
    for (int d = 0; d < D; d += 2) {
      const vf k0 = load16(kt(d)), k1 = load16(kt(d + 1));
      for (int r = 0; r < R; ++r) {
        a0[r] += splat(qs[r * D + d]) * k0;
        a1[r] += splat(qs[r * D + d + 1]) * k1;
      }
    }
  }
  for (int r = 0; r < R; ++r) storef(S + r * CHUNK, a0[r] + a1[r]);
}

// f(std::integral_constant<int, n>) for n in 1..4: loops over rows with a count known at
// compile time, so a decode of 3 query heads per KV head does 3 rows of work, not 4.
template <typename F>
inline void with_rows(int n, F f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// acc[r] = acc[r] * alpha[r] + sum over the chunk's keys of P[r][t] V[t], for RB rows.
// tile(t0) gives the V pair-rows of the tile starting at chunk key t0: vt(i, c) points at
// pair-row i (keys t0+P*i..), dims 16c..16c+15. S: P as floats, pp: as bf16 pairs,
// CHUNK keys per row.
template <typename T, int NC, int RB, typename TILE>
inline void pv_block(float* acc, const float* S, const uint32_t* pp, const float* alpha, int n, TILE tile) {
  constexpr int D = NC * L, P = PAIR<T>;
  vf o[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) o[r][c] = loadf(acc + r * D + c * L) * alpha[r];
  for (int t0 = 0; t0 < n; t0 += L) {
    const auto vt = tile(t0);
    const int pairs = (std::min(L, n - t0) + P - 1) / P;  // P = 0 past n: a half-used pair adds nothing
#if defined(__AVX512BF16__)
    if constexpr (BF16_DOT<T>) {
      for (int i = 0; i < pairs; ++i)
        for (int c = 0; c < NC; ++c) {
          const __m512bh v = (__m512bh)_mm512_loadu_si512(vt(i, c));
          for (int r = 0; r < RB; ++r)
            o[r][c] = dot_bcast(o[r][c], v, pp + r * CHUNK / 2 + t0 / 2 + i);
        }
      continue;
    }
#endif
    for (int i = 0; i < pairs; ++i)
      for (int c = 0; c < NC; ++c) {
        if constexpr (P == 2) {
          vf lo, hi;
          split_pairs(vt(i, c), lo, hi);
          for (int r = 0; r < RB; ++r)
            o[r][c] += splat(S[r * CHUNK + t0 + 2 * i]) * lo + splat(S[r * CHUNK + t0 + 2 * i + 1]) * hi;
        } else {
          const vf v = load16(vt(i, c));
          for (int r = 0; r < RB; ++r) o[r][c] += splat(S[r * CHUNK + t0 + i]) * v;
        }
      }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) storef(acc + r * D + c * L, o[r][c]);
}

// Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next
// tile: ask for its K lines while this one computes.
template <typename T>
inline void prefetch_k(const Args<T>& a, const int32_t* table, int j, int h, int d) {
  const int B = a.block_size, P = PAIR<T>;
  const char* kp = reinterpret_cast<const char*>(a.k + int64_t(table[j / B]) * a.k_blk + h * a.k_head + j % B * P);
  for (int r = 0; r < d / P; ++r) __builtin_prefetch(kp + int64_t(r) * B * P * sizeof(T));
}

template <typename T, int NC>
void run_item(const Item& it, const Args<T>& a, Scratch& sc) {
  constexpr int D = NC * L, P = PAIR<T>;
  constexpr int PV_ROWS = NC <= 2 ? 8 : NC <= 4 ? 4 : NC <= 8 ? 2 : 1;  // accumulators that fit in registers
  const int G = a.group, B = a.block_size;
  const int q_len = a.q_start[it.seq + 1] - a.q_start[it.seq];
  const int first_pos = a.ctx_lens[it.seq] - q_len;  // absolute position of query token 0
  const int rows = (it.t1 - it.t0) * G;
  const int qk_rows = (rows + QK_ROWS - 1) / QK_ROWS * QK_ROWS;
  const int pv_rows = (rows + PV_ROWS - 1) / PV_ROWS * PV_ROWS;
  const int32_t* table = a.tables + it.seq * a.t_row;
  sc.fit(std::max(qk_rows, pv_rows), D);
  float *qs = sc.q.data(), *acc = sc.acc.data(), *S = sc.s.data();
  float *m = sc.m.data(), *l = sc.l.data(), *alpha = sc.alpha.data();
  uint32_t *qp = sc.qp.data(), *pp = sc.pp.data();
  T *kt = reinterpret_cast<T*>(sc.kt.data()), *vt = reinterpret_cast<T*>(sc.vt.data());
  int* last_key = sc.last_key.data();  // causal: row r sees keys <= last_key[r]

  for (int r = 0; r < std::max(qk_rows, pv_rows); ++r) {
    const bool live = r < rows;
    last_key[r] = live ? first_pos + it.t0 + r / G : -1;
    const T* src = a.q + (a.q_start[it.seq] + it.t0 + r / G) * a.q_tok + (it.kvh * G + r % G) * a.q_head;
    for (int c = 0; c < NC; ++c) {
      storef(qs + r * D + c * L, live ? load16(src + c * L) * a.scale : vf{});
      storef(acc + r * D + c * L, vf{});
    }
    if constexpr (BF16_DOT<T>) {
      if (live) std::memcpy(qp + r * D / 2, src, sizeof(T) * D);
      else std::memset(qp + r * D / 2, 0, sizeof(T) * D);
    }
    m[r] = NEG_INF;
    l[r] = 0.f;
    alpha[r] = 1.f;
  }
  // Blocks of a multiple of 16 keys: a tile is read where it lies. Smaller ones: its keys
  // are gathered into kt / vt, in the same layout.
  const bool whole_tiles = B % L == 0;
  const int64_t k_row = int64_t(B) * P;  // elements between pair-rows of K in a block
  auto k_tile = [&](int j0, int n) -> std::pair<const T*, int64_t> {
    if (whole_tiles)
      return {a.k + int64_t(table[j0 / B]) * a.k_blk + it.kvh * a.k_head + (j0 % B) * P, k_row};
    std::memset(kt, 0, sizeof(T) * D * L);
    for (int t = 0; t < n; ++t) {
      const int j = j0 + t;
      const T* ks = a.k + int64_t(table[j / B]) * a.k_blk + it.kvh * a.k_head + (j % B) * P;
      for (int d = 0; d < D; ++d) kt[(d / P) * L * P + t * P + d % P] = ks[(d / P) * k_row + d % P];
    }
    return {kt, int64_t(L) * P};
  };
  auto v_tile = [&](int j0, int n) -> const T* {  // pair-rows D * P elements apart
    if (whole_tiles) return a.v + int64_t(table[j0 / B]) * a.v_blk + it.kvh * a.v_head + (j0 % B / P) * D * P;
    std::memset(vt, 0, sizeof(T) * D * L);
    for (int t = 0; t < n; ++t) {
      const int j = j0 + t;
      const T* vs = a.v + int64_t(table[j / B]) * a.v_blk + it.kvh * a.v_head + (j % B / P) * D * P + j % B % P;
      for (int d = 0; d < D; ++d) vt[(t / P) * D * P + d * P + t % P] = vs[d * P];
    }
    return vt;
  };

  // The last query row sees keys up to first_pos + t1 - 1.
  const int hi = std::min(it.hi, first_pos + it.t1);
  for (int c0 = it.lo; c0 < hi; c0 += CHUNK) {
    const int cn = std::min(CHUNK, hi - c0);
    // 1. Scores of every row against the chunk's keys: tiles independent of each other.
    for (int t0 = 0; t0 < cn; t0 += L) {
      const auto [kb, ks] = k_tile(c0 + t0, std::min(L, cn - t0));
      if (whole_tiles && t0 + L < cn) prefetch_k(a, table, c0 + t0 + L, it.kvh, D);
      for (int r = 0; r < qk_rows; r += QK_ROWS)
        with_rows(std::min(QK_ROWS, rows - r), [&](auto R) {
          qk_block<T, NC, R>(qs + r * D, qp + r * D / 2, a.scale, S + r * CHUNK + t0,
                             [&](int j) { return kb + j * ks; });
        });
    }
    // 2. Softmax over the chunk, carried across chunks (m running max, alpha rescales acc).
    for (int r = 0; r < rows; ++r) {
      float* sr = S + r * CHUNK;
      const int visible = std::min(cn, last_key[r] - c0 + 1);  // keys of the chunk this row sees
      vf mv = splat(m[r]);
      for (int t0 = 0; t0 < visible; t0 += L) {
        vf s = loadf(sr + t0);
        s = IOTA + t0 < visible ? s : splat(NEG_INF);
        storef(sr + t0, s);
        mv = mv > s ? mv : s;
      }
      const float mx = hmax(mv);
      alpha[r] = visible > 0 ? std::exp2(m[r] - mx) : 1.f;  // 0 on the first visible chunk
      vf sum{};
      for (int t0 = 0; t0 < cn; t0 += L) {
        const vf p = t0 < visible ? exp2v(loadf(sr + t0) - mx) : vf{};
        storef(sr + t0, p);
        sum += p;
#if defined(__AVX512BF16__)
        if constexpr (BF16_DOT<T>)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + r * CHUNK / 2 + t0 / 2),
                              (__m256i)_mm512_cvtneps_pbh((__m512)p));
#endif
      }
      if (visible > 0) {
        l[r] = l[r] * alpha[r] + hsum(sum);
        m[r] = mx;
      }
    }
    // 3. acc += P . V, row block by row block, over the chunk's tiles.
    for (int r = 0; r < pv_rows; r += PV_ROWS) {
      auto pv = [&](auto R) {
        pv_block<T, NC, std::min<int>(R, PV_ROWS)>(acc + r * D, S + r * CHUNK, pp + r * CHUNK / 2, alpha + r, cn,
                                                   [&](int t0) {
          const T* vb = v_tile(c0 + t0, std::min(L, cn - t0));
          return [=](int i, int c) { return vb + i * D * P + c * L * P; };
        });
      };
      const int n = std::min(PV_ROWS, rows - r);  // a short last block: exact rows up to 4, else padded
      if (n < PV_ROWS && n <= 4) with_rows(n, pv);
      else pv(std::integral_constant<int, PV_ROWS>{});
    }
  }

  for (int r = 0; r < rows; ++r) {
    const float* ar = acc + r * D;
    if (it.part >= 0) {  // split-K: keep the unnormalised state for the merge
      float* pa = a.part_acc + (int64_t(it.part) * G + r) * D;
      std::memcpy(pa, ar, sizeof(float) * D);
      a.part_ml[(int64_t(it.part) * G + r) * 2] = m[r];
      a.part_ml[(int64_t(it.part) * G + r) * 2 + 1] = l[r];
      continue;
    }
    T* dst = a.out + (a.q_start[it.seq] + it.t0 + r / G) * a.o_tok + (it.kvh * G + r % G) * a.o_head;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // no visible key (context 0): output 0
    for (int c = 0; c < NC; ++c) store16(dst + c * L, loadf(ar + c * L) * inv);
  }
}

// Merge the split-K parts of one (sequence, KV head): parts [p0, p0 + np).
template <typename T, int NC>
void merge_parts(int seq, int kvh, int p0, int np, const Args<T>& a) {
  constexpr int D = NC * L;
  const int G = a.group;
  for (int g = 0; g < G; ++g) {
    float mx = NEG_INF;
    for (int p = 0; p < np; ++p) mx = std::max(mx, a.part_ml[((int64_t)(p0 + p) * G + g) * 2]);
    vf o[NC] = {};
    float den = 0.f;
    for (int p = 0; p < np; ++p) {
      const float* ml = a.part_ml + ((int64_t)(p0 + p) * G + g) * 2;
      if (ml[1] == 0.f) continue;
      const float w = std::exp2(ml[0] - mx);
      den += w * ml[1];
      const float* pa = a.part_acc + ((int64_t)(p0 + p) * G + g) * D;
      for (int c = 0; c < NC; ++c) o[c] += loadf(pa + c * L) * w;
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    T* dst = a.out + a.q_start[seq] * a.o_tok + (kvh * G + g) * a.o_head;
    for (int c = 0; c < NC; ++c) store16(dst + c * L, o[c] * inv);
  }
}

struct Split { int32_t seq, kvh, p0, np; };

// Cut the step into items. Prefill chunks: tiles of query tokens. Decodes: one item per
// (sequence, KV head), or several key ranges when there are too few items to keep
// every thread busy (one long sequence decoding alone).
std::vector<Item> plan(const int32_t* ctx_lens, const int32_t* q_start, int num_seqs, int kv_heads, int group,
                       int threads, bool split_k, std::vector<Split>& splits, int& num_parts) {
  std::vector<Item> items;
  const int tile = std::max(1, MAX_ROWS / group);
  int64_t decode_keys = 0;
  int64_t n_items = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = q_start[s + 1] - q_start[s];
    if (q_len == 1) decode_keys += ctx_lens[s];
    n_items += (q_len + tile - 1) / tile;
  }
  n_items *= kv_heads;
  // Parts of at least 256 keys (merging costs more than it saves below that).
  int64_t part_len = std::numeric_limits<int32_t>::max();
  if (split_k && n_items < 4 * threads && decode_keys > 0)
    part_len = std::max<int64_t>(256, (decode_keys * kv_heads + 4 * threads - 1) / (4 * threads));
  num_parts = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = q_start[s + 1] - q_start[s];
    const int ctx = ctx_lens[s];
    if (q_len <= 0) continue;
    if (q_len == 1 && ctx > part_len) {
      const int np = int((ctx + part_len - 1) / part_len);
      const int step = ((ctx + np - 1) / np + L - 1) / L * L;  // whole tiles: parts start on a tile
      for (int h = 0; h < kv_heads; ++h) {
        splits.push_back({s, h, num_parts, np});
        for (int p = 0; p < np; ++p) {
          const int lo = p * step, hi = std::min(ctx, lo + step);
          items.push_back({s, h, 0, 1, lo, hi, num_parts++, int64_t(hi - lo) * group});
        }
      }
      continue;
    }
    for (int t0 = 0; t0 < q_len; t0 += tile) {
      const int t1 = std::min(q_len, t0 + tile);
      const int64_t keys = ctx - q_len + t1;
      for (int h = 0; h < kv_heads; ++h)
        items.push_back({s, h, t0, t1, 0, ctx, -1, keys * (t1 - t0) * group + keys});
    }
  }
  // Longest first: dynamic scheduling then ends with small items to even out the threads.
  std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

template <typename T, int NC>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& tables, const at::Tensor& ctx_lens, const at::Tensor& q_start, double scale, bool split_k) {
  const int num_seqs = int(ctx_lens.size(0));
  const int kv_heads = int(k_cache.size(1));
  const int group = int(q.size(1) / kv_heads);
  const int threads = at::get_num_threads();
  std::vector<Split> splits;
  int num_parts = 0;
  std::vector<Item> items = plan(ctx_lens.data_ptr<int32_t>(), q_start.data_ptr<int32_t>(), num_seqs, kv_heads,
                                 group, threads, split_k, splits, num_parts);
  std::vector<float> part_acc(size_t(num_parts) * group * NC * L), part_ml(size_t(num_parts) * group * 2);
  Args<T> a{q.data_ptr<T>(), q.stride(0), q.stride(1),
            out.data_ptr<T>(), out.stride(0), out.stride(1),
            k_cache.data_ptr<T>(), k_cache.stride(0), k_cache.stride(1),
            v_cache.data_ptr<T>(), v_cache.stride(0), v_cache.stride(1),
            tables.data_ptr<int32_t>(), tables.stride(0),
            ctx_lens.data_ptr<int32_t>(), q_start.data_ptr<int32_t>(),
            int(k_cache.size(3)), group, float(scale) * LOG2E,
            part_acc.data(), part_ml.data()};
  // Rows past the last sequence pad the step to a bucketed size (slot -1, no sequence):
  // give them zeros rather than whatever the allocator left there.
  const int64_t used = q_start.data_ptr<int32_t>()[num_seqs];
  for (int64_t r = used; r < out.size(0); ++r)
    for (int64_t h = 0; h < out.size(1); ++h) std::memset(out.data_ptr<T>() + r * out.stride(0) + h * out.stride(1), 0, sizeof(T) * out.size(2));
  const int64_t n = int64_t(items.size());
  if (threads <= 1 || n <= 1) {
    Scratch sc;
    for (const Item& it : items) run_item<T, NC>(it, a, sc);
    for (const Split& sp : splits) merge_parts<T, NC>(sp.seq, sp.kvh, sp.p0, sp.np, a);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) run_item<T, NC>(items[i], a, sc);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < int64_t(splits.size()); ++i)
      merge_parts<T, NC>(splits[i].seq, splits[i].kvh, splits[i].p0, splits[i].np, a);
  }
}

template <typename T>
void dispatch_dim(int64_t d, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& t, const at::Tensor& c, const at::Tensor& s, double scale,
                  bool split_k) {
  switch (d) {
    case 16: return run<T, 1>(out, q, k, v, t, c, s, scale, split_k);
    case 32: return run<T, 2>(out, q, k, v, t, c, s, scale, split_k);
    case 64: return run<T, 4>(out, q, k, v, t, c, s, scale, split_k);
    case 80: return run<T, 5>(out, q, k, v, t, c, s, scale, split_k);
    case 96: return run<T, 6>(out, q, k, v, t, c, s, scale, split_k);
    case 128: return run<T, 8>(out, q, k, v, t, c, s, scale, split_k);
    case 256: return run<T, 16>(out, q, k, v, t, c, s, scale, split_k);
  }
  TORCH_CHECK(false, "paged_attention: head_dim ", d, " is not supported (16, 32, 64, 80, 96, 128, 256 are)");
}

// Caches in the layout above: K [num_blocks, KVH, D / P, B, P], V [num_blocks, KVH, ceil(B / P), D, P].
void check_caches(const at::Tensor& k, const at::Tensor& v, int64_t d) {
  const int64_t P = k.element_size() == 2 ? 2 : 1;
  TORCH_CHECK(k.dim() == 5 && v.dim() == 5 && k.is_contiguous() && v.is_contiguous() &&
                  k.scalar_type() == v.scalar_type() && k.size(0) == v.size(0) && k.size(1) == v.size(1) &&
                  k.size(2) * P == d && k.size(4) == P && v.size(2) == (k.size(3) + P - 1) / P && v.size(3) == d &&
                  v.size(4) == P,
              "cpu attention: caches must be contiguous K [num_blocks, KVH, D/P, B, P] and "
              "V [num_blocks, KVH, ceil(B/P), D, P] (P = 2 for 16-bit types, 1 for fp32)");
}

// out/q [T, H, D]; caches as check_caches says; tables int32 [S, W]; ctx_lens int32 [S] (keys of each sequence after this step's
// tokens); q_start int32 [S + 1] (rows of each sequence's queries). split_k false: no
// decode is split across threads, so every row's result is independent of the batch.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& tables, const at::Tensor& ctx_lens, const at::Tensor& q_start, double scale,
                     bool split_k) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_attention: q and out must be [T, H, D] alike");
  check_caches(k_cache, v_cache, q.size(2));
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "paged_attention: q, out and caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: q and out must be contiguous in D");
  TORCH_CHECK(tables.scalar_type() == at::kInt && ctx_lens.scalar_type() == at::kInt &&
                  q_start.scalar_type() == at::kInt && tables.dim() == 2 && tables.stride(1) == 1 &&
                  ctx_lens.is_contiguous() && q_start.is_contiguous(),
              "paged_attention: tables, ctx_lens and q_start must be contiguous int32");
  TORCH_CHECK(q_start.size(0) == ctx_lens.size(0) + 1 && tables.size(0) >= ctx_lens.size(0),
              "paged_attention: q_start must have one more entry than ctx_lens, tables a row per sequence");
  // Tables come from the KV manager, but a bad one would read outside the pool: check.
  const int32_t* cl = ctx_lens.data_ptr<int32_t>();
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int64_t B = k_cache.size(3), W = tables.size(1), nb = k_cache.size(0);
  TORCH_CHECK(qs[0] == 0 && qs[ctx_lens.size(0)] <= q.size(0), "paged_attention: q_start out of range");
  for (int64_t s = 0; s < ctx_lens.size(0); ++s) {
    const int64_t q_len = qs[s + 1] - qs[s];
    TORCH_CHECK(q_len >= 0 && q_len <= cl[s] && cl[s] <= W * B, "paged_attention: sequence ", s, " has ", q_len,
                " queries and ", cl[s], " keys for a table of ", W, " blocks of ", B);
    const int32_t* row = tables.data_ptr<int32_t>() + s * tables.stride(0);
    for (int64_t j = 0; j < (cl[s] + B - 1) / B; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < nb, "paged_attention: block ", row[j], " is outside the pool of ", nb);
  }
  const int64_t d = q.size(2);
  switch (q.scalar_type()) {
    case at::kFloat: return dispatch_dim<float>(d, out, q, k_cache, v_cache, tables, ctx_lens, q_start, scale, split_k);
    case at::kBFloat16:
      return dispatch_dim<c10::BFloat16>(d, out, q, k_cache, v_cache, tables, ctx_lens, q_start, scale, split_k);
    case at::kHalf:
      return dispatch_dim<c10::Half>(d, out, q, k_cache, v_cache, tables, ctx_lens, q_start, scale, split_k);
    default: TORCH_CHECK(false, "paged_attention: dtype ", q.scalar_type(), " is not supported");
  }
}

template <typename T>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& slots) {
  constexpr int64_t P = PAIR<T>;
  const int64_t n = k.size(0), kvh = k.size(1), d = k.size(2), B = k_cache.size(3);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const T *ks = k.data_ptr<T>(), *vs = v.data_ptr<T>();
  T *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
  const int64_t num_slots = k_cache.size(0) * B;
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sl[i] < num_slots, "write_kv: slot ", sl[i], " is outside the pool of ", num_slots);
  at::parallel_for(0, n, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t slot = sl[i];
      if (slot < 0) continue;  // padding row
      const int64_t blk = slot / B, pos = slot % B;
      for (int64_t h = 0; h < kvh; ++h) {
        const T* kr = ks + i * k.stride(0) + h * k.stride(1);
        const T* vr = vs + i * v.stride(0) + h * v.stride(1);
        T* kd = kc + k_cache.stride(0) * blk + k_cache.stride(1) * h + pos * P;
        T* vd = vc + v_cache.stride(0) * blk + v_cache.stride(1) * h + (pos / P) * d * P + pos % P;
        for (int64_t j = 0; j < d; ++j) {
          kd[(j / P) * B * P + j % P] = kr[j];
          vd[j * P] = vr[j];
        }
      }
    }
  });
}

// New tokens' K/V into their slots (slot -1: skip). k/v [T, KVH, D].
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  check_caches(k_cache, v_cache, k.size(2));
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) && k.stride(2) == 1 &&
                  v.stride(2) == 1 && k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == k_cache.scalar_type(),
              "write_kv: k and v must be [T, KVH, D] in the caches' dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0) &&
                  slots.is_contiguous(),
              "write_kv: slots must be int64 [T]");
  switch (k.scalar_type()) {
    case at::kFloat: return write_kv_impl<float>(k, v, k_cache, v_cache, slots);
    case at::kBFloat16: return write_kv_impl<c10::BFloat16>(k, v, k_cache, v_cache, slots);
    case at::kHalf: return write_kv_impl<c10::Half>(k, v, k_cache, v_cache, slots);
    default: TORCH_CHECK(false, "write_kv: dtype ", k.scalar_type(), " is not supported");
  }
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
        "Tensor ctx_lens, Tensor q_start, float scale, bool split_k=True) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("paged_attention", &pagedllm::paged_attention);
  m.impl("write_kv", &pagedllm::write_kv);
}
