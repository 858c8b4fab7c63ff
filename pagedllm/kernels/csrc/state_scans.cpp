// The recurrences of the layers that keep a state in the KV pool, over a step's rows token by token,
// each (chunk, head)'s state in float32 kept in cache while its rows run. A chunk's state is read
// from its block in the pool (zero where the chunk starts the sequence); after each row that ends a
// block or the chunk it is written into that row's block, and the chunk goes on from the state as
// stored (rounded to the pool's dtype): a later chunk that restarts from it computes the same
// numbers (a prefix hit, a recompute). Chunks and heads are spread over the threads.
//
// delta_rule: the gated delta rule of Qwen3-Next's DeltaNet layers (models/gated_deltanet.py), each (chunk, value head)'s state [Dk, Dv] in float32 kept in L2 while its
// rows run: per row, one pass over S for both of its products and one to update it,
//
//   S^T q, S^T k;  delta = beta (v - e^g S^T k);  o = e^g S^T q + (q . k) delta;  S = e^g S + k delta^T
//
// (the decay folded into what reads S). The torch forms (a decode's batched matmuls, a prefill's
// chunked WY form) wrote ~25 passes over [rows, heads, 128] float32 tensors a layer; this reads
// each state once a row while it sits in cache.
//
// mamba_scan: Mamba-2's selective scan (models/mamba2.py), a state [P, N] a head, one pass a row:
//
//   dt = clamp(softplus(dt + dt_bias));  S = e^(dt A) S + (dt u) B^T;  y = S C + D u
//
// (B and C those of the head's group), its inputs read in place from the step's convolution and
// in_proj outputs: the ten torch passes that made them contiguous float32 and added D u took a
// decode step of Granite's kind as long as the scan itself. A chunk of SSD_MIN rows or more (a
// prefill's) runs in Mamba-2's chunked form instead, on small matrix products (below).
//
// Both spread (head, chunk) pairs over the threads head-major: each thread takes whole heads over
// every chunk, so a step's work splits evenly however its chunks' lengths fall.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace pagedllm {
namespace {

constexpr int MAX_DV = 256;   // value dims a head: accumulators of S^T q and S^T k in registers

template <class T>
void load_state(std::vector<float>& s, const T* src, bool fresh) {
  if (fresh)
    std::fill(s.begin(), s.end(), 0.f);
  else
    for (size_t i = 0; i < s.size(); ++i) s[i] = float(src[i]);
}

template <class T>
void store_state(std::vector<float>& s, T* dst) {   // and go on from it as stored
  for (size_t i = 0; i < s.size(); ++i) {
    dst[i] = T(s[i]);
    s[i] = float(dst[i]);
  }
}

// A row's q and k of one key head, as the rule reads them: L2-normed (q then scaled) when asked.
struct RowQK {
  std::vector<float> q, k;
  float qk = 0.f;
  void load(const float* qr, const float* kr, int64_t dk, bool l2norm, float q_scale) {
    if (dk % L == 0) {   // 16 at a time: this runs once a row and head, beside two passes over S
      vf nq{}, nk{};
      for (int64_t i = 0; i < dk; i += L) {
        const vf a = loadf(qr + i), b = loadf(kr + i);
        nq += a * a;
        nk += b * b;
      }
      const float sq = l2norm ? q_scale / std::sqrt(hsum(nq) + 1e-6f) : 1.f;
      const float sk = l2norm ? 1.f / std::sqrt(hsum(nk) + 1e-6f) : 1.f;
      vf dot{};
      for (int64_t i = 0; i < dk; i += L) {
        const vf a = loadf(qr + i) * sq, b = loadf(kr + i) * sk;
        storef(q.data() + i, a);
        storef(k.data() + i, b);
        dot += a * b;
      }
      qk = hsum(dot);
      return;
    }
    float nq = 0.f, nk = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      nq += qr[i] * qr[i];
      nk += kr[i] * kr[i];
    }
    const float sq = l2norm ? q_scale / std::sqrt(nq + 1e-6f) : 1.f, sk = l2norm ? 1.f / std::sqrt(nk + 1e-6f) : 1.f;
    qk = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      q[i] = qr[i] * sq;
      k[i] = kr[i] * sk;
      qk += q[i] * k[i];
    }
  }
};

// The layout of a step's rows: q and k [T, Hk, Dk], v [T, H, Dv] (rows any stride apart), beta
// and g [T, H], o [T, H, Dv]; value head h reads key head h / (H / Hk).
struct Rows {
  const float *q, *k, *v, *beta, *g;
  float* o;
  int64_t ld_q, ld_k, ld_v, heads, per, dk, dv;
  bool l2norm;
  float q_scale;
};

// A row's output from S^T q and S^T k: delta = beta (v - e^g S^T k), o = e^g S^T q + (q . k) delta.
inline void finish_row(const vf* sq, const vf* sk, const RowQK& x, const float* vr, float* orow, float decay, float b,
                       int64_t nv, vf* delta) {
  for (int64_t c = 0; c < nv; ++c) {
    delta[c] = (loadf(vr + c * L) - splat(decay) * sk[c]) * b;
    storef(orow + c * L, splat(decay) * sq[c] + splat(x.qk) * delta[c]);
  }
}

// S^T q, S^T k of a state S [Dk, Dv] (float32, or as stored; null: zero), then the row's output.
template <class S>
void read_state(const S* st, const RowQK& x, const float* vr, float* orow, float decay, float b, int64_t dk,
                int64_t dv, vf* delta) {
  const int64_t nv = dv / L;
  vf sq[MAX_DV / L] = {}, sk[MAX_DV / L] = {};
  if (st != nullptr)
    for (int64_t i = 0; i < dk; ++i) {
      const S* row = st + i * dv;
      const vf qi = splat(x.q[i]), ki = splat(x.k[i]);
      for (int64_t c = 0; c < nv; ++c) {
        const vf v = load16(row + c * L);
        sq[c] += v * qi;
        sk[c] += v * ki;
      }
    }
  finish_row(sq, sk, x, vr, orow, decay, b, nv, delta);
}

// A chunk's row r's update of S (float32, in cache) and, in the same pass, the next row's S^T q and
// S^T k read from the updated state (NEXT); STORE: the state rounded into `dst` first and carried on
// as stored. One pass over S a row where a read and an update took two: the same numbers.
template <bool STORE, bool NEXT, class T>
void update_and_read(float* st, T* dst, const RowQK& x, const RowQK& next, const vf* delta, float decay, int64_t dk,
                     int64_t dv, vf* sq, vf* sk) {
  const int64_t nv = dv / L;
  // local accumulators and delta: the state's stores cannot touch them, so they stay in registers
  vf aq[MAX_DV / L] = {}, ak[MAX_DV / L] = {}, d[MAX_DV / L];
  for (int64_t c = 0; c < nv; ++c) d[c] = delta[c];
  const vf dec = splat(decay);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = st + i * dv;
    const vf ki = splat(x.k[i]), qn = splat(NEXT ? next.q[i] : 0.f), kn = splat(NEXT ? next.k[i] : 0.f);
    for (int64_t c = 0; c < nv; ++c) {
      vf v = dec * loadf(row + c * L) + ki * d[c];
      if (STORE) {
        store16(dst + i * dv + c * L, v);
        v = load16(dst + i * dv + c * L);
      }
      storef(row + c * L, v);
      if (NEXT) {
        aq[c] += v * qn;
        ak[c] += v * kn;
      }
    }
  }
  for (int64_t c = 0; c < nv; ++c) {
    sq[c] = aq[c];
    sk[c] = ak[c];
  }
}

// S_out = e^g S + k delta^T, row by row (S_out may be S: each row is read before it is written).
template <class S, class D>
void update_state(const S* st, D* out, const float* k, const vf* delta, float decay, int64_t dk, int64_t dv) {
  const int64_t nv = dv / L;
  for (int64_t i = 0; i < dk; ++i) {
    const vf ki = splat(k[i]);
    if (st == nullptr)
      for (int64_t c = 0; c < nv; ++c) store16(out + i * dv + c * L, ki * delta[c]);
    else
      for (int64_t c = 0; c < nv; ++c)
        store16(out + i * dv + c * L, splat(decay) * load16(st + i * dv + c * L) + ki * delta[c]);
  }
}

template <class T>
void run_head(const Rows& R, T* states, int64_t block_stride, int64_t h, int64_t r0, int64_t r1, int64_t read,
              bool fresh, const int64_t* write_to, std::vector<float>& s, RowQK& x, RowQK& next) {
  const int64_t dk = R.dk, dv = R.dv, heads = R.heads, head_size = dk * dv, kh = h / R.per;
  auto load_row = [&](RowQK& into, int64_t r) {
    into.load(R.q + r * R.ld_q + kh * dk, R.k + r * R.ld_k + kh * dk, dk, R.l2norm, R.q_scale);
  };
  auto row_v = [&](int64_t r) { return R.v + r * R.ld_v + h * dv; };
  auto row_o = [&](int64_t r) { return R.o + (r * heads + h) * dv; };
  auto decay_of = [&](int64_t r) { return std::exp(R.g[r * heads + h]); };
  vf delta[MAX_DV / L];
  load_row(x, r0);
  const T* src = fresh ? nullptr : states + read * block_stride + h * head_size;
  if (r1 - r0 == 1 && write_to[r0] >= 0) {
    // A decode: one row from the state as stored to the block it writes (the same one mid-block),
    // read in place twice while it sits in cache, no float32 copy: the same numbers as a chunk's.
    T* dst = states + write_to[r0] * block_stride + h * head_size;
    read_state(src, x, row_v(r0), row_o(r0), decay_of(r0), R.beta[r0 * heads + h], dk, dv, delta);
    update_state(src, dst, x.k.data(), delta, decay_of(r0), dk, dv);
    return;
  }
  // A chunk: its first row reads the state; from then on each row's update reads the next row's
  // products in the same pass.
  load_state(s, src, fresh);
  read_state(s.data(), x, row_v(r0), row_o(r0), decay_of(r0), R.beta[r0 * heads + h], dk, dv, delta);
  for (int64_t r = r0; r < r1; ++r) {
    const bool more = r + 1 < r1;
    T* dst = write_to[r] >= 0 ? states + write_to[r] * block_stride + h * head_size : nullptr;
    vf sq[MAX_DV / L] = {}, sk[MAX_DV / L] = {};
    if (more) load_row(next, r + 1);
    const float dec = decay_of(r);
    if (dst && more)
      update_and_read<true, true>(s.data(), dst, x, next, delta, dec, dk, dv, sq, sk);
    else if (dst)
      update_and_read<true, false>(s.data(), dst, x, next, delta, dec, dk, dv, sq, sk);
    else if (more)
      update_and_read<false, true>(s.data(), dst, x, next, delta, dec, dk, dv, sq, sk);
    else
      update_and_read<false, false>(s.data(), dst, x, next, delta, dec, dk, dv, sq, sk);
    if (!more) break;
    std::swap(x, next);
    finish_row(sq, sk, x, row_v(r + 1), row_o(r + 1), decay_of(r + 1), R.beta[(r + 1) * heads + h], dv / L, delta);
  }
}

// One row of the scan: S_out = e^(dt A) S + (dt u) B^T (S as stored, float32, or null: zero; S_out
// may be S), y = S_out C + D u from the unrounded state.
template <class S, class D>
void scan_row(const S* st, D* out, const float* ur, const float* br, const float* cr, float* yr, float decay, float d,
              float skip, int64_t p_dim, int64_t n) {
  const int64_t nv = n / L;
  const vf dec = splat(decay);
  for (int64_t p = 0; p < p_dim; ++p) {
    const vf du = splat(d * ur[p]);
    vf acc{};
    for (int64_t j = 0; j < nv; ++j) {
      const vf prev = st != nullptr ? load16(st + p * n + j * L) : vf{};
      const vf x = dec * prev + du * loadf(br + j * L);
      store16(out + p * n + j * L, x);
      acc += x * loadf(cr + j * L);
    }
    yr[p] = hsum(acc) + skip * ur[p];
  }
}

// The scan's inputs, each row's heads (or groups) contiguous, rows any stride apart: u [T, H, P],
// b and c [T, G, N]; dt and the decay e^(dt A) [T, H] already made; D [H]; y [T, H, P] contiguous.
struct ScanRows {
  const float *u, *b, *c, *dt, *decay, *skip, *a;   // a: A = -e^(A_log) a head
  float* y;
  int64_t ld_u, ld_b, ld_c, heads, groups, p_dim, n;
};

// One row's update of PB state rows of NV vectors held in registers (unrolled whole, so that they
// stay there), y from the unrounded state; STORE: the rows rounded into dst and carried on so.
template <int NV, int PB, bool STORE, class T>
inline void scan_step(vf (&st)[PB][NV], vf dec, float d, float skip, const float* ur, const float* br,
                      const float* cr, float* yr, T* dst, int64_t n) {
#pragma GCC unroll 16
  for (int i = 0; i < PB; ++i) {
    const vf du = splat(d * ur[i]);
    vf acc{};
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      vf x = dec * st[i][j] + du * loadf(br + j * L);
      acc += x * loadf(cr + j * L);
      if (STORE) {
        store16(dst + i * n + j * L, x);
        x = load16(dst + i * n + j * L);
      }
      st[i][j] = x;
    }
    yr[i] = hsum(acc) + skip * ur[i];
  }
}

// A chunk's rows of one head, PB of the state's P rows at a time held in registers over a tile of
// rows (each state row evolves on its own: S[p] = e^(dt A) S[p] + dt u[p] B, y[p] = S[p] . C), the
// tile's B and C rows reused from cache by every PB: a row-by-row pass streamed the whole [P, N]
// state through L2 twice a row (a Granite prefill's scan ran at a fifth of the FMA rate).
// NV: vectors a state row (N / 16).
template <int NV, int PB, class T>
void scan_chunk(const ScanRows& R, T* states, int64_t block_stride, int64_t h, int64_t r0, int64_t r1,
                const int64_t* write_to, float* s) {
  constexpr int64_t TILE = 64;   // rows: their B and C (2 x 64 x N floats) stay in L2 across the P / PB passes
  const int64_t n = NV * L, head_size = R.p_dim * n, group = h / (R.heads / R.groups);
  for (int64_t a = r0; a < r1; a += TILE) {
    const int64_t b = std::min(r1, a + TILE);
    for (int64_t p0 = 0; p0 < R.p_dim; p0 += PB) {
      vf st[PB][NV];
#pragma GCC unroll 16
      for (int i = 0; i < PB; ++i)
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) st[i][j] = loadf(s + (p0 + i) * n + j * L);
      for (int64_t r = a; r < b; ++r) {
        const float* ur = R.u + r * R.ld_u + h * R.p_dim + p0;
        const float* br = R.b + r * R.ld_b + group * n;
        const float* cr = R.c + r * R.ld_c + group * n;
        const vf dec = splat(R.decay[r * R.heads + h]);
        const float d = R.dt[r * R.heads + h], skip = R.skip[h];
        float* yr = R.y + (r * R.heads + h) * R.p_dim + p0;
        if (write_to[r] < 0)
          scan_step<NV, PB, false, T>(st, dec, d, skip, ur, br, cr, yr, nullptr, n);
        else   // stored, and carried on as stored
          scan_step<NV, PB, true>(st, dec, d, skip, ur, br, cr, yr,
                                  states + write_to[r] * block_stride + h * head_size + p0 * n, n);
      }
#pragma GCC unroll 16
      for (int i = 0; i < PB; ++i)
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) storef(s + (p0 + i) * n + j * L, st[i][j]);
    }
  }
}

// Mamba-2's chunked form (its state-space duality) for a chunk of SSD_MIN rows or more: in each
// segment of up to SEG rows, with a_t the running sum of the segment's dt A,
//
//   y_t   = e^(a_t) C_t . S_in + sum_{s <= t} e^(a_t - a_s) (B_s . C_t) dt_s u_s + D u_t
//   S_out = e^(a_last) S_in + sum_s e^(a_last - a_s) dt_s u_s B_s^T
//
// as products of small matrices: ~1,200 vector FMAs a row and head at P 64, N 128, where the
// recurrence spends ~1,540 vector ops (a multiply and two FMAs for each 16 of the 8,192 state
// values) and 64 horizontal sums; 1.2-1.3x its speed on a 2-core Zen 4 (BENCHMARKS §61). Each product runs along a contiguous axis: y transposed, [P, rows], along
// the rows from C^T; the state in the pool's own layout [P, N] along N from the B rows. C^T and
// B . C are a group's, made once a segment before the heads run (ssd_group). Segments also end at
// every row that writes a state: it is stored there and the chunk goes on from it as stored, as
// the recurrence does.
struct Segment {
  int64_t r0, r1;
};

constexpr int64_t SEG = 64;   // rows a segment at most
constexpr int SV = SEG / L;   // vectors of a segment's rows
constexpr int64_t SSD_MIN = 16;   // shorter chunks run row by row (at 16-40 rows the chunked form led already)

// A task's scratch.
struct SsdWork {
  std::vector<float> mt, yt;
  explicit SsdWork(int64_t p) : mt(SEG * SEG), yt(p * SEG) {}
};

// A chunk's segments for the chunked form (count 0: the chunk runs row by row): their rows, and
// their groups' factors (ssd_group's).
struct SsdChunk {
  const Segment* segs;
  int64_t count;
  const float* factors;
  SsdWork* work;
};

// Chunk rows r0 .. r1 - 1 cut after every SEG rows and after each row that writes a state.
void cut_segments(int64_t r0, int64_t r1, const int64_t* write_to, std::vector<Segment>& out) {
  for (int64_t a = r0; a < r1;) {
    int64_t b = std::min(r1, a + SEG);
    for (int64_t r = a; r < b; ++r)
      if (write_to[r] >= 0) {
        b = r + 1;
        break;
      }
    out.push_back({a, b});
    a = b;
  }
}

// x kept in a register: GCC otherwise folds a vector's load into each FMA that reads it.
inline vf in_register(vf x) {
#if defined(__GNUC__) && defined(__AVX512F__)
  asm("" : "+v"(x));
#endif
  return x;
}

// A segment's factors of group g: ct [N, SEG] = C^T and bc [SEG, SEG] = B_s . C_t (zero past its rows).
void ssd_group(const ScanRows& R, Segment sg, int64_t g, float* ct, float* bc) {
  const int64_t len = sg.r1 - sg.r0, n = R.n;
  std::fill(ct, ct + n * SEG, 0.f);
  for (int64_t t = 0; t < len; ++t)
    for (int64_t k = 0; k < n; ++k) ct[k * SEG + t] = R.c[(sg.r0 + t) * R.ld_c + g * n + k];
  for (int64_t s = 0; s < SEG; ++s) {
    vf acc[SV] = {};
    if (s < len)
      for (int64_t k = 0; k < n; ++k) {
        const vf b = splat(R.b[(sg.r0 + s) * R.ld_b + g * n + k]);
#pragma GCC unroll 4
        for (int v = 0; v < SV; ++v) acc[v] += b * loadf(ct + k * SEG + v * L);
      }
    for (int v = 0; v < SV; ++v) storef(bc + s * SEG + v * L, acc[v]);
  }
}

// One segment of head h: y of its rows, and the state s [P, N] (float32) from S_in to S_out.
// TV: vectors of rows the segment's products run (len <= TV * 16).
template <int NV, int TV>
void ssd_segment(const ScanRows& R, int64_t h, Segment sg, const float* ct, const float* bc, float* s, SsdWork& w) {
  constexpr int RB = 16 / NV;   // state rows the update holds: RB x NV accumulators
  const int64_t len = sg.r1 - sg.r0, n = NV * L, p_dim = R.p_dim, group = h / (R.heads / R.groups);
  alignas(64) float cum[SEG] = {}, dts[SEG] = {}, to_end[SEG];
  float run = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    dts[t] = R.dt[(sg.r0 + t) * R.heads + h];
    cum[t] = run += dts[t] * R.a[h];
  }
  const float last = cum[len - 1];
  for (int64_t t = 0; t < len; ++t) to_end[t] = std::exp(last - cum[t]) * dts[t];
  auto u = [&](int64_t t) { return R.u + (sg.r0 + t) * R.ld_u + h * p_dim; };
  // mt [s, t] = e^(a_t - a_s) dt_s (B_s . C_t) for s <= t < len, else zero
  const vf lanes = __builtin_convertvector(IOTA, vf);
  vf cum_t[TV], e_t[TV];
  for (int v = 0; v < TV; ++v) {
    cum_t[v] = loadf(cum + v * L);
    e_t[v] = expv(cum_t[v]);
  }
  for (int64_t s = 0; s < len; ++s)
    for (int v = 0; v < TV; ++v) {
      const vf t = lanes + float(v * L);
      const vf x = expv(cum_t[v] - cum[s]) * dts[s] * loadf(bc + s * SEG + v * L);
      storef(w.mt.data() + s * SEG + v * L, (t >= float(s)) & (t < float(len)) ? x : vf{});
    }
  // y^T [P, SEG], 4 state rows at a time: e^(a_t) (S C^T), then the segment's own rows
  for (int64_t p0 = 0; p0 < p_dim; p0 += 4) {
    vf acc[4][TV] = {};
    const float* sr = s + p0 * n;
    for (int64_t k = 0; k < n; ++k) {
      vf cv[TV];
#pragma GCC unroll 4
      for (int v = 0; v < TV; ++v) cv[v] = in_register(loadf(ct + k * SEG + v * L));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const vf x = splat(sr[i * n + k]);
#pragma GCC unroll 4
        for (int v = 0; v < TV; ++v) acc[i][v] += x * cv[v];
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < TV; ++v) acc[i][v] *= e_t[v];
    for (int64_t s0 = 0; s0 < len; ++s0) {
      const int j = int(s0 / L);   // rows t < s0 are zero in mt: vectors below j are skipped
      vf mv[TV];
#pragma GCC unroll 4
      for (int v = 0; v < TV; ++v) mv[v] = v >= j ? in_register(loadf(w.mt.data() + s0 * SEG + v * L)) : vf{};
      const float* us = u(s0) + p0;
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const vf x = splat(us[i]);
#pragma GCC unroll 4
        for (int v = 0; v < TV; ++v)
          if (v >= j) acc[i][v] += x * mv[v];
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < TV; ++v) storef(w.yt.data() + (p0 + i) * SEG + v * L, acc[i][v]);
  }
  // y = (y^T)^T + D u, 16 x 16 at a time
  const vf skip = splat(R.skip[h]);
  for (int64_t t0 = 0; t0 < len; t0 += L)
    for (int64_t p0 = 0; p0 < p_dim; p0 += L) {
      vf x[L];
      for (int i = 0; i < L; ++i) x[i] = loadf(w.yt.data() + (p0 + i) * SEG + t0);
      transpose16(x);
      for (int64_t i = 0; i < L && t0 + i < len; ++i)
        storef(R.y + ((sg.r0 + t0 + i) * R.heads + h) * p_dim + p0, x[i] + skip * loadf(u(t0 + i) + p0));
    }
  // S_out, RB rows at a time along N: e^(a_last) S_in + sum_s (e^(a_last - a_s) dt_s u_s[p]) B_s
  const vf whole = splat(std::exp(last));
  const float* b0 = R.b + sg.r0 * R.ld_b + group * n;
  for (int64_t p0 = 0; p0 < p_dim; p0 += RB) {
    vf acc[RB][NV];
#pragma GCC unroll 16
    for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[i][v] = whole * loadf(s + (p0 + i) * n + v * L);
    for (int64_t t = 0; t < len; ++t) {
      vf bv[NV];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) bv[v] = in_register(loadf(b0 + t * R.ld_b + v * L));
      const float* ut = u(t) + p0;
#pragma GCC unroll 16
      for (int i = 0; i < RB; ++i) {
        const vf x = splat(ut[i] * to_end[t]);
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) acc[i][v] += x * bv[v];
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) storef(s + (p0 + i) * n + v * L, acc[i][v]);
  }
}

// A chunk's segments of head h from the state s [P, N] (loaded as stored), storing the state
// where a segment's last row writes one (and going on from it as stored). ssd.factors: the
// segments' ssd_group output, [segments, groups] of (ct, bc).
template <class T>
void ssd_chunk(const ScanRows& R, T* states, int64_t block_stride, int64_t h, const SsdChunk& ssd,
               const int64_t* write_to, std::vector<float>& s) {
  const int64_t head_size = R.p_dim * R.n, group = h / (R.heads / R.groups), per = R.n * SEG + SEG * SEG;
  for (int64_t j = 0; j < ssd.count; ++j) {
    const float* ct = ssd.factors + (j * R.groups + group) * per;
    const Segment sg = ssd.segs[j];
    auto rows = [&](auto nv) {   // a short segment (a chunk's tail) runs over its own rows only
      constexpr int NV = decltype(nv)::value;
      switch ((sg.r1 - sg.r0 + L - 1) / L) {
        case 1: ssd_segment<NV, 1>(R, h, sg, ct, ct + R.n * SEG, s.data(), *ssd.work); break;
        case 2: ssd_segment<NV, 2>(R, h, sg, ct, ct + R.n * SEG, s.data(), *ssd.work); break;
        case 3: ssd_segment<NV, 3>(R, h, sg, ct, ct + R.n * SEG, s.data(), *ssd.work); break;
        default: ssd_segment<NV, 4>(R, h, sg, ct, ct + R.n * SEG, s.data(), *ssd.work); break;
      }
    };
    switch (R.n / L) {
      case 1: rows(std::integral_constant<int, 1>()); break;
      case 2: rows(std::integral_constant<int, 2>()); break;
      case 4: rows(std::integral_constant<int, 4>()); break;
      case 8: rows(std::integral_constant<int, 8>()); break;
      default: rows(std::integral_constant<int, 16>()); break;
    }
    if (write_to[sg.r1 - 1] >= 0) store_state(s, states + write_to[sg.r1 - 1] * block_stride + h * head_size);
  }
}

// Whether the chunked form runs these heads: state sizes 16 .. 256 (a power of two), P a multiple of 16.
bool ssd_runs(int64_t p_dim, int64_t n) {
  return p_dim % L == 0 && (n == 16 || n == 32 || n == 64 || n == 128 || n == 256);
}

template <class T>
void scan_head(const ScanRows& R, T* states, int64_t block_stride, int64_t h, int64_t r0, int64_t r1, int64_t read,
               bool fresh, const int64_t* write_to, std::vector<float>& s, const SsdChunk& ssd) {
  const int64_t head_size = R.p_dim * R.n, g = h / (R.heads / R.groups);
  // row r's scan from the state st into out, as one pass (the decode's, and other state sizes')
  auto row = [&](int64_t r, const auto* st, auto* out) {
    scan_row(st, out, R.u + r * R.ld_u + h * R.p_dim, R.b + r * R.ld_b + g * R.n, R.c + r * R.ld_c + g * R.n,
             R.y + (r * R.heads + h) * R.p_dim, R.decay[r * R.heads + h], R.dt[r * R.heads + h], R.skip[h], R.p_dim,
             R.n);
  };
  if (r1 - r0 == 1 && write_to[r0] >= 0) {
    // A decode: one row from the state as stored to the block it writes (the same one mid-block),
    // in place, no float32 copy: the same numbers as a chunk's.
    row(r0, fresh ? nullptr : states + read * block_stride + h * head_size,
        states + write_to[r0] * block_stride + h * head_size);
    return;
  }
  if (r1 == r0) return;
  load_state(s, states + read * block_stride + h * head_size, fresh);
  if (ssd.count > 0) {
    ssd_chunk(R, states, block_stride, h, ssd, write_to, s);
    return;
  }
  // 16 state vectors in registers: PB rows of NV vectors
  auto chunk = [&](auto nv, auto pb) {
    scan_chunk<decltype(nv)::value, decltype(pb)::value>(R, states, block_stride, h, r0, r1, write_to, s.data());
  };
  using I = std::integral_constant<int, 1>;
  if (R.n == 128 && R.p_dim % 2 == 0)
    chunk(std::integral_constant<int, 8>(), std::integral_constant<int, 2>());
  else if (R.n == 64 && R.p_dim % 4 == 0)
    chunk(std::integral_constant<int, 4>(), std::integral_constant<int, 4>());
  else if (R.n == 32 && R.p_dim % 8 == 0)
    chunk(std::integral_constant<int, 2>(), std::integral_constant<int, 8>());
  else if (R.n == 16 && R.p_dim % 8 == 0)
    chunk(I(), std::integral_constant<int, 8>());
  else if (R.n == 256)
    chunk(std::integral_constant<int, 16>(), I());
  else
    for (int64_t r = r0; r < r1; ++r) {   // other state sizes: row by row
      row(r, s.data(), s.data());
      if (write_to[r] >= 0) store_state(s, states + write_to[r] * block_stride + h * head_size);
    }
}

// Each (row, head)'s dt = clamp(softplus(dt_raw + dt_bias), lo, hi) (torch's softplus: x past 20
// kept as is) and its decay e^(dt A), A = -e^(A_log), as the torch form computes them.
template <class T>
void dt_and_decay(const T* raw, int64_t ld, int64_t t, int64_t heads, const float* bias, const float* a_log,
                  double lo, double hi, float* dt, float* decay) {
  at::parallel_for(0, t, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        const float x = float(raw[r * ld + h]) + bias[h];
        const float sp = x > 20.f ? x : std::log1p(std::exp(x));
        const float v = std::min(std::max(sp, float(lo)), float(hi));
        dt[r * heads + h] = v;
        decay[r * heads + h] = std::exp(v * -std::exp(a_log[h]));
      }
  });
}

// The chunk table's checks both scans share: q_starts int64 [S + 1], read_blocks int64 [S], fresh
// bool [S], write_to int64 [T], blocks within the pool's nb.
void check_chunks(const char* op, const at::Tensor& q_starts, const at::Tensor& read_blocks, const at::Tensor& fresh,
                  const at::Tensor& write_to, int64_t t, int64_t nb) {
  const int64_t n = read_blocks.numel();
  TORCH_CHECK(q_starts.scalar_type() == at::kLong && read_blocks.scalar_type() == at::kLong &&
                  write_to.scalar_type() == at::kLong && fresh.scalar_type() == at::kBool && q_starts.numel() == n + 1 &&
                  fresh.numel() == n && write_to.numel() == t && q_starts.is_contiguous() && read_blocks.is_contiguous() &&
                  write_to.is_contiguous() && fresh.is_contiguous(),
              op, ": q_starts int64 [S + 1], read_blocks int64 [S], fresh bool [S], write_to int64 [T]");
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* rb = read_blocks.data_ptr<int64_t>();
  const int64_t* wt = write_to.data_ptr<int64_t>();
  const bool* fr = fresh.data_ptr<bool>();
  TORCH_CHECK(qs[0] == 0 && qs[n] <= t, op, ": q_starts out of range");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(qs[i] <= qs[i + 1] && (fr[i] || (rb[i] >= 0 && rb[i] < nb)), op, ": chunk ", i, " reads block ", rb[i],
                " of ", nb);
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(wt[r] < nb, op, ": row ", r, " writes block ", wt[r], " of ", nb);
}

}  // namespace

// y [T, H, P] float32 contiguous = the scan over rows q_starts[i] .. q_starts[i + 1] - 1 of chunk i
// plus D u, zero on rows past the last chunk: u [T, H, P], b and c [T, G, N] float32 (each row's
// values contiguous, rows any stride apart: views of the convolution's output), dt [T, H] before its
// bias and softplus (any float dtype, rows any stride apart: a view of in_proj's output), dt_bias,
// A_log and D [H], dt clamped to [dt_min, dt_max]; states and the chunk table as delta_rule's
// ([blocks, H, P, N]).
void mamba_scan(at::Tensor y, const at::Tensor& u, const at::Tensor& b, const at::Tensor& c, const at::Tensor& dt,
                const at::Tensor& dt_bias, const at::Tensor& a_log, const at::Tensor& skip, double dt_min,
                double dt_max, at::Tensor states, const at::Tensor& q_starts, const at::Tensor& read_blocks,
                const at::Tensor& fresh, const at::Tensor& write_to) {
  const int64_t t = u.size(0), heads = u.size(1), p_dim = u.size(2), groups = b.size(1), n = b.size(2);
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous(), "mamba_scan: y must be contiguous float32");
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&u, &b, &c})
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2),
                "mamba_scan: u, b and c float32, each row's values contiguous");
  TORCH_CHECK(y.sizes() == u.sizes() && c.sizes() == b.sizes() && b.size(0) == t && dt.dim() == 2 &&
                  dt.size(0) == t && dt.size(1) == heads && dt.stride(1) == 1 && heads % groups == 0,
              "mamba_scan: u and y [T, H, P], b and c [T, G, N] (G dividing H), dt [T, H]");
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&dt_bias, &a_log, &skip})
    TORCH_CHECK(x->numel() == heads, "mamba_scan: dt_bias, A_log and D must have one value a head (", heads, ")");
  TORCH_CHECK(n % L == 0, "mamba_scan: state_size must be a multiple of ", L, ", got ", n);
  TORCH_CHECK(states.dim() == 4 && states.size(1) == heads && states.size(2) == p_dim && states.size(3) == n &&
                  states.stride(3) == 1 && states.stride(2) == n && states.stride(1) == p_dim * n &&
                  (states.scalar_type() == at::kFloat || states.scalar_type() == at::kBFloat16),
              "mamba_scan: states [blocks, H, P, N], each block's rows contiguous, float32 or bf16");
  check_chunks("mamba_scan", q_starts, read_blocks, fresh, write_to, t, states.size(0));
  const at::Tensor bias = dt_bias.to(at::kFloat).contiguous(), al = a_log.to(at::kFloat).contiguous(),
                   dd = skip.to(at::kFloat).contiguous();
  std::vector<float> dtv(t * heads), decay(t * heads);
  auto prep = [&](auto tag) {
    using D = decltype(tag);
    dt_and_decay(dt.data_ptr<D>(), dt.stride(0), t, heads, bias.data_ptr<float>(), al.data_ptr<float>(), dt_min,
                 dt_max, dtv.data(), decay.data());
  };
  if (dt.scalar_type() == at::kFloat)
    prep(float());
  else if (dt.scalar_type() == at::kBFloat16)
    prep(c10::BFloat16());
  else if (dt.scalar_type() == at::kHalf)
    prep(c10::Half());
  else
    TORCH_CHECK(false, "mamba_scan: dt must be float32, bfloat16 or float16");
  std::vector<float> neg_a(heads);
  for (int64_t h = 0; h < heads; ++h) neg_a[h] = -std::exp(al.data_ptr<float>()[h]);
  const ScanRows R{u.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), dtv.data(), decay.data(),
                   dd.data_ptr<float>(), neg_a.data(), y.data_ptr<float>(), u.stride(0), b.stride(0), c.stride(0),
                   heads, groups, p_dim, n};
  const int64_t chunks = read_blocks.numel();
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* rb = read_blocks.data_ptr<int64_t>();
  const bool* fr = fresh.data_ptr<bool>();
  const int64_t* wt = write_to.data_ptr<int64_t>();
  // the chunked form's segments (chunk i's from first[i]) and their groups' factors
  std::vector<Segment> segs;
  std::vector<int64_t> first(chunks + 1, 0);
  for (int64_t i = 0; i < chunks; ++i) {
    first[i] = int64_t(segs.size());
    if (qs[i + 1] - qs[i] >= SSD_MIN && ssd_runs(p_dim, n)) cut_segments(qs[i], qs[i + 1], wt, segs);
  }
  first[chunks] = int64_t(segs.size());
  const int64_t per = n * SEG + SEG * SEG;
  // uninitialised: ssd_group writes every value (a vector's zero fill was a second pass over them)
  const std::unique_ptr<float[]> factors(new float[segs.size() * groups * per]);
  at::parallel_for(0, int64_t(segs.size()) * groups, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      float* f = factors.get() + j * per;
      ssd_group(R, segs[j / groups], j % groups, f, f + n * SEG);
    }
  });
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* st = states.data_ptr<T>();
    at::parallel_for(0, chunks * heads, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> s(p_dim * n);
      std::unique_ptr<SsdWork> work = segs.empty() ? nullptr : std::make_unique<SsdWork>(p_dim);
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t h = p / chunks, i = p % chunks;   // head-major (see the top)
        const SsdChunk ssd{segs.data() + first[i], first[i + 1] - first[i],
                           factors.get() + first[i] * groups * per, work.get()};
        scan_head<T>(R, st, states.stride(0), h, qs[i], qs[i + 1], rb[i], fr[i], wt, s, ssd);
      }
    });
  };
  if (states.scalar_type() == at::kFloat)
    run(float());
  else
    run(c10::BFloat16());
  // rows past the last chunk (a padded step's) are in no chunk: zero, not whatever y held
  std::fill(y.data_ptr<float>() + qs[chunks] * heads * p_dim, y.data_ptr<float>() + t * heads * p_dim, 0.f);
}

// o [T, H, Dv] float32 = the rule over rows q_starts[i] .. q_starts[i + 1] - 1 of chunk i (q, k
// [T, Hk, Dk] and v [T, H, Dv], each row's heads contiguous, rows any stride apart; beta and g [T,
// H]; all float32), value head h reading key head h / (H / Hk), q and k L2-normed first (q then
// times q_scale) when l2norm; each chunk from the state in block read_blocks[i] of `states`
// ([blocks, H, Dk, Dv] in the pool's dtype, rows of a block contiguous, blocks states.stride(0)
// apart), or zero where fresh[i]; write_to [T]: the block a row's state is written into, -1 none.
void delta_rule(at::Tensor o, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                const at::Tensor& g, at::Tensor states, const at::Tensor& q_starts, const at::Tensor& read_blocks,
                const at::Tensor& fresh, const at::Tensor& write_to, bool l2norm, double q_scale) {
  const int64_t t = v.size(0), heads = v.size(1), k_heads = q.size(1), dk = q.size(2), dv = v.size(2),
                n = read_blocks.size(0);
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&o, &q, &k, &v, &beta, &g})
    TORCH_CHECK(x->scalar_type() == at::kFloat, "delta_rule: q, k, v, beta, g and o must be float32");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && q.size(0) == t && k_heads > 0 &&
                  heads % k_heads == 0 && o.sizes() == v.sizes() && o.is_contiguous() && beta.is_contiguous() &&
                  g.is_contiguous() && beta.numel() == t * heads && g.numel() == t * heads,
              "delta_rule: q, k [T, Hk, Dk] (Hk dividing H), v and o [T, H, Dv], beta and g [T, H]");
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2), "delta_rule: each row's heads of q, k and v contiguous");
  TORCH_CHECK(dv % L == 0 && dv <= MAX_DV, "delta_rule: v_dim must be a multiple of ", L, " up to ", MAX_DV, ", got ",
              dv);
  TORCH_CHECK(states.dim() == 4 && states.size(1) == heads && states.size(2) == dk && states.size(3) == dv &&
                  states.stride(3) == 1 && states.stride(2) == dv && states.stride(1) == dk * dv &&
                  (states.scalar_type() == at::kFloat || states.scalar_type() == at::kBFloat16),
              "delta_rule: states [blocks, H, Dk, Dv], each block's rows contiguous, float32 or bf16");
  check_chunks("delta_rule", q_starts, read_blocks, fresh, write_to, t, states.size(0));
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* rb = read_blocks.data_ptr<int64_t>();
  const int64_t* wt = write_to.data_ptr<int64_t>();
  const bool* fr = fresh.data_ptr<bool>();
  const Rows R{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), beta.data_ptr<float>(),
               g.data_ptr<float>(), o.data_ptr<float>(), q.stride(0), k.stride(0), v.stride(0), heads,
               heads / k_heads, dk, dv, l2norm, float(q_scale)};
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* st = states.data_ptr<T>();
    at::parallel_for(0, n * heads, 1, [&](int64_t b, int64_t e) {
      std::vector<float> s(dk * dv);
      RowQK x{std::vector<float>(dk), std::vector<float>(dk)}, next{std::vector<float>(dk), std::vector<float>(dk)};
      for (int64_t p = b; p < e; ++p) {
        // head-major (see the top): chunk-major put a long prompt's heads on one thread, and a
        // prefill step with one long chunk among short ones ran at 0.55x
        const int64_t h = p / n, i = p % n;
        if (qs[i] < qs[i + 1]) run_head<T>(R, st, states.stride(0), h, qs[i], qs[i + 1], rb[i], fr[i], wt, s, x, next);
      }
    });
  };
  if (states.scalar_type() == at::kFloat)
    run(float());
  else
    run(c10::BFloat16());
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("delta_rule(Tensor(a!) o, Tensor q, Tensor k, Tensor v, Tensor beta, Tensor g, Tensor(b!) states, "
        "Tensor q_starts, Tensor read_blocks, Tensor fresh, Tensor write_to, bool l2norm=False, float q_scale=1.0) -> ()");
  m.def("mamba_scan(Tensor(a!) y, Tensor u, Tensor b, Tensor c, Tensor dt, Tensor dt_bias, Tensor A_log, Tensor D, "
        "float dt_min, float dt_max, Tensor(b!) states, Tensor q_starts, Tensor read_blocks, Tensor fresh, "
        "Tensor write_to) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("delta_rule", &pagedllm::delta_rule);
  m.impl("mamba_scan", &pagedllm::mamba_scan);
}
