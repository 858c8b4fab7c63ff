// Multi-head latent attention's decode (models/mla.py, DeepSeek-V2/V3): each sequence's query row
// of every head attends to the one latent head of its blocks, rows [c, k_pe] of D values, a key's
// value its first V of them. All heads share every key, so a tile of TJ keys is widened to fp32
// once into a scratch tile and every head of the work item scores it (Q.K over D values) and adds
// it into its accumulator (P.V over V values), with an online softmax: the keys are read from the
// pool once a step, in place. (The torch path gathered each sequence's blocks into a copy and ran
// two batched matmuls around a masked softmax: ~10 % of a DeepSeek-V3-shaped decode step.)
//
// A head's sums run in the same order whichever heads share its work item, so a row's result does
// not depend on the batch beside it (batch-invariant mode needs nothing of its own here).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "vec.h"

namespace pagedllm {
namespace {

constexpr int TJ = 16;  // keys scored at once: one vector of scores a head
constexpr float LOG2E = 1.4426950408889634f;
constexpr int64_t kMaxHeads = 256;   // heads of one work item

struct LatentShape {
  int64_t d, v, bs;                    // key width, value width (a key's first v values), block size
  int64_t block_stride, row_stride;    // of the pool, in elements
  int64_t q_seq, q_head, o_seq, o_head;  // strides of q [n, H, D] and out [n, H, V]
};

// acc[h .. h + 3][c .. c + NU L) = alpha acc + sum_j p[h][j] key_j[c ..]: 4 heads x NU vectors of
// values in registers, each key vector loaded once for the 4 heads.
template <int NU>
inline void add_values(float* acc, const float* p, const float* kf, const float* alpha, int64_t h, int64_t hh,
                       int64_t c, int64_t nj, int64_t d, int64_t v) {
  const int64_t nh = std::min<int64_t>(4, hh - h);
  vf a[4][NU];
  for (int64_t i = 0; i < 4; ++i)
    for (int u = 0; u < NU; ++u) a[i][u] = i < nh ? loadf(acc + (h + i) * v + c + u * L) * alpha[h + i] : vf{};
  for (int64_t j = 0; j < nj; ++j) {
    vf k[NU];
    for (int u = 0; u < NU; ++u) k[u] = loadf(kf + j * d + c + u * L);
    for (int64_t i = 0; i < 4; ++i) {
      const float w = p[std::min(h + i, hh - 1) * TJ + j];
      for (int u = 0; u < NU; ++u) a[i][u] += w * k[u];
    }
  }
  for (int64_t i = 0; i < nh; ++i)
    for (int u = 0; u < NU; ++u) storef(acc + (h + i) * v + c + u * L, a[i][u]);
}

// Sequence `s`'s heads h0 .. h1 - 1 over its `len` keys, through its block table row.
template <class T>
void decode_heads(T* out, const T* q, const T* cache, const int32_t* table, int64_t len, int64_t h0, int64_t h1,
                  float scale, const LatentShape& sh, std::vector<float>& scratch) {
  const int64_t hh = h1 - h0, d = sh.d, v = sh.v;
  scratch.assign(hh * d + hh * v + TJ * d + 2 * hh + hh * TJ, 0.f);
  float* qf = scratch.data();    // [hh, d] queries, scaled for exp2
  float* acc = qf + hh * d;      // [hh, v] running sums of p . value
  float* kf = acc + hh * v;      // [TJ, d] the tile's keys in fp32
  float* m = kf + TJ * d;        // [hh] running maxima (log2 domain)
  float* l = m + hh;             // [hh] running sums of p
  for (int64_t h = 0; h < hh; ++h) {
    const T* qr = q + (h0 + h) * sh.q_head;
    for (int64_t c = 0; c < d; c += L) storef(qf + h * d + c, load16(qr + c) * (scale * LOG2E));
    m[h] = -std::numeric_limits<float>::infinity();
  }
  float* s = l + hh;             // [hh, TJ] the tile's scores, then weights
  for (int64_t p0 = 0; p0 < len; p0 += TJ) {
    const int64_t nj = std::min<int64_t>(TJ, len - p0);
    for (int64_t j = 0; j < nj; ++j) {
      const int64_t p = p0 + j;
      const T* row = cache + int64_t(table[p / sh.bs]) * sh.block_stride + (p % sh.bs) * sh.row_stride;
      for (int64_t c = 0; c < d; c += L) storef(kf + j * d + c, load16(row + c));
    }
    for (int64_t j = nj; j < TJ; ++j) std::fill(kf + j * d, kf + (j + 1) * d, 0.f);   // scored, then masked
    // Scores of 4 heads x 4 keys at a time: 16 sums in registers, each vector of q and k loaded once.
    for (int64_t h = 0; h < hh; h += 4) {
      const int64_t nh = std::min<int64_t>(4, hh - h);
      for (int64_t j = 0; j < TJ; j += 4) {
        vf a[4][4] = {};
        for (int64_t c = 0; c < d; c += L) {
          const vf k0 = loadf(kf + j * d + c), k1 = loadf(kf + (j + 1) * d + c), k2 = loadf(kf + (j + 2) * d + c),
                   k3 = loadf(kf + (j + 3) * d + c);
          for (int64_t i = 0; i < 4; ++i) {
            const vf x = loadf(qf + std::min(h + i, hh - 1) * d + c);
            a[i][0] += x * k0, a[i][1] += x * k1, a[i][2] += x * k2, a[i][3] += x * k3;
          }
        }
        for (int64_t i = 0; i < nh; ++i) hsum4(a[i][0], a[i][1], a[i][2], a[i][3], s + (h + i) * TJ + j);
      }
    }
    // The online softmax of each head over the tile, then P.V for 4 heads x 64 values at a time.
    float alpha[kMaxHeads];
    for (int64_t h = 0; h < hh; ++h) {
      vf sv = loadf(s + h * TJ);
      sv = IOTA < int32_t(nj) ? sv : splat(-std::numeric_limits<float>::infinity());
      const float mnew = std::max(m[h], hmax(sv));
      alpha[h] = std::exp2(m[h] - mnew);   // 0 on the first tile (m = -inf)
      const vf pv = exp2v(sv - mnew);      // masked keys: exp2(-inf) = 0
      l[h] = l[h] * alpha[h] + hsum(pv);
      m[h] = mnew;
      storef(s + h * TJ, pv);
    }
    for (int64_t h = 0; h < hh; h += 4) {
      int64_t c = 0;
      for (; c + 4 * L <= v; c += 4 * L) add_values<4>(acc, s, kf, alpha, h, hh, c, nj, d, v);
      for (; c < v; c += L) add_values<1>(acc, s, kf, alpha, h, hh, c, nj, d, v);
    }
  }
  for (int64_t h = 0; h < hh; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    T* o = out + (h0 + h) * sh.o_head;
    for (int64_t c = 0; c < v; c += L) store16(o + c, loadf(acc + h * v + c) * inv);
  }
}

}  // namespace

// out [n, H, V] = attention of q [n, H, D] (one query row a sequence: a decode) over the keys
// 0 .. lens[s] - 1 of sequence s, rows of the pool cache [blocks, B, 1, D] (q's dtype) found
// through tables [n, W] int32; a key's value is its first V values; scale multiplies q.k.
void latent_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                   const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "latent_decode: q [n, H, D], rows contiguous");
  TORCH_CHECK(cache.dim() == 4 && cache.size(2) == 1 && cache.is_contiguous() && cache.scalar_type() == q.scalar_type(),
              "latent_decode: cache [blocks, B, 1, D] contiguous, in q's dtype");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.size(0) == q.size(0) && out.size(1) == q.size(1) &&
                  out.scalar_type() == q.scalar_type(),
              "latent_decode: out [n, H, V] in q's dtype, rows contiguous");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), v = out.size(2);
  TORCH_CHECK(cache.size(3) == d && v <= d, "latent_decode: the pool's rows must be q's D values, V <= D");
  TORCH_CHECK(d % L == 0 && v % L == 0, "latent_decode: D and V must be multiples of ", L, ", got ", d, " and ", v);
  TORCH_CHECK(q.size(1) <= kMaxHeads, "latent_decode: at most ", kMaxHeads, " heads, got ", q.size(1));
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && tables.scalar_type() == at::kInt && tables.is_contiguous(),
              "latent_decode: tables int32 [n, W] contiguous");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == n && lens.scalar_type() == at::kInt && lens.is_contiguous(),
              "latent_decode: lens int32 [n]");
  const int32_t* len = lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < n; ++s)
    TORCH_CHECK(len[s] >= 1 && len[s] <= tables.size(1) * cache.size(1),
                "latent_decode: sequence ", s, " has ", len[s], " keys, its table ", tables.size(1), " blocks");
  const LatentShape sh{d, v, cache.size(1), cache.stride(0), cache.stride(1), q.stride(0), q.stride(1),
                       out.stride(0), out.stride(1)};
  // Work items: a sequence's heads, split into groups only when the sequences are fewer than the
  // threads (a lone decode still uses every core; a group re-reads the keys from cache).
  const int64_t threads = at::get_num_threads();
  const int64_t groups = n >= threads ? 1 : std::min<int64_t>(heads, (threads + n - 1) / n);
  const int64_t per = (heads + groups - 1) / groups;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    T* o = static_cast<T*>(out.data_ptr());
    const T* qp = static_cast<const T*>(q.data_ptr());
    const T* kp = static_cast<const T*>(cache.data_ptr());
    const int32_t* tp = tables.data_ptr<int32_t>();
    const int64_t w = tables.size(1);
    at::parallel_for(0, n * groups, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> scratch;
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t s = item / groups, h0 = (item % groups) * per, h1 = std::min(heads, h0 + per);
        if (h0 < h1)
          decode_heads(o + s * sh.o_seq, qp + s * sh.q_seq, kp, tp + s * w, len[s], h0, h1, float(scale), sh, scratch);
      }
    });
  };
  if (q.scalar_type() == at::kBFloat16)
    run(c10::BFloat16());
  else if (q.scalar_type() == at::kFloat)
    run(float());
  else if (q.scalar_type() == at::kHalf)
    run(c10::Half());
  else
    TORCH_CHECK(false, "latent_decode: q must be bfloat16, float16 or float32");
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("latent_decode(Tensor(a!) out, Tensor q, Tensor cache, Tensor tables, Tensor lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("latent_decode", &pagedllm::latent_decode); }
