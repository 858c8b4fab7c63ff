// Sampling from logits rows: temperature, top-k, top-p, drawn by the Gumbel-max race.
//
// A row's token is argmax_i (s_i + G_i) over the allowed tokens, s_i = (x_i - max) / T and
// G_i = -log(-log u_i) with u_i from a counter-based hash of (the row's seed, i): exactly
// a draw from softmax(s) restricted to the allowed set. Why a race and not one uniform
// against the cumulative sum: a tiny change in the logits (another batch, a cached
// prefix, the other attention path) moves every boundary of the cumulative sum and so
// flipped ~1 % of draws in a test; the race flips only on a near tie of the two best keys. And why
// a hash: torch's per-generator exponential_ costs 1.2 ms a row of 49k on this CPU,
// the hash and two vector logs ~0.1 ms.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace pagedllm {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// run(T{}) for the logits' float type.
template <typename F>
void by_dtype(const at::Tensor& logits, const char* op, F run) {
  switch (logits.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": dtype ", logits.scalar_type(), " is not supported");
  }
}

// The draws run in the CPU's own width (vec.h's vn, LN lanes): each lane's value depends on its
// index alone, so a draw is the same whatever the width.
// lowbias32 (Wellons): a well-mixed 32-bit hash, in vector lanes.
inline vnu mix(vnu x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Uniforms in (0, 1) for indices i..i+LN-1 of the stream `key`.
inline vn uniforms(uint64_t key, int64_t i) {
  const vnu idx = (vnu)(IOTAN + int32_t(i));
  vnu h = mix(idx * 0x9E3779B1u + uint32_t(key));
  h = mix(h ^ uint32_t(key >> 32));
  return (__builtin_convertvector(h >> 8, vn) + 0.5f) * (1.f / 16777216.f);
}

inline vn gumbel(uint64_t key, int64_t i) { return -logn(-logn(uniforms(key, i))); }

// Tokens by score buckets, BINS of them over [-range, 0]; everything lower shares the last one.
// One pass finds which bucket a top-k or top-p bound falls in; only that bucket's tokens are then
// searched. The range is the row's own (down to its lowest finite score, at most SPAN): a client's
// high temperature squeezes every score s = (x - max) / T near 0, and buckets of a fixed width then
// held the whole vocabulary in one. The width is a power of two, so that bucket edges are exact.
constexpr int BINS = 512;
constexpr float SPAN = 32.f;  // below -SPAN a weight exp(s) is < 1e-13 of the top token's

struct Buckets {
  float scale = BINS / SPAN;  // buckets per unit of s

  explicit Buckets(float lowest) {  // the row's lowest finite s (<= 0)
    int e;
    std::frexp(std::max(-lowest, 1e-30f), &e);  // -lowest < 2^e
    scale = std::ldexp(1.f, std::clamp(9 - e, 4, 100));  // BINS = 2^9; at least BINS / SPAN
  }
  int of(float v) const {
    const float b = -v * scale;
    return b < BINS - 1 ? int(b) : BINS - 1;  // -inf, very low scores and NaN: the last bucket
  }
  float top(int b) const { return -float(b) / scale; }  // of(v) < b exactly when v > top(b)
};

// Tokens best first: s descending, then index ascending (a strict total order on the tokens).
struct BestFirst {
  const float* s;
  bool operator()(int32_t a, int32_t c) const { return s[a] > s[c] || (s[a] == s[c] && a < c); }
};

// The tokens of bucket b but NaNs (never drawn; they would break the order), in index order.
inline void bucket_members(const std::vector<float>& s, int64_t V, const Buckets& bk, int b,
                           std::vector<int32_t>& idx) {
  idx.clear();
  for (int64_t i = 0; i < V; ++i)
    if (bk.of(s[i]) == b && s[i] == s[i]) idx.push_back(int32_t(i));
}

// Whether idx's tokens all have one score: a temperature near float's top (a client's) rounds
// every s to 0, and a selection among ties is its slowest case.
inline bool tied(const std::vector<float>& s, const std::vector<int32_t>& idx) {
  for (const int32_t i : idx)
    if (s[i] != s[idx[0]]) return false;
  return true;
}

// Where acc plus the weight of idx's best tokens first reaches goal: the position j (the last one if
// it never does), with idx[0..j] rearranged to hold the j + 1 best, idx[j] the worst of them.
// Selection, not a sort: expected linear time. A high temperature puts every score in one bucket
// (s = (x - max) / T near 0), and sorting it cost ~4-6 ms a row of 49k, paid by every request in
// the step; a client sets its own temperature.
inline size_t mass_select(const std::vector<float>& s, const std::vector<float>& w, std::vector<int32_t>& idx,
                          double acc, double goal) {
  if (tied(s, idx)) {  // best first is index order, idx's own
    size_t j = 0;
    while (j + 1 < idx.size() && (acc += w[idx[j]]) < goal) ++j;
    return j;
  }
  const BestFirst better{s.data()};
  size_t lo = 0, hi = idx.size();  // the answer lies in [lo, hi); acc holds the weight of idx[0..lo)
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    std::nth_element(idx.begin() + lo, idx.begin() + mid, idx.begin() + hi, better);
    double upto = acc;
    for (size_t t = lo; t < mid; ++t) upto += w[idx[t]];
    if (upto >= goal) {
      hi = mid;
      continue;
    }
    upto += w[idx[mid]];
    if (upto >= goal) return mid;
    acc = upto;
    lo = mid + 1;
  }
  return lo < hi ? lo : hi - 1;  // lo == hi: [lo, hi) emptied past the last token, which is the answer
}

// Top-k and top-p as two bounds on the best-first order of the tokens: s >= cut (the k-th best
// score), and best first up to the token (top_s, top_i) (the nucleus's last). Only the bucket
// where a bound falls is searched, by selection: every bucket above it lies wholly inside. Sorting
// the whole nucleus cost ~4 ms a row of 49k flat logits (a logit_bias can flatten a row), paid by
// the step of every request in the batch.
struct Bounds {
  float cut = NEG_INF;
  float top_s = NEG_INF;
  int64_t top_i = std::numeric_limits<int32_t>::max();
  bool empty = false;   // nothing finite to draw from
  bool listed = false;  // the nucleus is small and `kept` lists it: the race runs over it alone
};

inline Bounds bounds(const std::vector<float>& s, std::vector<float>& w, int64_t V, int64_t top_k, float top_p,
                     std::vector<int32_t>& idx, std::vector<int32_t>& kept) {
  Bounds bd;
  vn low = splatn(0.f);  // the lowest finite s
  for (int64_t i = 0; i < V; i += LN) {
    const vn v = loadn(s.data() + i);
    storen(w.data() + i, expn(v));
    low = (v < low) & (v > splatn(NEG_INF)) & (IOTAN + int32_t(i) < int32_t(V)) ? v : low;
  }
  float lowest = 0.f;
  for (int j = 0; j < LN; ++j) lowest = std::min(lowest, low[j]);
  const Buckets bk(lowest);
  int64_t count[BINS] = {};
  double mass[BINS] = {};
  for (int64_t i = 0; i < V; ++i) {
    const int b = bk.of(s[i]);
    count[b] += 1;
    mass[b] += w[i];
  }
  if (top_k > 0 && top_k < V) {  // the k-th best sits in the first bucket where the count reaches k
    int last = 0;
    int64_t before = 0;
    for (; last < BINS - 1 && before + count[last] < top_k; ++last) before += count[last];
    bucket_members(s, V, bk, last, idx);
    if (before + int64_t(idx.size()) >= top_k) {  // a selection, not a sort: see mass_select
      const auto kth = idx.begin() + (top_k - before - 1);
      if (!tied(s, idx)) std::nth_element(idx.begin(), kth, idx.end(), BestFirst{s.data()});
      bd.cut = s[*kth];
    }
  }
  if (top_p < 1.f) {  // the nucleus: fewest best tokens holding top_p of the (top-k) mass
    double z = 0;
    for (int64_t i = 0; i < V; ++i) z += s[i] >= bd.cut ? w[i] : 0.f;
    const double goal = double(top_p) * z;
    int last = 0;
    int64_t upto = 0;  // tokens in buckets up to `last`: at least the nucleus
    for (double acc = 0; last < BINS - 1 && (acc += mass[last]) < goal; ++last) upto += count[last];
    bd.listed = upto + count[last] <= V / 16;  // a race over a list costs a vector of noise a token
    double acc = 0;  // the buckets before `last`, all in the nucleus; then bucket `last`, best first
    kept.clear();
    idx.clear();
    for (int64_t i = 0; i < V; ++i) {
      if (!(s[i] >= bd.cut)) continue;
      const int b = bk.of(s[i]);
      if (b < last) {
        acc += w[i];
        if (bd.listed) kept.push_back(int32_t(i));
      } else if (b == last) {
        idx.push_back(int32_t(i));
      }
    }
    if (idx.empty()) {  // bucket `last` holds nothing allowed: the nucleus is the buckets before it
      bd.empty = acc == 0;  // (a token before `last` has s >= -SPAN: its weight is above 0)
      bd.top_s = bk.top(last);
      bd.top_i = -1;
    } else {
      const size_t j = mass_select(s, w, idx, acc, goal);
      bd.top_s = s[idx[j]];
      bd.top_i = idx[j];
      if (bd.listed) kept.insert(kept.end(), idx.begin(), idx.begin() + j + 1);
    }
  }
  return bd;
}

// The race among the allowed tokens: s >= cut, and (NUCLEUS) at or before (top_s, top_i) best
// first. Ties of two keys go to the lower index, as in the race over a list.
template <bool NUCLEUS>
int64_t race(const std::vector<float>& s, int64_t V, uint64_t key, const Bounds& bd) {
  const vn cut = splatn(bd.cut), top_s = splatn(bd.top_s);
  vn best_key = splatn(NEG_INF);
  vni best{};
  for (int64_t i = 0; i < V; i += LN) {
    vn sv = loadn(s.data() + i);
    const vni lane = IOTAN + int32_t(i);
    vni in = (lane < int32_t(V)) & (sv >= cut);
    if constexpr (NUCLEUS) in &= (sv > top_s) | ((sv == top_s) & (lane <= int32_t(bd.top_i)));
    sv = in ? sv + gumbel(key, i) : splatn(NEG_INF);
    const vni take = sv > best_key;
    best_key = take ? sv : best_key;
    best = take ? lane : best;
  }
  float bk = NEG_INF;
  int64_t bt = 0;
  for (int j = 0; j < LN; ++j)
    if (best_key[j] > bk || (best_key[j] == bk && best[j] < bt)) bk = best_key[j], bt = best[j];
  return bt;
}

template <typename T>
int64_t sample_row(const T* x, int64_t V, float temp, int64_t top_k, float top_p, uint64_t key,
                   std::vector<float>& s, std::vector<float>& w, std::vector<int32_t>& idx,
                   std::vector<int32_t>& kept) {
  s.resize(V + L);
  w.resize(V + L);
  const int64_t body = V / LN * LN;
  vn mv = splatn(NEG_INF);
  for (int64_t i = 0; i < body; i += LN) {
    const vn v = loadn(x + i);
    mv = mv > v ? mv : v;
  }
  float mx = hmaxn(mv);
  for (int64_t i = body; i < V; ++i) mx = std::max(mx, float(x[i]));
  // A temperature below float32's range would divide by zero: tiny ones act as greedy. One near
  // its top (a client's: any finite temperature is valid) made every s subnormal, and arithmetic on
  // subnormals is ~10x slower here; past 1e20 every weight exp(s) is 1 in float already.
  const float inv_t = 1.f / std::clamp(temp, 1e-30f, 1e20f);
  for (int64_t i = 0; i < body; i += LN) storen(s.data() + i, (loadn(x + i) - mx) * inv_t);
  for (int64_t i = body; i < V; ++i) s[i] = (float(x[i]) - mx) * inv_t;  // <= 0, the top token at 0
  // Logits a processor pushed to +inf (a repetition penalty near 0 divides by it) give
  // inf - inf = NaN: the +inf tokens share the top, the others are out. (A NaN logit
  // beside a finite max stays NaN: no bucket, cut or race ever takes it.)
  if (!std::isfinite(mx))
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(s[i])) s[i] = float(x[i]) == mx ? 0.f : NEG_INF;
  const Bounds bd = (top_k > 0 && top_k < V) || top_p < 1.f ? bounds(s, w, V, top_k, top_p, idx, kept) : Bounds{};
  if (bd.empty) return 0;
  if (bd.listed) {  // ties of two keys go to the lower index, as in race()
    int64_t bt = kept.empty() ? 0 : kept[0];
    float bk = NEG_INF;
    for (const int32_t t : kept) {
      const float key_t = s[t] + gumbel(key, t & ~int64_t(LN - 1))[t & (LN - 1)];
      if (key_t > bk || (key_t == bk && t < bt)) bk = key_t, bt = t;
    }
    return bt;
  }
  return top_p < 1.f ? race<true>(s, V, key, bd) : race<false>(s, V, key, bd);
}

// logits [R, V]; temperature f32, top_k int64 (0: off), top_p f32, seeds int64: [R] each.
at::Tensor sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                  const at::Tensor& top_p, const at::Tensor& seeds) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "sample: logits must be contiguous [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  top_k.scalar_type() == at::kLong && seeds.scalar_type() == at::kLong && temperature.numel() == R &&
                  top_p.numel() == R && top_k.numel() == R && seeds.numel() == R && temperature.is_contiguous() &&
                  top_p.is_contiguous() && top_k.is_contiguous() && seeds.is_contiguous(),
              "sample: temperature/top_p float32, top_k/seeds int64, one per row, contiguous");
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float *t = temperature.data_ptr<float>(), *p = top_p.data_ptr<float>();
  const int64_t *k = top_k.data_ptr<int64_t>(), *sd = seeds.data_ptr<int64_t>();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* x = logits.data_ptr<T>();
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
      std::vector<float> s, w;
      std::vector<int32_t> idx, kept;
      for (int64_t r = b; r < e; ++r)
        o[r] = sample_row(x + r * V, V, t[r], k[r], p[r], uint64_t(sd[r]), s, w, idx, kept);
    });
  };
  by_dtype(logits, "sample", run);
  return out;
}

// The first index of a row's largest value, as torch.max(dim=-1).indices gives it (a NaN counts
// as the largest: the first NaN wins). Two passes: the maximum in vector lanes, then its first
// index. torch's reduction took 7 ms for 32 rows of Gemma 3's 262k logits here, ~9 % of a step.
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  vn m = splatn(NEG_INF);  // the CPU's own width (vec.h): a sweep of single values
  vni nan{};
  int64_t i = 0;
  for (; i + LN <= V; i += LN) {
    const vn v = loadn(x + i);
    nan |= (v != v);
    m = v > m ? v : m;
  }
  float best = hmaxn(m);
  bool any_nan = false;
  for (int j = 0; j < LN; ++j) any_nan |= nan[j] != 0;
  for (int64_t t = i; t < V; ++t) {
    const float v = float(x[t]);
    any_nan |= v != v;
    best = v > best ? v : best;
  }
  for (int64_t t = 0; t < V; ++t) {
    const float v = float(x[t]);
    if (any_nan ? v != v : v == best) return t;
  }
  return 0;  // a row of -inf only: index 0, as torch
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: logits must be contiguous [R, V], V > 0");
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* x = logits.data_ptr<T>();
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) o[r] = argmax_row(x + r * V, V);
    });
  };
  by_dtype(logits, "argmax_rows", run);
  return out;
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seeds) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("sample", &pagedllm::sample);
  m.impl("argmax_rows", &pagedllm::argmax_rows);
}
