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

// Tokens by score buckets: 1 / BIN_W buckets per unit of s over [-SPAN, 0]; everything
// lower shares the last bucket. One pass finds which bucket a top-k or top-p cut falls
// in; only the tokens above it are then sorted.
constexpr int BINS = 512;
constexpr float SPAN = 32.f;

inline int bin_of(float v) {
  const float b = -v * (BINS / SPAN);
  return b < BINS - 1 ? int(b) : BINS - 1;  // -inf, very low scores and NaN: the last bucket
}

// Indices of the tokens with s >= cut whose bucket is at most `last`, best first.
inline void best_first(const std::vector<float>& s, int64_t V, float cut, int last, std::vector<int32_t>& idx) {
  idx.clear();
  for (int64_t i = 0; i < V; ++i)
    if (s[i] >= cut && bin_of(s[i]) <= last) idx.push_back(int32_t(i));
  std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
}

template <typename T>
int64_t sample_row(const T* x, int64_t V, float temp, int64_t top_k, float top_p, uint64_t key,
                   std::vector<float>& s, std::vector<float>& w, std::vector<int32_t>& idx) {
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
  // A temperature below float32's range would divide by zero: tiny ones act as greedy.
  const float inv_t = 1.f / std::max(temp, 1e-30f);
  for (int64_t i = 0; i < body; i += LN) storen(s.data() + i, (loadn(x + i) - mx) * inv_t);
  for (int64_t i = body; i < V; ++i) s[i] = (float(x[i]) - mx) * inv_t;  // <= 0, the top token at 0
  // Logits a processor pushed to +inf (a repetition penalty near 0 divides by it) give
  // inf - inf = NaN: the +inf tokens share the top, the others are out. (A NaN logit
  // beside a finite max stays NaN: no bucket, cut or race ever takes it.)
  if (!std::isfinite(mx))
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(s[i])) s[i] = float(x[i]) == mx ? 0.f : NEG_INF;
  float cut = NEG_INF;  // tokens below it are out
  const bool use_k = top_k > 0 && top_k < V, use_p = top_p < 1.f;
  if (use_k || use_p) {
    for (int64_t i = 0; i < V; i += LN) storen(w.data() + i, expn(loadn(s.data() + i)));
    float count[BINS] = {}, mass[BINS] = {};
    for (int64_t i = 0; i < V; ++i) {
      const int b = bin_of(s[i]);
      count[b] += 1.f;
      mass[b] += w[i];
    }
    if (use_k) {  // the k-th best sits in the first bucket where the count reaches k
      int last = 0;
      for (float c = 0.f; last < BINS && (c += count[last]) < float(top_k); ++last) {}
      best_first(s, V, NEG_INF, std::min(last, BINS - 1), idx);
      cut = int64_t(idx.size()) >= top_k ? s[idx[top_k - 1]] : NEG_INF;
    }
    if (use_p) {  // the nucleus: fewest best tokens holding top_p of the (top-k) mass
      float z = 0.f;
      for (int64_t i = 0; i < V; ++i) z += s[i] >= cut ? w[i] : 0.f;
      int last = 0;
      for (float acc = 0.f; last < BINS - 1 && (acc += mass[last]) < top_p * z; ++last) {}
      best_first(s, V, cut, last, idx);
      if (idx.empty()) return 0;  // nothing finite to draw from (every logit -inf or NaN)
      double acc = 0;
      int64_t keep = int64_t(idx.size());
      for (size_t j = 0; j < idx.size(); ++j)
        if ((acc += w[idx[j]]) >= double(top_p) * z) { keep = int64_t(j) + 1; break; }
      int64_t best = idx[0];
      float best_key = NEG_INF;
      for (int64_t j = 0; j < keep; ++j) {  // race among the nucleus only
        const int64_t t = idx[j];
        const float g = gumbel(key, t & ~int64_t(LN - 1))[t & (LN - 1)];
        if (s[t] + g > best_key) { best_key = s[t] + g; best = t; }
      }
      return best;
    }
  }
  vn best_key = splatn(NEG_INF);
  vni best{};
  for (int64_t i = 0; i < V; i += LN) {
    vn sv = loadn(s.data() + i);
    const vni lane = IOTAN + int32_t(i);
    sv = (lane < int32_t(V)) & (sv >= cut) ? sv + gumbel(key, i) : splatn(NEG_INF);
    const vni take = sv > best_key;
    best_key = take ? sv : best_key;
    best = take ? lane : best;
  }
  float bk = NEG_INF;
  int64_t bt = 0;
  for (int j = 0; j < LN; ++j)
    if (best_key[j] > bk) { bk = best_key[j]; bt = best[j]; }
  return bt;
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
      std::vector<int32_t> idx;
      for (int64_t r = b; r < e; ++r) o[r] = sample_row(x + r * V, V, t[r], k[r], p[r], uint64_t(sd[r]), s, w, idx);
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
